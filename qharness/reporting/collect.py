"""Every run's ``summary.json`` under a directory -> checked rows; a summary of wrong types is skipped with a note.

A summary.json is data, never markup: a summary with a field of the wrong type is skipped with a one-line note
naming it (``checked_row``); text from summaries and directory names is made one line.
"""

from __future__ import annotations

import logging
from pathlib import Path

from qharness.errors import UserError, one_line
from qharness.io.names import bad_name_reason
from qharness.reporting.rows import noise_of, summary_row
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


TEXT_COLUMNS = ("run", "model", "recipe", "backend", "mode", "latency_source", "latency_class")


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
        if key.startswith(("eval/", "chance/")) and (
            key.count("/") != (3 if key.startswith("eval/") else 2)
            or any(bad_name_reason(part) for part in key.split("/")[1:])
        ):
            raise UserError(f"lm-eval task or metric name {one_line(key)!r} is not a plain name")
    return row
