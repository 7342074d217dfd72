"""Accuracy vs latency over many runs: a table (Markdown + CSV), a Pareto plot (PNG) and the best recipe
under a latency or size budget, from the ``summary.json`` of every run under a directory.

The accuracy axis is the ``.pte``'s validation perplexity (``--metric ppl``, lower is better) or any
column of the table, e.g. an lm-eval task metric of the ``.pte`` (``--metric hellaswag/acc``, from the
summary's ``eval`` section). The latency axis is the ``.pte``'s decode latency (ms per token, median of the joint
benchmark ``bench_joint`` when the summary has one, else of the run's own ``qharness bench``).

Differences inside the noise are ties. Accuracy: the paired interval of two runs' per-block losses (same validation
blocks), else an unpaired one from their standard errors (lm-eval's for task metrics). Latency: per-process ranges
that overlap, or an exact rank test that finds no difference; without a joint benchmark, each run's own min-max
over repetitions (weak evidence). A run is dominated only by one better beyond the noise on one axis and not worse
beyond it on the other; the best run under a budget is picked by accuracy, then latency, beyond the noise, then by
the smaller ``.pte`` (then the name), and the words say when the data did not decide. Runs whose ``.pte`` failed
the parity gate are shown but never on the front or picked.

A summary.json is data, never markup: a summary with a field of the wrong type is skipped with a one-line note
naming it (``checked_row``); text from summaries and directory names is made one line, a CSV cell that would start a
spreadsheet formula gets a leading ``'`` (``csv_cell``) and Markdown escapes table pipes and HTML tags (``md_cell``).

Example::

    result = write_report("runs/sweep_xnnpack", max_latency_ms=2.0)
    print(result["markdown"]); print(result["best"]["recipe"])
"""

from __future__ import annotations

import csv
import io
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

from qharness.checks.stats import (
    ALPHA,
    Z,
    diff_interval,
    is_stderr,
    paired_ratio,
    ranges_overlap,
    rank_test_p,
    stderr_name,
)
from qharness.errors import UserError, one_line
from qharness.io import bad_name_reason, check_output_dir, remove_stale_temps, write_bytes_atomic, write_json_atomic
from qharness.reporting.rows import STAGES, _number, latency_figures, noise_of, row_columns, summary_row  # noqa: F401
from qharness.run.summary import RunSummary

log = logging.getLogger(__name__)

LOWER_IS_BETTER = re.compile(r"(ppl|perplexity|loss|bits_per_byte|bpb|error|latency|_ms|size|rss|diff)", re.IGNORECASE)


# --- many runs ----------------------------------------------------------------------------------
def collect(runs_dir: str | Path, skipped: list[str] | None = None) -> list[dict]:
    """The rows of every ``summary.json`` under ``runs_dir``; one that cannot be read or holds a field of the wrong
    type is skipped with a one-line note naming it (logged, and added to ``skipped``)."""
    skipped = [] if skipped is None else skipped
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise UserError(
            f"{runs_dir} is not a directory",
            fix="pass the directory that holds the runs (e.g. runs/ or runs/sweep_xnnpack)",
        )
    rows = []
    for path in sorted(runs_dir.rglob("summary.json")):
        if "wandb" in path.relative_to(runs_dir).parts:
            continue
        try:
            summary = RunSummary.read(path)
            run = str(path.parent.relative_to(runs_dir)) if path.parent != runs_dir else runs_dir.name
            rows.append(checked_row(summary_row(summary, run=run) | noise_of(summary)))
        except Exception as e:  # noqa: BLE001  a summary of wrong types (written by hand or another tool)
            why = e if isinstance(e, UserError) else f"not a qharness run summary ({type(e).__name__}: {e})"
            skipped.append(one_line(f"Skipped {path}: {why}"))
            log.warning("%s", skipped[-1])
    if not rows:
        raise UserError(
            f"no summary.json under {runs_dir}",
            fix="run qharness fit/calibrate/sweep first, or pass the directory that holds their runs",
        )
    return rows


TEXT_COLUMNS = ("run", "model", "recipe", "backend", "mode", "latency_source")


def checked_row(row: dict) -> dict:
    """``row`` (``summary_row | noise_of``) if every field has its type, text fields made one line; else a
    ``UserError`` naming the first wrong field (the run is then skipped, not the report)."""
    for key, value in row.items():
        if key in TEXT_COLUMNS:
            if value is not None and not isinstance(value, str):
                raise UserError(f"{key} is {type(value).__name__}, not text")
            row[key] = None if value is None else one_line(value)
        elif key == "parity_passed":
            if value is not None and not isinstance(value, bool):
                raise UserError(f"parity.passed is {value!r}, not true/false")
        elif key in ("_val", "_sha256"):
            if value is not None and not isinstance(value, str):
                field = {"_val": "val_blocks", "_sha256": "pte.sha256"}[key]
                raise UserError(f"{field} is {type(value).__name__}, not text")
        elif key == "_blocks":
            if not all(all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in b) for b in value.values()):
                raise UserError("metrics.*.block_losses holds something other than numbers")
        elif (
            not key.startswith("_")
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, (int, float)))
        ):
            raise UserError(f"{key} is {value!r}, not a number")
        if key.startswith(("eval/", "chance/")) and (
            key.count("/") != (3 if key.startswith("eval/") else 2)
            or any(bad_name_reason(part) for part in key.split("/")[1:])
        ):
            raise UserError(f"lm-eval task or metric name {one_line(key)!r} is not a plain name")
    return row


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
            known = sorted(
                {
                    "/".join(c.split("/")[1:3])
                    for c in columns
                    if c.startswith("eval/") and not is_stderr(c.split("/")[2])
                }
            )
            raise UserError(
                f"metric {metric!r} is in none of the summaries",
                fix="use ppl, a column of the table"
                + (f", or a task metric: {', '.join(known)}" if known else " (no run has lm-eval results)"),
            )
    return column, bool(LOWER_IS_BETTER.search(column.split("/")[-2] if column.startswith("eval/") else column))


