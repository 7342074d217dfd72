"""Accuracy vs latency over many runs: a table (Markdown + CSV), a Pareto plot (PNG) and the best recipe
under a latency or size budget, from the ``summary.json`` of every run under a directory.

The accuracy axis is the ``.pte``'s validation perplexity (``--metric ppl``, lower is better) or any
column of the table, e.g. an lm-eval task metric of the ``.pte`` (``--metric hellaswag/acc``, from the
summary's ``eval`` section). The latency axis is the ``.pte``'s decode latency (ms per token, median of
``qharness bench``). A run is on the Pareto front when no other run is at least as fast *and* at least as
accurate, and strictly better in one of the two; runs whose ``.pte`` failed the parity gate are shown but never
on the front or picked.

Example::

    result = write_report("runs/sweep_xnnpack", max_latency_ms=2.0)
    print(result["markdown"]); print(result["best"]["recipe"])
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
from pathlib import Path

from qharness.errors import UserError
from qharness.io import write_bytes_atomic, write_json_atomic

log = logging.getLogger(__name__)

LOWER_IS_BETTER = re.compile(r"(ppl|perplexity|loss|bits_per_byte|bpb|error|latency|_ms|size|rss|diff)", re.IGNORECASE)
STAGES = ("fp", "fake_quant", "converted", "pte")


# --- one run -> one row -------------------------------------------------------------------------
def _median(d):
    return d.get("median") if isinstance(d, dict) else d


def run_mode(summary: dict) -> str:
    """``fp`` for an unquantized recipe (the baseline, e.g. ``xnnpack_fp32``), else the run's ``ptq``/``qat``."""
    quantized = summary.get("quantized")
    if quantized is None:  # a summary written before "quantized" was recorded
        try:
            from qharness.recipes.registry import load_recipe

            quantized = load_recipe(summary["recipe"]).quantized
        except Exception:
            quantized = not summary["recipe"].endswith(("_fp32", "_fp16", "_bf16"))
    return summary["mode"] if quantized else "fp"


def _metric_name(name: str) -> str:
    """lm-eval's ``acc,none`` -> ``acc`` (the default filter); other filters stay (``exact_match,strict``)."""
    return name[: -len(",none")] if name.endswith(",none") else name


def summary_row(summary: dict, run: str | None = None) -> dict:
    """The flat row of one run: what the report tables and the wandb final row hold.

    ``eval/<task>/<metric>/<stage>`` columns come from the summary's ``eval`` section when present.
    """
    m = summary.get("metrics", {})
    parity = summary.get("parity", {})
    pte_bench = summary.get("bench", {}).get("pte", {})
    decode = _median(pte_bench.get("decode_tok_s"))
    ppl = {k: m.get(k, {}).get("ppl") for k in STAGES}
    row = {
        "run": run if run is not None else Path(summary.get("run_dir", "")).name,
        "model": summary.get("model"),
        "recipe": summary.get("recipe"),
        "backend": summary.get("backend"),
        "mode": run_mode(summary),
        "ppl_fp": ppl["fp"],
        "ppl_fake_quant": ppl["fake_quant"],
        "ppl_converted": ppl["converted"],
        "ppl_pte": ppl["pte"],
        "ppl_pte_vs_fp": ppl["pte"] / ppl["fp"] - 1 if ppl["pte"] and ppl["fp"] else None,
        "parity_passed": parity.get("passed"),
        "parity_max_abs_diff": parity.get("max_abs_diff"),
        "parity_argmax_agreement": parity.get("argmax_agreement"),
        "parity_ppl_rel_diff": parity.get("ppl_rel_diff"),
        "pte_size_mb": summary["pte"]["size_bytes"] / 1e6 if summary.get("pte", {}).get("size_bytes") else None,
        "prefill_tok_s": _median(pte_bench.get("prefill_tok_s")),
        "decode_tok_s": decode,
        "decode_ms_per_token": 1000.0 / decode if decode else None,
        "bandwidth_fraction": pte_bench.get("bandwidth_fraction"),
        "peak_rss_mb": pte_bench.get("peak_rss_mb"),
        "decode_speedup_vs_eager": summary.get("bench", {}).get("pte_vs_eager", {}).get("decode_speedup"),
        "bench_load_avg": summary.get("bench", {}).get("load_avg_1m"),
        "bench_cpus": summary.get("bench", {}).get("cpus"),
    }
    for task, stages in sorted((summary.get("eval") or {}).get("tasks", {}).items()):
        for stage, values in sorted((stages or {}).items(), key=lambda kv: STAGES.index(kv[0]) if kv[0] in STAGES else 99):
            for name, value in sorted((values or {}).items()):
                if "stderr" in name or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                row[f"eval/{task}/{_metric_name(name)}/{stage}"] = float(value)
    return row


