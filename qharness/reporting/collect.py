"""Every run's ``summary.json`` under a directory -> checked rows; a summary of wrong types is skipped with a note.

A summary.json is data, never markup: a summary with a field of the wrong type is skipped with a one-line note
naming it (``checked_row``); text from summaries and directory names is made one line.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from qharness.errors import UserError, one_line
from qharness.io.names import bad_name_reason
from qharness.reporting.rows import STAGES, noise_of, summary_row
from qharness.run.summary import RunSummary

log = logging.getLogger(__name__)


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
            if (size := path.stat().st_size) > MAX_SUMMARY_BYTES:
                raise UserError(
                    f"{size / 1e6:.0f} MB, more than a run summary holds (at most {MAX_SUMMARY_BYTES // 10**6} MB)"
                )
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


MAX_SUMMARY_BYTES = 16 * 10**6  # a run's summary.json is kilobytes; one past this is skipped unread
MAX_TEXT = 1000  # characters of a text field (run, model, recipe, ...): a longer one skips the run
# numbers that cannot be negative or NaN (sizes, times, rates, counts), by column: the summary field they come from
NON_NEGATIVE = {
    "pte_size_mb": "pte.size_bytes",
    **{
        f"{key}{end}": f"{key}.{stat}"  # the section is the row's latency_source (``_latency_field``)
        for key in ("decode_ms_per_token", "decode_tok_s", "prefill_tok_s")
        for end, stat in (("", "median"), ("_lo", "min"), ("_hi", "max"))
    },
    "peak_rss_mb": "bench.pte.peak_rss_mb",
    "bandwidth_fraction": "bench.pte.bandwidth_fraction",
    "decode_speedup_vs_eager": "bench.pte_vs_eager.decode_speedup",
    "bench_load_avg": "bench.load_avg_1m",
    "bench_cpus": "bench.cpus",
    "quantized_fraction": "coverage.fraction",
    "n_blocks": "metrics.pte.n_blocks",
    **{f"ppl_{k}{end}": f"metrics.{k}.ppl{end and '_ci'}" for k in STAGES for end in ("", "_lo", "_hi")},
}

TEXT_COLUMNS = ("run", "model", "recipe", "backend", "mode", "latency_source", "latency_class")


def checked_row(row: dict) -> dict:
    """``row`` (``summary_row | noise_of``) if every field has its type, text fields made one line; else a
    ``UserError`` naming the first wrong field (the run is then skipped, not the report)."""
    for key, value in row.items():
        if key in TEXT_COLUMNS:
            if value is not None and not isinstance(value, str):
                raise UserError(f"{key} is {type(value).__name__}, not text")
            if value is not None and len(value) > MAX_TEXT:
                raise UserError(f"{key} is {len(value)} characters long (at most {MAX_TEXT})")
            row[key] = None if value is None else one_line(value)
        elif key == "parity_passed":
            if value is not None and not isinstance(value, bool):
                raise UserError(f"parity.passed is {value!r}, not true/false")
        elif key in ("_val", "_sha256"):
            if value is not None and not isinstance(value, str):
                field = {"_val": "val_blocks", "_sha256": "pte.sha256"}[key]
                raise UserError(f"{field} is {type(value).__name__}, not text")
        elif key == "_latency_class":
            if value is not None and not all(isinstance(v, str) for v in value):
                raise UserError("bench_joint.latency_class holds something other than run names")
        elif key == "_blocks":
            if not all(all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in b) for b in value.values()):
                raise UserError("metrics.*.block_losses holds something other than numbers")
        elif (
            not key.startswith("_")
            and value is not None
            and (isinstance(value, bool) or not isinstance(value, (int, float)))
        ):
            raise UserError(f"{key} is {value!r}, not a number")
        elif key in NON_NEGATIVE and value is not None and (math.isnan(value) or value < 0):
            shown = value * 1e6 if key == "pte_size_mb" else value  # the summary's bytes
            field = NON_NEGATIVE[key]
            if key.startswith(("decode_", "prefill_")):
                joint = (row.get("latency_source") or "").startswith("joint")
                field = ("bench_joint." if joint else "bench.pte.") + field
            raise UserError(f"{field} is {shown:g}: a size, time or count is never negative or NaN")
        if key.startswith(("eval/", "chance/")) and (
            key.count("/") != (3 if key.startswith("eval/") else 2)
            or any(bad_name_reason(part) for part in key.split("/")[1:])
        ):
            raise UserError(f"lm-eval task or metric name {one_line(key)!r} is not a plain name")
    return row