def check_metric(metric, tasks: list[str], where: str = "report.metric") -> None:
    """A ``--metric`` that no run will have, found before the runs (a sweep's ``report.metric``): ``ppl``, a column
    every run's row has, or ``TASK/METRIC[/STAGE]`` of a task in ``tasks`` (the lm-eval tasks the runs evaluate;
    the metric itself is checked for qharness's offline tasks, whose metrics are known beforehand)."""
    from qharness.evaluation.tasks import offline_metrics

    fixed = row_columns()
    if isinstance(metric, str) and (metric == "ppl" or (metric in fixed and not metric.startswith("_"))):
        return
    parts = metric.removeprefix("eval/").split("/") if isinstance(metric, str) else []
    task, name, stage = (parts + ["pte"])[:3] if len(parts) in (2, 3) else (None, None, None)
    known = offline_metrics().get(task)
    why = (
        "not a metric name"
        if task is None or not name or stage not in STAGES
        else f"no run evaluates task {task!r} (eval.tasks: {', '.join(tasks) or 'none, eval disabled'})"
        if task not in tasks
        else f"task {task} has no metric {name!r} (it has {', '.join(sorted(known))})"
        if known is not None and name not in known and not (is_stderr(name) and name in {stderr_name(k) for k in known})
        else None
    )
    if why is not None:
        example = (
            f" or TASK/METRIC such as {tasks[0]}/{sorted(offline_metrics().get(tasks[0], ['acc']))[0]}" if tasks else ""
        )
        raise UserError(f"{where} {metric!r}: {why}", fix=f"use ppl, a column of the report table{example}")


AXES = {"latency": "decode_ms_per_token", "size": "pte_size_mb"}  # the x axis of a front: decode latency or .pte size


def eligible(row: dict, column: str, axis: str = "latency") -> bool:
    """Shippable and measured: parity passed, the axis (decode latency, or ``.pte`` size) and the metric known."""
    return row.get("parity_passed") is True and _number(row.get(AXES[axis])) and _number(row.get(column))


def pareto_front(points: list[tuple[float, float]], lower_is_better: bool) -> list[int]:
    """Indices of the points (latency, metric) no other point dominates (lower latency is better; the metric's
    direction is ``lower_is_better``), sorted by latency: the front without noise (``noisy_front`` has ties).

    >>> pareto_front([(1, 10), (2, 8), (3, 9), (4, 5)], lower_is_better=True)
    [0, 1, 3]
    """
    sign = 1 if lower_is_better else -1
    pts = [(x, sign * y) for x, y in points]  # now lower is better on both axes
    front = [
        i
        for i, (x, y) in enumerate(pts)
        if not any(xo <= x and yo <= y and (xo < x or yo < y) for j, (xo, yo) in enumerate(pts) if j != i)
    ]
    return sorted(front, key=lambda i: (points[i][0], sign * points[i][1]))