# --- many runs ----------------------------------------------------------------------------------
def collect(runs_dir: str | Path) -> list[dict]:
    """The rows of every ``summary.json`` under ``runs_dir`` (unreadable ones are skipped with a warning)."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise UserError(f"{runs_dir} is not a directory", fix="pass the directory that holds the runs (e.g. runs/ or runs/sweep_xnnpack)")
    rows = []
    for path in sorted(runs_dir.rglob("summary.json")):
        if "wandb" in path.relative_to(runs_dir).parts:
            continue
        try:
            summary = json.loads(path.read_text())
            rows.append(summary_row(summary, run=str(path.parent.relative_to(runs_dir)) if path.parent != runs_dir else runs_dir.name))
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("skipping %s: %s", path, e)
    if not rows:
        raise UserError(f"no summary.json under {runs_dir}", fix="run qharness fit/calibrate/sweep first, or pass the directory that holds their runs")
    return rows


def resolve_metric(metric: str, rows: list[dict]) -> tuple[str, bool]:
    """``--metric`` -> (table column, lower is better). ``ppl`` is the ``.pte``'s validation perplexity;
    ``TASK/METRIC`` the ``.pte``'s lm-eval metric (``TASK/METRIC/STAGE`` another stage's); any column name works."""
    columns = {c for r in rows for c in r}
    if metric == "ppl":
        column = "ppl_pte"
    elif metric in columns:
        column = metric
    else:
        parts = metric.removeprefix("eval/").split("/")
        column = "eval/" + "/".join(parts + ["pte"] if len(parts) == 2 else parts)
        if column not in columns:
            known = sorted({"/".join(c.split("/")[1:3]) for c in columns if c.startswith("eval/")})
            raise UserError(
                f"metric {metric!r} is in none of the summaries",
                fix="use ppl, a column of the table" + (f", or a task metric: {', '.join(known)}" if known else " (no run has lm-eval results)"),
            )
    return column, bool(LOWER_IS_BETTER.search(column.split("/")[-2] if column.startswith("eval/") else column))


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def eligible(row: dict, column: str) -> bool:
    """Shippable and measured: parity passed, decode latency and the metric known."""
    return row.get("parity_passed") is True and _number(row.get("decode_ms_per_token")) and _number(row.get(column))


def pareto_front(points: list[tuple[float, float]], lower_is_better: bool) -> list[int]:
    """Indices of the points (latency, metric) no other point dominates (lower latency is better; the metric's
    direction is ``lower_is_better``), sorted by latency.

    >>> pareto_front([(1, 10), (2, 8), (3, 9), (4, 5)], lower_is_better=True)
    [0, 1, 3]
    """
    sign = 1 if lower_is_better else -1
    pts = [(x, sign * y) for x, y in points]  # now lower is better on both axes
    front = [
        i for i, (x, y) in enumerate(pts)
        if not any(xo <= x and yo <= y and (xo < x or yo < y) for j, (xo, yo) in enumerate(pts) if j != i)
    ]
    return sorted(front, key=lambda i: (points[i][0], sign * points[i][1]))


def best_under(rows: list[dict], column: str, lower_is_better: bool, max_latency_ms: float | None = None, max_size_mb: float | None = None) -> dict | None:
    """The eligible row with the best metric within the budgets (ties: faster, then smaller); None if none fits."""
    fits = [
        r for r in rows
        if eligible(r, column)
        and (max_latency_ms is None or r["decode_ms_per_token"] <= max_latency_ms)
        and (max_size_mb is None or (r.get("pte_size_mb") is not None and r["pte_size_mb"] <= max_size_mb))
    ]
    if not fits:
        return None
    sign = 1 if lower_is_better else -1
    return min(fits, key=lambda r: (sign * r[column], r["decode_ms_per_token"], r.get("pte_size_mb") or 0.0))


# --- output -------------------------------------------------------------------------------------
def _fmt(v, kind: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "passed" if v else "FAILED"
    if kind == "pct":
        return f"{v:+.1%}"
    if kind == "frac":
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def table_columns(rows: list[dict], column: str) -> list[tuple[str, str, str]]:
    """(key, header, format) of the Markdown table: the metric first, then latency, size and parity."""
    cols = [("run", "run", ""), ("recipe", "recipe", ""), ("mode", "mode", "")]
    if column != "ppl_pte":
        cols.append((column, column.removeprefix("eval/").removesuffix("/pte"), ""))
    cols += [
        ("ppl_pte", ".pte ppl", ""), ("ppl_pte_vs_fp", "vs FP", "pct"), ("ppl_fake_quant", "fake-quant ppl", ""),
        ("decode_ms_per_token", "decode ms/tok", ""), ("decode_tok_s", "decode tok/s", ""), ("prefill_tok_s", "prefill tok/s", ""),
        ("pte_size_mb", ".pte MB", ""), ("bandwidth_fraction", "of bw bound", "frac"), ("parity_passed", "parity", ""),
    ]
    extra = sorted({c for r in rows for c in r if c.startswith("eval/") and c.endswith("/pte") and c != column})
    cols += [(c, c.removeprefix("eval/").removesuffix("/pte"), "") for c in extra]
    return cols


def markdown_table(rows: list[dict], column: str, front_runs: set[str]) -> str:
    cols = table_columns(rows, column)
    header = [h for _, h, _ in cols] + ["Pareto"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        cells = [_fmt(r.get(k), f) for k, _, f in cols] + ["*" if r["run"] in front_runs else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def csv_text(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


MODE_COLORS = {"fp": "black", "ptq": "tab:blue", "qat": "tab:orange"}


def plot_pareto(rows: list[dict], column: str, lower_is_better: bool, front_runs: set[str], title: str,
                max_latency_ms: float | None = None) -> bytes:
    """The PNG: metric vs decode latency, point area ~ ``.pte`` size, the Pareto front drawn and labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if _number(r.get("decode_ms_per_token")) and _number(r.get(column))]
    sizes = [r.get("pte_size_mb") or 0.0 for r in pts]
    biggest = max(sizes, default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for mode, color in MODE_COLORS.items():
        sel = [r for r in pts if r["mode"] == mode and r.get("parity_passed") is True]
        if sel:
            ax.scatter([r["decode_ms_per_token"] for r in sel], [r[column] for r in sel], s=[60 + 540 * (r.get("pte_size_mb") or 0) / biggest for r in sel],
                       c=color, alpha=0.55, edgecolors=color, linewidths=1)
            ax.scatter([], [], s=60, c=color, alpha=0.55, label=mode)  # legend entry of a fixed size
    failed = [r for r in pts if r.get("parity_passed") is not True]
    if failed:
        ax.scatter([r["decode_ms_per_token"] for r in failed], [r[column] for r in failed], s=80, marker="x", c="gray", label="parity failed/skipped")
    front = sorted((r for r in pts if r["run"] in front_runs), key=lambda r: r["decode_ms_per_token"])
    if front:
        ax.plot([r["decode_ms_per_token"] for r in front], [r[column] for r in front], "-", drawstyle="steps-post", color="crimson", lw=1.5,
                zorder=0, label="Pareto front")
        ax.scatter([r["decode_ms_per_token"] for r in front], [r[column] for r in front], s=18, c="crimson", zorder=3)
    fp_ppl = {round(r["ppl_fp"], 9) for r in rows if _number(r.get("ppl_fp"))}
    if column == "ppl_pte" and len(fp_ppl) == 1:  # every run starts from the same FP model
        ax.axhline(fp_ppl.pop(), ls=":", color="black", lw=1, label="FP model before quantization (PyTorch)")
    for r in pts:
        on = r["run"] in front_runs
        radius = math.sqrt(60 + 540 * (r.get("pte_size_mb") or 0) / biggest) / 2  # points: label beside the marker
        ax.annotate(f"{r['recipe']}/{r['mode']}", (r["decode_ms_per_token"], r[column]), xytext=(radius + 2, radius / 2 + 2), textcoords="offset points",
                    fontsize=8, fontweight="bold" if on else "normal", color="crimson" if on else "dimgray")
    if max_latency_ms is not None:
        ax.axvline(max_latency_ms, ls="--", color="gray", lw=1, label=f"latency budget {max_latency_ms:g} ms")
    ax.set_xlabel("decode latency of the .pte (ms/token, median; lower is better)")
    label = ".pte validation perplexity" if column == "ppl_pte" else column
    ax.set_ylabel(f"{label} ({'lower' if lower_is_better else 'higher'} is better)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.2, y=0.12)  # room for the labels
    ax.legend(loc="best", fontsize=8, title=f"point area ~ .pte size (largest {biggest:.2f} MB)", title_fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def describe(row: dict | None, column: str) -> str:
    if row is None:
        return "none"
    metric = "ppl" if column == "ppl_pte" else column
    return (f"{row['recipe']}/{row['mode']} ({row['run']}): {metric} {_fmt(row[column])}, {row['decode_ms_per_token']:.3f} ms/token, "
            f"{_fmt(row.get('pte_size_mb'))} MB")


def log_to_wandb(rows: list[dict], columns: list[str], column: str, png: Path, out_dir: Path, name: str, project: str = "qharness") -> Path | None:
    """The table, a scatter chart (metric vs decode ms/token) and the PNG in one wandb run under ``out_dir/wandb``."""
    from qharness.reporting.tracking import use_wandb_mode

    if use_wandb_mode() == "disabled":
        return None
    import wandb

    run = wandb.init(project=project, dir=str(out_dir), name=f"report-{name}", job_type="report", group=name,
                     config={"metric": column, "runs": len(rows)})
    table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
    run.log({
        "report/table": table,
        "report/scatter": wandb.plot.scatter(table, "decode_ms_per_token", column, title=f"{column} vs decode ms/token"),
        "report/pareto": wandb.Image(str(png)),
    })
    run_dir = Path(run.dir).parent
    run.finish()
    return run_dir


def write_report(runs_dir: str | Path, out: str | Path | None = None, metric: str = "ppl", max_latency_ms: float | None = None,
                 max_size_mb: float | None = None, wandb: bool = True, notes: list[str] | None = None) -> dict:
    """Collect, rank and write ``report.md``, ``report.csv``, ``report.json`` and ``pareto.png`` into ``out``
    (default ``runs_dir``); log them to wandb; return what was written (rows, front, best, paths)."""
    runs_dir = Path(runs_dir)
    out = Path(out) if out is not None else runs_dir
    rows = collect(runs_dir)
    column, lower = resolve_metric(metric, rows)
    rows.sort(key=lambda r: (r["decode_ms_per_token"] is None, r["decode_ms_per_token"] or 0.0, r["run"]))
    ok = [r for r in rows if eligible(r, column)]
    front = [ok[i] for i in pareto_front([(r["decode_ms_per_token"], r[column]) for r in ok], lower)]
    front_runs = {r["run"] for r in front}
    best = best_under(rows, column, lower, max_latency_ms, max_size_mb)
    for r in rows:
        r["pareto"] = r["run"] in front_runs
    columns = list(dict.fromkeys(c for r in rows for c in r))
    budget = " and ".join(b for b in (f"decode <= {max_latency_ms:g} ms/token" if max_latency_ms is not None else "",
                                      f".pte <= {max_size_mb:g} MB" if max_size_mb is not None else "") if b) or "no budget"
    title = f"{runs_dir.name}: {'.pte perplexity' if column == 'ppl_pte' else column} vs decode latency"
    md = markdown_table(rows, column, front_runs)
    lines = [md, "", f"Pareto front ({'lower' if lower else 'higher'} {column} is better, lower latency is better): "
             + ("; ".join(f"{r['recipe']}/{r['mode']}" for r in front) or "no run with a passed parity gate and a benchmark"),
             f"Best under {budget}: {describe(best, column)}"]
    loaded = [r for r in rows if _number(r.get("bench_load_avg")) and r.get("bench_cpus") and r["bench_load_avg"] > r["bench_cpus"]]
    if loaded:
        worst = max(loaded, key=lambda r: r["bench_load_avg"] / r["bench_cpus"])
        lines.append(f"Note: {len(loaded)} of {len(rows)} benchmarks ran while other processes kept the CPUs busy (load average up to "
                     f"{worst['bench_load_avg']:.1f} on {worst['bench_cpus']} CPUs): their latencies are noisy. Re-measure on a quiet "
                     "machine with `qharness bench --pte RUN/model.pte` (it updates summary.json), then rerun `qharness report`.")
    lines += notes or []
    text = "\n".join(lines)
    png = plot_pareto(rows, column, lower, front_runs, title, max_latency_ms)
    paths = {
        "markdown": write_bytes_atomic(out / "report.md", (f"# {title}\n\n{text}\n").encode()),
        "csv": write_bytes_atomic(out / "report.csv", csv_text(rows, columns).encode()),
        "png": write_bytes_atomic(out / "pareto.png", png),
    }
    result = {"metric": column, "lower_is_better": lower, "rows": rows, "front": [r["run"] for r in front],
              "best": best, "budget": {"max_latency_ms": max_latency_ms, "max_size_mb": max_size_mb}, "text": text}
    paths["json"] = write_json_atomic(out / "report.json", {k: v for k, v in result.items() if k != "text"})
    result["paths"] = {k: str(v) for k, v in paths.items()}
    result["wandb_dir"] = str(log_to_wandb(rows, columns, column, paths["png"], out, runs_dir.name)) if wandb else None
    return result


def report_cmd(argv: list[str]) -> None:
    """``qharness report RUNS_DIR [--out DIR] [--metric ppl] [--max_latency_ms X] [--max_size_mb Y] [--no_wandb]``."""
    import argparse

    p = argparse.ArgumentParser(prog="qharness report", description="accuracy vs latency over the runs under RUNS_DIR: "
                                "table (report.md/.csv), Pareto plot (pareto.png), best run under a budget; logged to wandb")
    p.add_argument("runs_dir", help="directory searched (recursively) for summary.json files")
    p.add_argument("--out", default=None, help="where report.md/.csv/.json and pareto.png go (default: RUNS_DIR)")
    p.add_argument("--metric", default="ppl", help="accuracy axis: ppl (the .pte's validation perplexity), TASK/METRIC "
                   "(the .pte's lm-eval metric, e.g. hellaswag/acc), TASK/METRIC/STAGE, or a column of report.csv")
    p.add_argument("--max_latency_ms", type=float, default=None, help="latency budget: decode ms/token of the .pte")
    p.add_argument("--max_size_mb", type=float, default=None, help="size budget: .pte MB (1 MB = 1e6 bytes)")
    p.add_argument("--no_wandb", action="store_true", help="do not log the report to wandb")
    a = p.parse_args(argv)
    for name in ("max_latency_ms", "max_size_mb"):
        v = getattr(a, name)
        if v is not None and not v > 0:
            raise UserError(f"--{name} must be positive (got {v})")
    result = write_report(a.runs_dir, a.out, a.metric, a.max_latency_ms, a.max_size_mb, wandb=not a.no_wandb)
    print(result["text"])
    print(f"table: {result['paths']['markdown']} and {result['paths']['csv']}")
    print(f"Pareto plot: {result['paths']['png']}")
    if result["wandb_dir"]:
        print(f"wandb run: {result['wandb_dir']}")
