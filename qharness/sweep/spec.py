"""A sweep config read and checked: its keys, runs, report section and ``jobs``, before any run is planned."""

from __future__ import annotations

from pathlib import Path

from qharness.errors import UserError
from qharness.io.names import check_name, check_output_dir
from qharness.io.yaml_reader import read_yaml

TOP_KEYS = {"sweep_dir", "baseline", "runs", "config", "report", "jobs", "max_runs"}
MAX_RUNS = 100  # runs a sweep may plan unless its max_runs says more (each run takes minutes)
RUN_KEYS = {"recipe", "modes", "mode", "config", "name", "autotune"}
AUTOTUNE_KEYS = {"max_size_mb", "max_latency_ms", "candidates", "unit", "sensitivity"}  # qharness autotune's options
REPORT_KEYS = {"metric", "max_latency_ms", "max_size_mb", "wandb", "bench_processes"}


def mapping(value, where: str) -> dict:
    """``value`` if it is a mapping (``{}`` for None), else a ``UserError`` naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{where} must be a mapping (got {type(value).__name__})")
    return value


def load_sweep(path: str | Path) -> dict:
    """Read and check a sweep config (unknown keys, recipes and modes) before any run starts."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"sweep config {path} does not exist", fix="pass a sweep YAML such as configs/sweep_xnnpack.yaml"
        )
    spec = mapping(read_yaml(path, "sweep config"), f"sweep config {path}")
    unknown = set(spec) - TOP_KEYS
    if unknown:
        raise UserError(
            f"sweep config {path}: unknown keys {sorted(unknown)}", fix=f"use {', '.join(sorted(TOP_KEYS))}"
        )
    if not isinstance(spec.get("runs"), list) or not spec["runs"]:
        raise UserError(
            f"sweep config {path} needs runs: a list like [{{recipe: xnnpack_int8_dynamic, modes: [ptq, qat]}}]"
        )
    spec.setdefault("sweep_dir", str(Path("runs") / path.stem))
    if not isinstance(spec["sweep_dir"], str) or not spec["sweep_dir"].strip():
        raise UserError(
            f"sweep config {path}: sweep_dir must be a directory path (got {spec['sweep_dir']!r})",
            fix="e.g. sweep_dir: runs/sweep_xnnpack",
        )
    check_output_dir(spec["sweep_dir"], f"sweep config {path}: sweep_dir")
    spec.setdefault("baseline", "xnnpack_fp32")
    spec["config"] = mapping(spec.get("config"), "sweep config: config")
    spec["report"] = mapping(spec.get("report"), "sweep config: report")
    unknown = set(spec["report"]) - REPORT_KEYS
    if unknown:
        raise UserError(
            f"sweep config {path}: unknown report keys {sorted(unknown)}", fix=f"use {', '.join(sorted(REPORT_KEYS))}"
        )
    processes = spec["report"].get("bench_processes", 5)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 0:
        raise UserError(
            f"sweep config {path}: report.bench_processes must be a whole number >= 0 (got {processes!r})",
            fix="set report.bench_processes: 5 (0 skips the joint benchmark)",
        )
    check_jobs(spec.setdefault("jobs", 1), processes, f"sweep config {path}: jobs")
    limit = spec.setdefault("max_runs", MAX_RUNS)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise UserError(
            f"sweep config {path}: max_runs must be a whole number >= 1 (got {limit!r})",
            fix=f"e.g. max_runs: {MAX_RUNS}",
        )
    count = (1 if spec["baseline"] else 0) + sum(
        len(m) if isinstance(m := run.get("modes", run.get("mode")), list) else 1
        for run in spec["runs"]
        if isinstance(run, dict)
    )
    if count > limit:
        raise UserError(
            f"sweep config {path} plans {count} runs (baseline included), more than max_runs: {limit}; each run takes "
            "minutes",
            fix=f"set max_runs: {count} in the sweep config to run them all, or list fewer runs",
        )
    for i, run in enumerate(spec["runs"]):
        _check_run_entry(mapping(run, f"sweep config: runs[{i}]"), f"sweep config {path}: runs[{i}]")
    return spec


def _check_run_entry(run: dict, where: str) -> None:
    """One entry of ``runs``: known keys, a recipe or an autotune budget, one of mode/modes, a plain name."""
    unknown = set(run) - RUN_KEYS
    if unknown or ("recipe" not in run and "autotune" not in run):
        raise UserError(
            f"{where} needs recipe (or autotune) and modes (unknown keys: {sorted(unknown)})",
            fix="write runs entries like {recipe: xnnpack_int8_dynamic, modes: [ptq, qat]} or "
            "{autotune: {max_size_mb: 1.6}, modes: [ptq]}",
        )
    if "mode" in run and "modes" in run:
        raise UserError(
            f"{where} has both mode and modes (one of them would be ignored)",
            fix=f"keep one: modes: {_modes_together(run)}",
        )
    if "name" in run:
        check_name(run["name"], f"{where}.name", "int8_distill")
    if "autotune" in run:
        _check_autotune(run["autotune"], f"{where}.autotune")
        run.setdefault("recipe", "xnnpack_8da4w")


def _modes_together(run: dict) -> list:
    """``mode`` and ``modes`` of a run entry as one list (for the fix of an entry that has both)."""
    modes = run["modes"] if isinstance(run["modes"], list) else [run["modes"]]
    return list(dict.fromkeys([*modes, run["mode"]]))


def check_jobs(jobs, bench_processes: int, where: str) -> None:
    """``jobs`` (runs at a time) must be a whole number >= 1, and above 1 only with the joint benchmark."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise UserError(f"{where} must be a whole number >= 1 (got {jobs!r})", fix="e.g. jobs: 2 (runs at a time)")
    if jobs > 1 and bench_processes == 0:
        raise UserError(
            f"{where}: {jobs} runs at a time with report.bench_processes: 0 would leave only the runs' own benchmarks, "
            "each timed while other runs ran",
            fix="set report.bench_processes >= 1 (the joint benchmark runs alone, after the runs), or 1 run at a time",
        )


def _check_autotune(value, where: str) -> None:
    from qharness.evaluation.autotune import check_budget

    if not isinstance(value, dict):
        raise UserError(f"{where} must be a mapping (got {value!r})", fix="e.g. autotune: {max_size_mb: 1.6}")
    unknown = sorted(set(value) - AUTOTUNE_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown keys {unknown}", fix=f"use {', '.join(sorted(AUTOTUNE_KEYS))}")
    try:
        check_budget(value.get("max_size_mb"), value.get("max_latency_ms"))
    except UserError as e:
        raise UserError(
            f"{where}: {e.what}", fix="e.g. autotune: {max_size_mb: 1.6} (and/or max_latency_ms: 0.6)"
        ) from None