# --- noise: ties on accuracy and latency ----------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """Run ``a`` against run ``b`` on one axis: ``sign`` +1 when ``a`` is better beyond the noise, -1 when ``b`` is,
    0 for a tie; ``text`` the difference with its interval, e.g. ``ppl -0.3% [-0.9%, +0.4%], paired over 32 blocks``."""

    sign: int
    text: str


def label(row: dict) -> str:
    return f"{row['recipe']}/{row['mode']} ({row['run']})"


def _same_program(a: dict, b: dict) -> bool:
    return a.get("_sha256") is not None and a.get("_sha256") == b.get("_sha256")


def _sign(lo: float, hi: float, lower_is_better: bool) -> int:
    """The sign of a Comparison from the interval of ``a - b`` (0 when it holds 0)."""
    if lo <= 0 <= hi:
        return 0
    return 1 if (hi < 0) == lower_is_better else -1


def compare_accuracy(a: dict, b: dict, column: str, lower_is_better: bool) -> Comparison:
    """Perplexity columns (``ppl_<stage>``): the paired interval of the per-block loss differences when both runs
    were scored on the same validation blocks, else an unpaired one from the two standard errors. lm-eval columns:
    an unpaired interval from lm-eval's standard errors (conservative: both ran on the same documents). Without
    any noise estimate (older summaries) only equal values tie."""
    va, vb = a[column], b[column]
    if _same_program(a, b):
        return Comparison(0, "same .pte (sha256)")
    stage = column[len("ppl_") :] if column.startswith("ppl_") and column[len("ppl_") :] in STAGES else None
    if stage is not None:
        ba, bb = a.get("_blocks", {}).get(stage), b.get("_blocks", {}).get(stage)
        if ba and bb and len(ba) == len(bb) and len(ba) > 1 and a.get("_val") == b.get("_val"):
            r = paired_ratio(ba, bb)
            lo, hi = r["ci"]
            return Comparison(
                _sign(math.log(lo), math.log(hi), True),
                f"ppl {r['ppl_ratio'] - 1:+.2%} [{lo - 1:+.2%}, {hi - 1:+.2%}], paired over {len(ba)} blocks",
            )
        sa, sb = a.get("_loss_se", {}).get(stage), b.get("_loss_se", {}).get(stage)
        if sa is not None and sb is not None:
            d = math.log(va / vb)
            lo, hi = diff_interval(d, sa, sb)
            return Comparison(
                _sign(lo, hi, True),
                f"ppl {math.exp(d) - 1:+.2%} [{math.exp(lo) - 1:+.2%}, {math.exp(hi) - 1:+.2%}], "
                "unpaired (different validation blocks)",
            )
    elif column.startswith("eval/"):
        _, task, metric, st = column.split("/", 3)
        se_col = f"eval/{task}/{stderr_name(metric)}/{st}"
        sa, sb = a.get(se_col), b.get(se_col)
        if _number(sa) and _number(sb):
            lo, hi = diff_interval(va - vb, sa, sb)
            return Comparison(
                _sign(lo, hi, lower_is_better),
                f"{metric} {va - vb:+.4g} [{lo:+.4g}, {hi:+.4g}] (lm-eval standard errors)",
            )
    sign = 0 if va == vb else 1 if (va < vb) == lower_is_better else -1
    name = "ppl" if column == "ppl_pte" else column
    return Comparison(sign, f"{name} {va:.5g} vs {vb:.5g} (no noise estimate)")


def compare_latency(a: dict, b: dict) -> Comparison:
    """Decode ms/token. Joint benchmarks (per-process timings of both): a tie when the ranges overlap or the exact
    rank test finds no difference (p >= 0.05). Otherwise each run's own [min, max] over repetitions in one process
    (weak evidence): a tie when they overlap. Without ranges only equal medians tie."""
    ma, mb = a["decode_ms_per_token"], b["decode_ms_per_token"]
    head = f"latency {ma:.3g} vs {mb:.3g} ms/token"
    faster = 1 if ma < mb else -1
    if _same_program(a, b):
        return Comparison(0, f"{head}: the same .pte (sha256), so the difference is measurement noise")
    sa, sb = a.get("_decode_ms_samples"), b.get("_decode_ms_samples")
    if sa and sb:
        where = f"joint benchmark, {len(sa)} and {len(sb)} processes"
        if ranges_overlap((min(sa), max(sa)), (min(sb), max(sb))):
            return Comparison(0, f"{head}: ranges overlap ({where})")
        p = rank_test_p(sa, sb)
        if p >= ALPHA:
            return Comparison(0, f"{head}: ranges apart but rank test p={p:.2g} >= {ALPHA} ({where})")
        return Comparison(faster, f"{head}: ranges apart, rank test p={p:.2g} ({where})")
    ra = (a.get("decode_ms_per_token_lo"), a.get("decode_ms_per_token_hi"))
    rb = (b.get("decode_ms_per_token_lo"), b.get("decode_ms_per_token_hi"))
    if all(_number(v) for v in (*ra, *rb)):
        where = "own benchmarks, repetitions in one process: weak evidence"
        if ranges_overlap(ra, rb):
            return Comparison(0, f"{head}: ranges overlap ({where})")
        return Comparison(faster, f"{head}: ranges apart ({where})")
    return Comparison(0 if ma == mb else faster, f"{head} (no noise estimate)")


def compare_size(a: dict, b: dict) -> Comparison:
    """``.pte`` size: exact (a file size has no noise); +1 when ``a`` is smaller."""
    sa, sb = a["pte_size_mb"], b["pte_size_mb"]
    return Comparison(0 if sa == sb else 1 if sa < sb else -1, f".pte {sa:.3f} vs {sb:.3f} MB")


def dominates(acc: Comparison, lat: Comparison) -> bool:
    """``a`` dominates ``b`` (``acc``, ``lat``: a against b): better beyond the noise on one axis, not worse beyond it on the other."""
    return (acc.sign > 0 and lat.sign >= 0) or (lat.sign > 0 and acc.sign >= 0)


def noisy_front(
    rows: list[dict], column: str, lower_is_better: bool, axis: str = "latency"
) -> tuple[list[dict], dict[str, list[str]]]:
    """The Pareto front of the eligible rows with ties inside the noise (``compare_accuracy``, ``compare_latency``;
    ``axis="size"``: ``.pte`` size in place of latency, ``compare_size``), sorted by that axis, and each eligible
    run's ties (runs it ties with on both axes).

    Runs that tie on both axes with the same ``.pte`` size (or the same ``.pte``) are one program: they are on the
    front together or not at all (on it when any of them is undominated)."""
    ok = [r for r in rows if eligible(r, column, axis)]
    n = len(ok)
    acc = {
        (i, j): compare_accuracy(ok[i], ok[j], column, lower_is_better) for i in range(n) for j in range(n) if i != j
    }
    other = compare_size if axis == "size" else compare_latency
    lat = {(i, j): other(ok[i], ok[j]) for i in range(n) for j in range(n) if i != j}
    undominated = [not any(dominates(acc[j, i], lat[j, i]) for j in range(n) if j != i) for i in range(n)]
    tie = {(i, j) for (i, j) in acc if acc[i, j].sign == 0 and lat[i, j].sign == 0}
    group = list(range(n))  # union-find of identical programs

    def root(i):
        while group[i] != i:
            i = group[i]
        return i

    for i, j in sorted(tie):
        if _same_program(ok[i], ok[j]) or ok[i].get("pte_size_mb") == ok[j].get("pte_size_mb"):
            group[max(root(i), root(j))] = min(root(i), root(j))
    on = [any(undominated[k] for k in range(n) if root(k) == root(i)) for i in range(n)]
    sign = 1 if lower_is_better else -1
    front = sorted((ok[i] for i in range(n) if on[i]), key=lambda r: (r[AXES[axis]], sign * r[column], r["run"]))
    ties = {ok[i]["run"]: sorted(ok[j]["run"] for j in range(n) if (i, j) in tie) for i in range(n)}
    return front, ties


def best_choice(
    rows: list[dict],
    column: str,
    lower_is_better: bool,
    max_latency_ms: float | None = None,
    max_size_mb: float | None = None,
) -> dict:
    """The eligible run to pick within the budgets, deterministically: keep the runs no other beats on the metric
    beyond the noise, then those no other of them beats on latency beyond the noise; among the rest (a tie) the
    smallest ``.pte``, then the run name. Returns ``{"best": row or None, "tied": [rows], "text": words}``."""
    fits = [
        r
        for r in rows
        if eligible(r, column)
        and (max_latency_ms is None or r["decode_ms_per_token"] <= max_latency_ms)
        and (max_size_mb is None or (r.get("pte_size_mb") is not None and r["pte_size_mb"] <= max_size_mb))
    ]
    if not fits:
        return {"best": None, "tied": [], "text": "none"}
    top = [
        r for r in fits if not any(compare_accuracy(o, r, column, lower_is_better).sign > 0 for o in fits if o is not r)
    ]
    fast = [r for r in top if not any(compare_latency(o, r).sign > 0 for o in top if o is not r)]
    best = min(fast, key=lambda r: (r["pte_size_mb"] if _number(r.get("pte_size_mb")) else math.inf, r["run"]))
    others = [r for r in fast if r is not best]

    def both(o):  # accuracy and latency of best against o, in words
        lat = compare_latency(best, o).text
        return lat if _same_program(best, o) else f"{compare_accuracy(best, o, column, lower_is_better).text}, {lat}"

    if others:
        names = ", ".join(label(r) for r in [best, *others][:-1]) + f" and {label(([best, *others])[-1])}"
        why = "; ".join(f"vs {label(o)}: {both(o)}" for o in others)
        by = "size" if len({r.get("pte_size_mb") for r in fast}) == len(fast) else "size, then name"
        text = f"tie between {names} ({why}); pick by {by}: {describe(best, column)}"
    elif len(top) > 1:
        why = "; ".join(f"{label(o)}: {both(o)}" for o in top if o is not best)
        text = f"{describe(best, column)}; ties on accuracy but is faster beyond the noise ({why})"
    else:
        sign = 1 if lower_is_better else -1
        rest = sorted((r for r in fits if r is not best), key=lambda r: (sign * r[column], r["run"]))
        text = describe(best, column) + (
            f"; vs the runner-up {label(rest[0])}: {compare_accuracy(best, rest[0], column, lower_is_better).text}"
            if rest
            else ""
        )
    return {"best": best, "tied": others, "text": text}


def best_under(
    rows: list[dict],
    column: str,
    lower_is_better: bool,
    max_latency_ms: float | None = None,
    max_size_mb: float | None = None,
) -> dict | None:
    """The eligible row picked within the budgets (``best_choice``); None if none fits."""
    return best_choice(rows, column, lower_is_better, max_latency_ms, max_size_mb)["best"]


# --- output -------------------------------------------------------------------------------------
def _fmt(v, kind: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "passed" if v else "FAILED"
    if kind == "ppl":  # perplexities differ in their decimals, whatever their size
        return f"{v:.3f}"
    if kind == "pct":
        return f"{v:+.2%}"  # ppl differences are often well under 1%
    if kind == "frac":
        return f"{v:.1%}"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _cell(row: dict, key: str, kind: str = "") -> str:
    """A figure with its noise: ``value [lo, hi]`` (``<key>_lo``/``_hi``: 95% interval or min-max range) or
    ``value ± se`` (lm-eval's standard error)."""
    text = _fmt(row.get(key), kind)
    lo, hi = row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if row.get(key) is None:
        return text
    if _number(lo) and _number(hi):
        v = row[key]
        bound = (
            (lambda b: _fmt(b, kind))
            if kind or not isinstance(v, float)
            else (lambda b: f"{b:.3f}" if abs(v) < 100 else f"{b:.0f}")
        )
        return f"{text} [{bound(float(lo))}, {bound(float(hi))}]"
    if key.startswith("eval/") and key.count("/") == 3:
        _, task, metric, stage = key.split("/")
        se = row.get(f"eval/{task}/{stderr_name(metric)}/{stage}")
        if _number(se):
            return f"{text} ± {se:.3f}"
    return text


INTERVALS_NOTE = (
    "Intervals: perplexity [95% interval over validation blocks]; vs FP [95%, paired per block with the run's FP model]. "
    "Runs scored on the same blocks are compared through their paired per-block differences, usually far narrower than each "
    "run's own interval (which holds the block-to-block variation all runs share). Latency: "
    "decode/prefill [min, max] over benchmark processes (joint benchmark) or over repetitions in one process "
    "(own benchmark: weak evidence); lm-eval metrics ± their standard error."
)


def table_columns(rows: list[dict], column: str) -> list[tuple[str, str, str]]:
    """(key, header, format) of the Markdown table: the metric first, then latency, size and parity."""
    cols = [
        ("run", "run", ""),
        ("recipe", "recipe", ""),
        ("mode", "mode", ""),
        ("quantized_fraction", "quantized", "frac"),
    ]
    if column != "ppl_pte":
        cols.append((column, eval_header(rows, column), ""))
    cols += [
        ("ppl_pte", ".pte ppl", "ppl"),
        ("ppl_pte_vs_fp", "vs FP", "pct"),
        ("ppl_fake_quant", "fake-quant ppl", "ppl"),
        ("decode_ms_per_token", "decode ms/tok", ""),
        ("decode_tok_s", "decode tok/s", ""),
        ("prefill_tok_s", "prefill tok/s", ""),
        ("pte_size_mb", ".pte MB", ""),
        ("bandwidth_fraction", "of bw bound", "frac"),
        ("parity_passed", "parity", ""),
    ]
    extra = sorted(
        {
            c
            for r in rows
            for c in r
            if c.startswith("eval/") and c.endswith("/pte") and c != column and not is_stderr(c.split("/")[2])
        }
    )
    cols += [(c, eval_header(rows, c), "") for c in extra]
    return cols


def eval_header(rows: list[dict], column: str) -> str:
    """``eval/qharness_mc/acc/pte`` -> ``qharness_mc/acc (chance 0.25)``: an lm-eval column says what guessing scores."""
    header = column.removeprefix("eval/").removesuffix("/pte")
    if not column.startswith("eval/") or column.count("/") != 3:
        return header
    _, task, metric, _stage = column.split("/")
    chance = next((r[f"chance/{task}/{metric}"] for r in rows if _number(r.get(f"chance/{task}/{metric}"))), None)
    return header if chance is None else f"{header} (chance {chance:.3g})"


def markdown_table(rows: list[dict], column: str, front_runs: set[str], size_runs: set[str] = frozenset()) -> str:
    """The runs' table; ``Pareto``: on the latency front, ``Pareto (size)``: on the ``.pte`` size front."""
    cols = table_columns(rows, column)
    header = [h for _, h, _ in cols] + ["Pareto", "Pareto (size)", "ties"]
    lines = ["| " + " | ".join(md_cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        cells = [_cell(r, k, f) for k, _, f in cols] + [
            "*" if r["run"] in front_runs else "",
            "*" if r["run"] in size_runs else "",
            r.get("ties") or "",
        ]
        lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
    return "\n".join(lines)


_MD_TAG = re.compile(r"<(?=[A-Za-z/!?])")  # a "<" that could open an HTML tag or comment ("<=" cannot)


def md_text(text: str) -> str:
    """``text`` safe in a Markdown paragraph: one line (control characters escaped) and no HTML (a ``<`` that could
    open a tag becomes ``&lt;``: a ``<script>`` from a summary.json shows as text; ``<=`` stays)."""
    return _MD_TAG.sub("&lt;", one_line(text))


def md_cell(text: str) -> str:
    """``text`` safe in a Markdown table cell: ``md_text`` and ``|`` escaped (no extra columns or rows)."""
    return md_text(text).replace("|", "\\|")


FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\n")  # what makes a spreadsheet read a cell as a formula (OWASP)


def csv_cell(value):
    """A CSV cell a spreadsheet will not run: text starting with ``= + - @`` (or a tab/return) gets a leading ``'``
    (OWASP's CSV-injection advice); numbers, booleans and None stay as they are."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def csv_text(rows: list[dict], columns: list[str]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[csv_cell(c) for c in columns], extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows({csv_cell(k): csv_cell(v) for k, v in r.items()} for r in rows)
    return buf.getvalue()


def interval(row: dict, key: str) -> tuple[float, float]:
    """``row[key]``'s noise band: ``<key>_lo``/``_hi``, else the 95% normal band of an lm-eval standard error, else the value."""
    v, lo, hi = row[key], row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if _number(lo) and _number(hi):
        return min(lo, v), max(hi, v)
    if key.startswith("eval/") and key.count("/") == 3:
        _, task, metric, stage = key.split("/")
        se = row.get(f"eval/{task}/{stderr_name(metric)}/{stage}")
        if _number(se):
            return v - Z * se, v + Z * se
    return v, v


def paired_band(row: dict) -> tuple[float, float] | None:
    """The ``.pte`` perplexity's 95% band from its paired interval against FP (``ppl_fp`` x the ratio's interval):
    the noise that matters between runs scored on the same blocks (their own ``ppl_ci`` also holds the block-to-block
    variation every run shares)."""
    fp, lo, hi = row.get("ppl_fp"), row.get("ppl_pte_vs_fp_lo"), row.get("ppl_pte_vs_fp_hi")
    return (fp * (1 + lo), fp * (1 + hi)) if all(_number(v) for v in (fp, lo, hi)) else None


MODE_COLORS = {"fp": "black", "ptq": "tab:blue", "qat": "tab:orange"}


def plot_pareto(
    rows: list[dict],
    column: str,
    lower_is_better: bool,
    front_runs: set[str],
    title: str,
    max_latency_ms: float | None = None,
    axis: str = "latency",
    max_size_mb: float | None = None,
) -> bytes:
    """The PNG: metric vs decode latency (``axis="size"``: vs ``.pte`` MB), point area ~ ``.pte`` size, the Pareto
    front drawn and labelled."""
    x = AXES[axis]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in rows if _number(r.get(x)) and _number(r.get(column))]
    sizes = [r.get("pte_size_mb") or 0.0 for r in pts]
    biggest = max(sizes, default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for mode, color in MODE_COLORS.items():
        sel = [r for r in pts if r["mode"] == mode and r.get("parity_passed") is True]
        if sel:
            ax.scatter(
                [r[x] for r in sel],
                [r[column] for r in sel],
                s=[60 + 540 * (r.get("pte_size_mb") or 0) / biggest for r in sel],
                c=color,
                alpha=0.55,
                edgecolors=color,
                linewidths=1,
            )
            ax.scatter([], [], s=60, c=color, alpha=0.55, label=mode)  # legend entry of a fixed size
    for r in pts:
        (xlo, xhi), (ylo, yhi) = (
            interval(r, x),
            (paired_band(r) if column == "ppl_pte" else None) or interval(r, column),
        )
        color = MODE_COLORS.get(r["mode"], "gray") if r.get("parity_passed") is True else "gray"
        ax.errorbar(
            [r[x]],
            [r[column]],
            # clipped at 0: a band computed apart from its value (ppl vs the paired per-block ratio) can miss it by
            # float rounding when it is ~1e-7 wide (the FP .pte against the FP model), which matplotlib refuses
            xerr=[[max(0.0, r[x] - xlo)], [max(0.0, xhi - r[x])]],
            yerr=[[max(0.0, r[column] - ylo)], [max(0.0, yhi - r[column])]],
            fmt="none",
            ecolor=color,
            elinewidth=1,
            capsize=3,
            alpha=0.8,
            zorder=2,
        )
    failed = [r for r in pts if r.get("parity_passed") is not True]
    if failed:
        ax.scatter(
            [r[x] for r in failed],
            [r[column] for r in failed],
            s=80,
            marker="x",
            c="gray",
            label="parity failed/skipped",
        )
    front = sorted((r for r in pts if r["run"] in front_runs), key=lambda r: r[x])
    if front:
        ax.plot(
            [r[x] for r in front],
            [r[column] for r in front],
            "-",
            drawstyle="steps-post",
            color="crimson",
            lw=1.5,
            zorder=0,
            label="Pareto front",
        )
        ax.scatter([r[x] for r in front], [r[column] for r in front], s=18, c="crimson", zorder=3)
    fp_ppl = {round(r["ppl_fp"], 9) for r in rows if _number(r.get("ppl_fp"))}
    if column == "ppl_pte" and len(fp_ppl) == 1:  # every run starts from the same FP model
        ax.axhline(fp_ppl.pop(), ls=":", color="black", lw=1, label="FP model before quantization (PyTorch)")
    for r in pts:
        on = r["run"] in front_runs
        radius = math.sqrt(60 + 540 * (r.get("pte_size_mb") or 0) / biggest) / 2  # points: label beside the marker
        ax.annotate(
            f"{r['recipe']}/{r['mode']}",
            (r[x], r[column]),
            xytext=(radius + 2, radius / 2 + 2),
            textcoords="offset points",
            fontsize=8,
            fontweight="bold" if on else "normal",
            color="crimson" if on else "dimgray",
        )
    if max_latency_ms is not None and axis == "latency":
        ax.axvline(max_latency_ms, ls="--", color="gray", lw=1, label=f"latency budget {max_latency_ms:g} ms")
    if max_size_mb is not None and axis == "size":
        ax.axvline(max_size_mb, ls="--", color="gray", lw=1, label=f"size budget {max_size_mb:g} MB")
    ax.set_xlabel(
        ".pte size (MB; lower is better)"
        if axis == "size"
        else "decode latency of the .pte (ms/token, median; bars: min-max; lower is better)"
    )
    label = ".pte validation perplexity" if column == "ppl_pte" else column
    bars = "95%, paired per block with FP" if column == "ppl_pte" else "95%"
    ax.set_ylabel(f"{label} ({'lower' if lower_is_better else 'higher'} is better; bars: {bars})")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.margins(x=0.2, y=0.12)  # room for the labels
    ax.legend(loc="best", fontsize=8, title=f"point area ~ .pte size (largest {biggest:.2f} MB)", title_fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def markdown_report(title: str, table: str, lines: list[str]) -> str:
    """``report.md``: the title, the table (its cells escaped by ``markdown_table``) and the text lines, each made
    safe Markdown (``md_text``): names from summaries and directories can add no line, heading or HTML."""
    return f"# {md_text(title)}\n\n{table}\n" + "".join(md_text(line) + "\n" for line in lines)


def describe(row: dict | None, column: str) -> str:
    if row is None:
        return "none"
    metric = "ppl" if column == "ppl_pte" else column
    return f"{label(row)}: {metric} {_cell(row, column, 'ppl' if column.startswith('ppl_') and '_vs_' not in column else '')}, {_cell(row, 'decode_ms_per_token')} ms/token, {_fmt(row.get('pte_size_mb'))} MB"


def public(row: dict | None) -> dict | None:
    """``row`` without the private ``_`` keys (block losses and timings the tie calls use)."""
    return None if row is None else {k: v for k, v in row.items() if not k.startswith("_")}


def noise_notes(rows: list[dict], column: str) -> list[str]:
    """Where the noise bands are weak or missing, in words."""
    ok = [r for r in rows if eligible(r, column)]
    notes = []
    stage = column[len("ppl_") :] if column.startswith("ppl_") else None
    if stage in STAGES:
        bare = [r["run"] for r in ok if not r.get("_blocks", {}).get(stage)]
        if bare:
            notes.append(
                f"Accuracy noise: {len(bare)} of {len(ok)} runs carry no per-block losses (older summaries: {', '.join(bare)}): their perplexities "
                "are compared without a noise band."
            )
        if len({r.get("_val") for r in ok if r.get("_blocks", {}).get(stage)}) > 1:
            notes.append(
                "Accuracy noise: the runs were scored on different validation blocks (data, seq_len or eval_blocks differ): perplexities are "
                "compared unpaired (wider intervals). Give every run the same data section and parity.eval_blocks to pair them."
            )
    own = [r["run"] for r in ok if not r.get("_decode_ms_samples")]
    if own:
        notes.append(
            f"Latency noise: {len(own)} of {len(ok)} runs have no joint benchmark (bench_joint); their latency ranges are min-max over "
            "repetitions inside one process (weak evidence: they miss process-to-process and machine-state variation)."
        )
    return notes


def log_to_wandb(
    rows: list[dict], columns: list[str], column: str, png: Path, out_dir: Path, name: str, project: str = "qharness"
) -> Path | None:
    """The table, a scatter chart (metric vs decode ms/token) and the PNG in one wandb run under ``out_dir/wandb``."""
    from qharness.reporting.tracking import use_wandb_mode

    if use_wandb_mode() == "disabled":
        return None
    import wandb

    run = wandb.init(
        project=project,
        dir=str(out_dir),
        name=f"report-{name}",
        job_type="report",
        group=name,
        config={"metric": column, "runs": len(rows)},
    )
    table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
    run.log(
        {
            "report/table": table,
            "report/scatter": wandb.plot.scatter(
                table, "decode_ms_per_token", column, title=f"{column} vs decode ms/token"
            ),
            "report/pareto": wandb.Image(str(png)),
        }
    )
    run_dir = Path(run.dir).parent
    run.finish()
    return run_dir


def qat_recovery(rows: list[dict]) -> list[str]:
    """What QAT recovers of PTQ's loss, in words, for every pair of runs named ``<name>-ptq`` / ``<name>-qat``
    (a sweep's run directories; the QAT run may use a variant of the recipe, e.g. its learned-scale twin).

    Per pair, on the ``.pte`` perplexity: PTQ against FP and QAT against PTQ, each with its paired 95% interval, and
    the recovered fraction ``(ppl_ptq - ppl_qat) / (ppl_ptq - ppl_ref)``: ``ref`` is the FP model and, when the sweep
    has one, an FP recipe fine-tuned like the QAT runs (an FP run named ``*-qat``: the control that separates what
    quantization-aware training recovers from what fine-tuning alone gains). A fraction is given only where PTQ loses
    beyond the noise; a QAT-vs-PTQ interval that holds 0 is a tie, whatever the fraction.

    Example line: ``xnnpack_8da3w: PTQ loses ppl +7.19% [+5.69%, +8.72%] against FP; QAT (xnnpack_8da3w_lsq) against
    PTQ: ppl -4.27% [...], better beyond the noise; recovered 64% of PTQ's loss (68% against the fine-tuned FP control
    xnnpack_fp32-qat)``.
    """
    by_run = {r["run"]: r for r in rows if r.get("ppl_pte") is not None and r.get("parity_passed") is not False}
    controls = [r for r in by_run.values() if r["mode"] == "fp" and r["run"].endswith("-qat")]
    control = controls[0] if len(controls) == 1 else None
    lines = []
    for run, ptq in sorted(by_run.items()):
        qat = by_run.get(run[: -len("-ptq")] + "-qat") if run.endswith("-ptq") else None
        if qat is None or ptq["mode"] != "ptq" or qat["mode"] != "qat":
            continue
        name = run[: -len("-ptq")]
        variant = f" ({qat['recipe']})" if qat["recipe"] != ptq["recipe"] else ""
        fp, p, q = ptq.get("ppl_fp"), ptq["ppl_pte"], qat["ppl_pte"]
        loss = _cell(ptq, "ppl_pte_vs_fp", "pct")
        vs = compare_accuracy(qat, ptq, "ppl_pte", True)
        verdict = {1: "better beyond the noise", 0: "a tie (inside the noise)", -1: "worse beyond the noise"}[vs.sign]
        text = f"{name}: PTQ loses {loss} against FP; QAT{variant} against PTQ: {vs.text}, {verdict}"
        lo = ptq.get("ppl_pte_vs_fp_lo")
        if not (_number(fp) and p > fp) or (_number(lo) and lo <= 0):
            text += "; PTQ loses nothing beyond the noise, so there is nothing for QAT to recover"
        else:
            text += f"; recovered {(p - q) / (p - fp):.0%} of PTQ's loss"
            c = control["ppl_pte"] if control else None
            if c is not None and p > c:
                text += f" ({(p - q) / (p - c):.0%} against the fine-tuned FP control {control['run']}, ppl {c:.3f})"
        lines.append("- " + text)
    if not lines:
        return []
    head = "What QAT recovers (runs <name>-ptq and <name>-qat; .pte perplexity; recovered = (PTQ - QAT) / (PTQ - FP)):"
    return ["", head, *lines]


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
    front, ties = noisy_front(rows, column, lower)
    front_runs = {r["run"] for r in front}
    size_front, _ = noisy_front(rows, column, lower, axis="size")  # accuracy vs .pte size (no latency needed)
    size_runs = {r["run"] for r in size_front}
    choice = best_choice(rows, column, lower, max_latency_ms, max_size_mb)
    best = choice["best"]
    for r in rows:
        r["pareto"] = r["run"] in front_runs
        r["pareto_size"] = r["run"] in size_runs
        r["ties"] = "tie with " + ", ".join(ties[r["run"]]) if ties.get(r["run"]) else None
    columns = list(dict.fromkeys(c for r in rows for c in r if not c.startswith("_")))
    budget = (
        " and ".join(
            b
            for b in (
                f"decode <= {max_latency_ms:g} ms/token" if max_latency_ms is not None else "",
                f".pte <= {max_size_mb:g} MB" if max_size_mb is not None else "",
            )
            if b
        )
        or "no budget"
    )
    title = f"{runs_dir.name}: {'.pte perplexity' if column == 'ppl_pte' else column} vs decode latency"
    md = markdown_table(rows, column, front_runs, size_runs)

    def on_front(r):
        tied = [t for t in ties[r["run"]] if t in front_runs]
        return f"{r['recipe']}/{r['mode']} ({r['run']}" + (f", tie with {', '.join(tied)})" if tied else ")")

    lines = [
        md,
        "",
        INTERVALS_NOTE,
        "",
        f"Pareto front ({'lower' if lower else 'higher'} {column} is better, lower latency is better; differences inside the noise are ties): "
        + ("; ".join(on_front(r) for r in front) or "no run with a passed parity gate and a benchmark"),
        f"Pareto front by .pte size ({'lower' if lower else 'higher'} {column} is better, smaller is better; pareto_size.png): "
        + (
            "; ".join(f"{r['recipe']}/{r['mode']} ({r['run']}, {r['pte_size_mb']:.3f} MB)" for r in size_front)
            or "no run with a passed parity gate and a .pte size"
        ),
        f"Best under {budget}: {choice['text']}",
    ]
    lines += qat_recovery(rows)
    lines += noise_notes(rows, column)
    loaded = [
        r
        for r in rows
        if _number(r.get("bench_load_avg")) and r.get("bench_cpus") and r["bench_load_avg"] > r["bench_cpus"]
    ]
    if loaded:
        worst = max(loaded, key=lambda r: r["bench_load_avg"] / r["bench_cpus"])
        lines.append(
            f"Note: {len(loaded)} of {len(rows)} benchmarks ran while other processes kept the CPUs busy (load average up to "
            f"{worst['bench_load_avg']:.1f} on {worst['bench_cpus']} CPUs): their latencies are noisy. Re-measure on a quiet "
            "machine with `qharness bench --pte RUN/model.pte` (it updates summary.json), then rerun `qharness report`."
        )
    lines += notes or []
    lines += skipped
    text = "\n".join(lines)
    png = plot_pareto(rows, column, lower, front_runs, title, max_latency_ms)
    size_title = f"{runs_dir.name}: {'.pte perplexity' if column == 'ppl_pte' else column} vs .pte size"
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
        "best": best,
        "best_tied_with": [r["run"] for r in choice["tied"]],
        "budget": {"max_latency_ms": max_latency_ms, "max_size_mb": max_size_mb},
        "text": text,
    }
    saved = {k: v for k, v in result.items() if k != "text"} | {"rows": [public(r) for r in rows], "best": public(best)}
    paths["json"] = write_json_atomic(out / "report.json", saved)
    result["paths"] = {k: str(v) for k, v in paths.items()}
    result["wandb_dir"] = str(log_to_wandb(rows, columns, column, paths["png"], out, runs_dir.name)) if wandb else None
    return result
