"""What an earlier sweep left in a run directory: ``sweep_status.json`` (the config digest and exit code it ran
with), read to skip a finished run or resume a killed QAT run, and written as a run starts and ends."""

from __future__ import annotations

import json

from qharness.errors import UserError
from qharness.io.atomic import write_json_atomic
from qharness.sweep.plan import SweepRun

STATUS = "sweep_status.json"


def _status(run: SweepRun) -> dict | None:
    """The run's ``sweep_status.json`` if it was written for this very config (same digest), else None."""
    try:
        status = json.loads((run.run_dir / STATUS).read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) and status.get("config_sha256") == run.digest() else None


def write_status(run: SweepRun, command: str, returncode: int | None, wall_s: float | None = None) -> None:
    """Record that ``run`` started (``returncode`` None: a kill from here on leaves a run the next sweep resumes) or
    ended with ``returncode`` after ``wall_s`` seconds."""
    status = {"config_sha256": run.digest(), "returncode": returncode}
    if wall_s is not None:
        status["wall_s"] = wall_s
    write_json_atomic(run.run_dir / STATUS, status | {"command": command})


def is_done(run: SweepRun) -> bool:
    """Finished with this very config: exit 0 recorded for the same config digest, and its summary.json is there."""
    from qharness.run.summary import RunSummary

    status = _status(run)
    if status is None or status.get("returncode") != 0:
        return False
    try:
        summary = RunSummary.read(run.run_dir / "summary.json")
    except (OSError, ValueError, UserError):
        return False
    return summary.recipe == run.summary_recipe and summary.mode == run.mode


def resumable(run: SweepRun) -> bool:
    """A QAT run of this very config that was started and did not finish (killed, or failed) and left a
    ``last.ckpt``: it goes on from there (``--ckpt_path last``) instead of training again from step 0."""
    return (
        run.mode == "qat"
        and not run.autotune
        and _status(run) is not None
        and (run.run_dir / "checkpoints" / "last.ckpt").is_file()
    )
