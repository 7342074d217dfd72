"""Rows as text: cells with their noise bands, the Markdown table and report, the CSV.

Text from summaries and directory names is made one line, a CSV cell that would start a spreadsheet formula gets a
leading ``'`` (``csv_cell``) and Markdown escapes table pipes and HTML tags (``md_cell``).
"""

from __future__ import annotations

import csv
import io
import re

from qharness.checks.stats import is_stderr, stderr_name
from qharness.errors import one_line
from qharness.reporting.rows import _number


def label(row: dict) -> str:
    """``recipe/mode (run)``: how the report names a run."""
    return f"{row['recipe']}/{row['mode']} ({row['run']})"


def describe(row: dict | None, column: str) -> str:
    """A run in one phrase: its label, metric, decode latency and ``.pte`` size, each with its noise band."""
    if row is None:
        return "none"
    metric = "ppl" if column == "ppl_pte" else column
    return f"{label(row)}: {metric} {cell(row, column, 'ppl' if column.startswith('ppl_') and '_vs_' not in column else '')}, {cell(row, 'decode_ms_per_token')} ms/token, {fmt(row.get('pte_size_mb'))} MB"


def public(row: dict | None) -> dict | None:
    """``row`` without the private ``_`` keys (block losses and timings the tie calls use)."""
    return None if row is None else {k: v for k, v in row.items() if not k.startswith("_")}


def fmt(v, kind: str = "") -> str:
    """One figure as the table shows it (``kind``: ``ppl``, ``pct``, ``frac`` or plain); ``-`` for None."""
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


def cell(row: dict, key: str, kind: str = "") -> str:
    """A figure with its noise: ``value [lo, hi]`` (``<key>_lo``/``_hi``: 95% interval or min-max range) or
    ``value ± se`` (lm-eval's standard error)."""
    text = fmt(row.get(key), kind)
    lo, hi = row.get(f"{key}_lo"), row.get(f"{key}_hi")
    if row.get(key) is None:
        return text
    if _number(lo) and _number(hi):
        v = row[key]
        bound = (
            (lambda b: fmt(b, kind))
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


def latency_class_lines(rows: list[dict]) -> list[str]:
    """Name each latency class of the rows (``L1``, ``L2``, ... in table order: ``latency_class_id``) and say in words
    which runs share it and its one figure."""
    classes: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("latency_class"):
            classes.setdefault(r["latency_class"], []).append(r)
    lines = []
    for k, (members, rs) in enumerate(classes.items(), 1):
        for r in rs:
            r["latency_class_id"] = f"L{k}"
        lines.append(
            f"Latency class L{k}: {members}: one program structure (the same operators, shapes and delegates; only "
            f"weight values differ), timed together with their samples pooled: one figure, "
            f"{cell(rs[0], 'decode_ms_per_token')} ms/token, so the ranking ties them on latency."
        )
    return lines


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
    if any(r.get("latency_class_id") for r in rows):
        cols.append(("latency_class_id", "latency class", ""))
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
        cells = [cell(r, k, f) for k, _, f in cols] + [
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


def markdown_report(title: str, table: str, lines: list[str]) -> str:
    """``report.md``: the title, the table (its cells escaped by ``markdown_table``) and the text lines, each made
    safe Markdown (``md_text``): names from summaries and directories can add no line, heading or HTML."""
    return f"# {md_text(title)}\n\n{table}\n" + "".join(md_text(line) + "\n" for line in lines)


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
