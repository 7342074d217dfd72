"""Accuracy vs latency over many runs: a table (Markdown + CSV), a Pareto plot (PNG) and the best recipe
under a latency or size budget, from the ``summary.json`` of every run under a directory.

The accuracy axis is the ``.pte``'s validation perplexity (``--metric ppl``, lower is better) or any
column of the table, e.g. an lm-eval task metric of the ``.pte`` (``--metric hellaswag/acc``, from the
summary's ``eval`` section). The latency axis is the ``.pte``'s decode latency (ms per token, median of the joint
benchmark ``bench_joint`` when the summary has one, else of the run's own ``qharness bench``).

The work is split by job: ``collect.py`` (summaries -> checked rows), ``metric.py`` (``--metric`` -> column),
``ranking.py`` (comparisons with ties inside the noise, the fronts, the pick), ``render.py`` (Markdown and CSV),
``plot.py`` (the PNGs), ``recovery.py`` (what QAT recovers), ``answers.py`` (chat runs' answer quality),
``tracking.py`` (wandb); this module chains them.

Differences inside the noise are ties; runs whose ``.pte`` failed the parity gate are shown but never on the front
or picked (``ranking.py`` says how).

A summary.json is data, never markup: a summary with a field of the wrong type is skipped with a one-line note
naming it (``checked_row``); text from summaries and directory names is made one line, a CSV cell that would start a
spreadsheet formula gets a leading ``'`` (``csv_cell``) and Markdown escapes table pipes and HTML tags (``md_cell``).

Example::

    result = write_report("runs/sweep_xnnpack", max_latency_ms=2.0)
    print(result["markdown"]); print(result["best"]["recipe"])
"""

from __future__ import annotations

from pathlib import Path

from qharness.io.atomic import write_bytes_atomic, write_json_atomic
from qharness.io.names import check_output_dir
from qharness.io.temps import remove_stale_temps
from qharness.reporting.answers import answer_lines
from qharness.reporting.collect import collect
from qharness.reporting.metric import resolve_metric
from qharness.reporting.plot import plot_pareto
from qharness.reporting.ranking import Comparisons, best_choice, noise_notes, noisy_front
from qharness.reporting.recovery import qat_recovery
from qharness.reporting.render import (
    INTERVALS_NOTE,
    csv_text,
    latency_class_lines,
    markdown_report,
    markdown_table,
    public,
)
from qharness.reporting.rows import _number
from qharness.reporting.tracking import log_to_wandb


def write_report(
    runs_dir: str | Path,
    out: str | Path | None = None,
    metric: str = "ppl",
    max_latency_ms: float | None = None,
    max_size_mb: float | None = None,
    wandb: bool = True,
    notes: list[str] | None = None,
) -> dict:
    """Collect, rank and write ``report.md``, ``report.csv``, ``report.json`` and ``pareto.png`` into ``out``
    (default ``runs_dir``); log them to wandb; return what was written (rows, front, best, paths)."""
    runs_dir = Path(runs_dir)
    out = check_output_dir(Path(out) if out is not None else runs_dir, "--out" if out is not None else "RUNS_DIR")
    remove_stale_temps(out)  # what a killed report left behind
    skipped: list[str] = []
    rows = collect(runs_dir, skipped)
    column, lower = resolve_metric(metric, rows)
    rows.sort(key=lambda r: (r["decode_ms_per_token"] is None, r["decode_ms_per_token"] or 0.0, r["run"]))
    cmp = Comparisons(column, lower)  # each pair compared once for both fronts and the pick
    front, ties = noisy_front(rows, column, lower, cmp=cmp)
    front_runs = {r["run"] for r in front}
    size_front, _ = noisy_front(rows, column, lower, axis="size", cmp=cmp)  # accuracy vs .pte size
    size_runs = {r["run"] for r in size_front}
    choice = best_choice(rows, column, lower, max_latency_ms, max_size_mb, cmp=cmp)
    for r in rows:
        r["pareto"] = r["run"] in front_runs
        r["pareto_size"] = r["run"] in size_runs
        r["ties"] = "tie with " + names(ties[r["run"]]) if ties.get(r["run"]) else None
    classes = latency_class_lines(rows)  # before the columns: it names each class (latency_class_id)
    columns = list(dict.fromkeys(c for r in rows for c in r if not c.startswith("_")))
    name = ".pte perplexity" if column == "ppl_pte" else column
    title = f"{runs_dir.name}: {name} vs decode latency"
    md = markdown_table(rows, column, front_runs, size_runs)
    lines = [md, "", INTERVALS_NOTE, ""]
    lines += classes + front_lines(front, ties, size_front, column, lower)
    lines.append(f"Best under {budget_text(max_latency_ms, max_size_mb)}: {choice['text']}")
    lines += qat_recovery(rows) + answer_lines(rows) + noise_notes(rows, column) + load_note(rows) + (notes or [])
    lines += skipped
    png = plot_pareto(rows, column, lower, front_runs, title, max_latency_ms)
    size_title = f"{runs_dir.name}: {name} vs .pte size"
    size_png = plot_pareto(rows, column, lower, size_runs, size_title, axis="size", max_size_mb=max_size_mb)
    paths = {
        "markdown": write_bytes_atomic(out / "report.md", markdown_report(title, md, lines[1:]).encode()),
        "csv": write_bytes_atomic(out / "report.csv", csv_text(rows, columns).encode()),
        "png": write_bytes_atomic(out / "pareto.png", png),
        "size_png": write_bytes_atomic(out / "pareto_size.png", size_png),
    }
    result = {
        "metric": column,
        "lower_is_better": lower,
        "rows": rows,
        "front": [r["run"] for r in front],
        "front_size": [r["run"] for r in size_front],
        "best": choice["best"],
        "best_tied_with": [r["run"] for r in choice["tied"]],
        "budget": {"max_latency_ms": max_latency_ms, "max_size_mb": max_size_mb},
        "text": "\n".join(lines),
    }
    saved = {k: v for k, v in result.items() if k != "text"} | {
        "rows": [public(r) for r in rows],
        "best": public(choice["best"]),
    }
    paths["json"] = write_json_atomic(out / "report.json", saved)
    result["paths"] = {k: str(v) for k, v in paths.items()}
    result["wandb_dir"] = str(log_to_wandb(rows, columns, column, paths["png"], out, runs_dir.name)) if wandb else None
    return result


