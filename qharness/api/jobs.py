"""Whole jobs as functions: a run config (the YAML ``qharness fit|calibrate|...`` takes) run in this process, a sweep
and a report, returning what they produced. ``qharness <subcommand>`` calls these; so can any script.

Example::

    from qharness.api.jobs import report, run_job, sweep

    summary = run_job("configs/ptq_xnnpack.yaml", "calibrate", ["--trainer.default_root_dir", "runs/ptq"])
    summary.pte.size_bytes, summary.parity.passed, summary.metrics["pte"].ppl
    result = sweep("configs/sweep_xnnpack.yaml", dry_run=True)   # the planned runs, nothing run
    table = report("runs/", max_size_mb=2.0, wandb=False)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from qharness.errors import UserError
from qharness.run.summary import RunSummary

# the subcommands a run config drives (LightningCLI, ``api/lightning_cli.py``)
RUN_SUBCOMMANDS = ("fit", "calibrate", "validate", "test", "export", "evaluate", "sensitivity", "autotune")


def run_job(
    config: str | os.PathLike | dict, subcommand: str = "fit", overrides: Sequence[str] = ()
) -> RunSummary | None:
    """Run what ``qharness SUBCOMMAND CONFIG OVERRIDES...`` runs, in this process: the same checks before any long
    work (one-line ``UserError``s), the same run directory, checkpoints, ``.pte`` and ``summary.json``.

    Args:
        config: A run config: a YAML file, or its content as a dict (written to a temporary file for the run).
        subcommand: ``fit``, ``calibrate``, ``validate``, ``test``, ``export``, ``evaluate``, ``sensitivity`` or
            ``autotune``.
        overrides: Command-line options after the config, e.g. ``["--trainer.max_steps", "50"]``.

    Returns:
        The run's summary when the job deployed a ``.pte`` (fit with ``deploy.enabled``, calibrate, export,
        autotune) or evaluated one (evaluate: the summary with its new ``evaluations`` entry); else None.

    Raises:
        UserError: bad input (the CLI's exit 2). ``ParityError``: the ``.pte`` failed the parity gate (exit 1).

    Example::

        summary = run_job({"model": {"recipe": "xnnpack_8da4w", "mode": "ptq"}, "data": {"source": "corpus.txt"},
                           "trainer": {"default_root_dir": "runs/ptq"}}, "calibrate")
    """
    if subcommand not in RUN_SUBCOMMANDS:
        raise UserError(
            f"subcommand {subcommand!r} takes no run config", fix=f"use one of {', '.join(RUN_SUBCOMMANDS)}"
        )
    if isinstance(overrides, str):
        raise UserError("overrides must be a list of strings", fix='e.g. ["--trainer.max_steps", "50"]')
    with _config_path(config) as path:
        from qharness.io.locks import release_run_locks

        try:
            cli = run_argv([subcommand, "--config", str(path), *overrides])
        finally:
            release_run_locks()  # the job is over: the run directory is free for the next one
    summary = cli.trainer.summary
    written = Path(cli.trainer.default_root_dir) / "summary.json"
    if summary is None and subcommand == "evaluate" and written.is_file():
        summary = RunSummary.read(written)
    return summary


@contextlib.contextmanager
def _config_path(config) -> Iterator[Path]:
    """``config`` as a file: a path as it is, a dict written as YAML to a temporary file (removed afterwards)."""
    if isinstance(config, (str, os.PathLike)):
        yield Path(config)
        return
    if not isinstance(config, dict):
        raise UserError(
            f"a run config is a YAML path or a dict (got {type(config).__name__})",
            fix='pass "configs/qat_xnnpack.yaml" or {"model": {...}, "data": {...}}',
        )
    import yaml

    with tempfile.TemporaryDirectory(prefix="qharness-config-") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        yield path


def run_argv(argv: list[str]):
    """A run-config command line (``[subcommand, --config, PATH, --field, value, ...]``): the config checked before
    torch loads (``precheck``), its lm-eval tasks, then LightningCLI; returns the CLI (``.trainer.summary``)."""
    from qharness.api.precheck import precheck

    run = precheck(argv)  # the config's own errors in about a second, before torch loads
    check_tasks_early(argv, run)
    from qharness.api.lightning_cli import run_lightning_cli

    return run_lightning_cli(argv)


def check_tasks_early(argv: list[str], run) -> None:
    """lm-eval task names (and whether their data can be reached) checked before Lightning is even imported, so a
    typo or an offline machine fails in a second or two: ``eval.tasks`` of the pre-check's ``RunConfig`` (``run``;
    None: it could not read the config, and preflight checks them), or evaluate's ``--tasks a,b``."""
    if argv[0] not in ("fit", "calibrate", "export", "evaluate") or run is None:
        return
    if argv[0] != "evaluate" and not run.eval.enabled:
        return
    from qharness.api.precheck import option

    given = option(argv, "--tasks") if argv[0] == "evaluate" else None
    tasks = [t.strip() for t in given.strip("[]").split(",") if t.strip()] if given else run.eval.tasks
    from qharness.evaluation.tasks import check_tasks

    check_tasks([str(t) for t in tasks], run.eval.include_path)