MAX_NAMED = 10  # runs named in one "tie with" list; the rest counted


def names(runs: list[str]) -> str:
    """``a, b, c`` (at most ``MAX_NAMED``, then ``and N more``): a run can tie with thousands."""
    more = f" and {len(runs) - MAX_NAMED} more" if len(runs) > MAX_NAMED else ""
    return ", ".join(runs[:MAX_NAMED]) + more


def budget_text(max_latency_ms: float | None, max_size_mb: float | None) -> str:
    """The budgets in words, e.g. ``decode <= 2 ms/token and .pte <= 1.5 MB`` (``no budget``)."""
    parts = [
        f"decode <= {max_latency_ms:g} ms/token" if max_latency_ms is not None else "",
        f".pte <= {max_size_mb:g} MB" if max_size_mb is not None else "",
    ]
    return " and ".join(p for p in parts if p) or "no budget"


def front_lines(
    front: list[dict], ties: dict[str, list[str]], size_front: list[dict], column: str, lower: bool
) -> list[str]:
    """The two Pareto fronts in words: by latency (with the ties among its runs) and by ``.pte`` size."""
    front_runs = {r["run"] for r in front}

    def on_front(r):
        tied = [t for t in ties[r["run"]] if t in front_runs]
        return f"{r['recipe']}/{r['mode']} ({r['run']}" + (f", tie with {names(tied)})" if tied else ")")

    better = "lower" if lower else "higher"
    return [
        f"Pareto front ({better} {column} is better, lower latency is better; differences inside the noise are ties): "
        + ("; ".join(on_front(r) for r in front) or "no run with a passed parity gate and a benchmark"),
        f"Pareto front by .pte size ({better} {column} is better, smaller is better; pareto_size.png): "
        + (
            "; ".join(f"{r['recipe']}/{r['mode']} ({r['run']}, {r['pte_size_mb']:.3f} MB)" for r in size_front)
            or "no run with a passed parity gate and a .pte size"
        ),
    ]


def load_note(rows: list[dict]) -> list[str]:
    """A note when benchmarks ran while other processes kept the CPUs busy (load average above the CPU count)."""
    loaded = [
        r
        for r in rows
        if _number(r.get("bench_load_avg")) and r.get("bench_cpus") and r["bench_load_avg"] > r["bench_cpus"]
    ]
    if not loaded:
        return []
    worst = max(loaded, key=lambda r: r["bench_load_avg"] / r["bench_cpus"])
    return [
        f"Note: {len(loaded)} of {len(rows)} benchmarks ran while other processes kept the CPUs busy (load average up to "
        f"{worst['bench_load_avg']:.1f} on {worst['bench_cpus']} CPUs): their latencies are noisy. Re-measure on a quiet "
        "machine with `qharness bench --pte RUN/model.pte` (it updates summary.json), then rerun `qharness report`."
    ]