def sweep(config: str | os.PathLike, *, force: bool = False, dry_run: bool = False, jobs: int | None = None) -> dict:
    """Run the FP baseline and recipes x modes of a sweep config, each in its own run directory and child process
    (finished runs are skipped unless ``force``), time every ``.pte`` jointly, then write the report. Every run's
    config is checked before any run starts.

    Returns:
        ``{"runs": [{"name", "state", ...}], "report": report(...)'s result or None, "wall_s": seconds}``; with
        ``dry_run``, nothing runs and each planned run is ``{"name", "subcommand", "config", "state"}`` with state
        ``finished`` (would be skipped) or ``planned``.

    Example::

        result = sweep("configs/sweep_xnnpack.yaml", jobs=2)
        [r["name"] for r in result["runs"] if r["state"] == "failed"]
    """
    from qharness.api.precheck import check_config
    from qharness.sweep.plan import plan
    from qharness.sweep.resume import is_done
    from qharness.sweep.scheduler import run_sweep
    from qharness.sweep.spec import load_sweep

    runs = plan(load_sweep(config))
    for run in runs:  # every run's own config checked before any run starts: one line now, not after the others ran
        try:
            check_config(run.config, subcommand=run.subcommand)
        except UserError as e:
            raise UserError(f"sweep {config}: run {run.name}: {e.what}", fix=e.fix) from e
    if dry_run:
        planned = [
            {
                "name": run.name,
                "subcommand": run.subcommand,
                "config": str(run.config_path),
                "state": "finished" if is_done(run) and not force else "planned",
            }
            for run in runs
        ]
        return {"runs": planned, "report": None, "wall_s": 0.0}
    return run_sweep(config, force=force, jobs=jobs)


def report(
    runs_dir: str | os.PathLike,
    *,
    out: str | os.PathLike | None = None,
    metric: str = "ppl",
    max_latency_ms: float | None = None,
    max_size_mb: float | None = None,
    wandb: bool = True,
) -> dict:
    """Accuracy vs latency of every run under ``runs_dir`` (its ``summary.json`` files): report.md/.csv/.json, the
    Pareto plots and the best run under the budgets, written to ``out`` (default: ``runs_dir``); logged to wandb.

    Returns:
        ``{"text": the printed report, "paths": {"markdown", "csv", "png", "size_png", ...}, "wandb_dir", ...}``.

    Example::

        result = report("runs/sweep_xnnpack", max_size_mb=2.0, wandb=False)
        print(result["text"])
    """
    from qharness.reporting.report import write_report

    for name, v in (("max_latency_ms", max_latency_ms), ("max_size_mb", max_size_mb)):
        if v is not None and not v > 0:
            raise UserError(f"--{name} must be positive (got {v})")
    return write_report(runs_dir, out, metric, max_latency_ms, max_size_mb, wandb=wandb)
