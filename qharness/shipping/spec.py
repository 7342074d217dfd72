"""A ship config read and checked, and the tolerance and budgets of ``qharness ship`` parsed, before any run.

A ship config is a sweep config without ``runs`` (the ladder gives them)::

    ship_dir: runs/ship_xnnpack   # every candidate's run directory, ship.json/.md, the chosen .pte and its recipe
    baseline: xnnpack_fp32        # the FP reference (its backend picks the ladder)
    jobs: 2                       # candidates at a time
    bench_processes: 2            # the joint benchmark: fresh processes per .pte
    config: {...}                 # every candidate's fit/calibrate config
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from qharness.errors import UserError
from qharness.io.names import check_output_dir
from qharness.io.yaml_reader import read_yaml
from qharness.shipping.decide import PREFER, Goal
from qharness.sweep.spec import check_jobs, mapping

TOP_KEYS = {"ship_dir", "baseline", "jobs", "bench_processes", "config"}
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_tolerance(value) -> float:
    """``"2%"`` -> 0.02 (a string must end in ``%``); a number is a fraction (0.02 = 2%). At least 0."""
    fix = "give the allowed perplexity increase against FP as a percentage, e.g. --max_ppl_increase 2%"
    if isinstance(value, str):
        m = _PERCENT.match(value)
        if not m:
            negative = re.fullmatch(r"\s*-\s*\d+(\.\d*)?\s*%\s*", value)
            what = "is negative: a perplexity increase must be >= 0%" if negative else "is not a percentage"
            raise UserError(f"--max_ppl_increase {value!r} {what}", fix=fix)
        return float(m.group(1)) / 100
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise UserError(f"max_ppl_increase must be a fraction >= 0 or a percentage string (got {value!r})", fix=fix)
    return float(value)


def make_goal(
    max_ppl_increase, max_size_mb: float | None = None, max_latency_ms: float | None = None, prefer: str = "size"
) -> Goal:
    """The checked ``Goal`` (one-line errors for a bad tolerance, a budget <= 0, an unknown ``prefer``)."""
    tolerance = parse_tolerance(max_ppl_increase)
    for name, v in (("max_size_mb", max_size_mb), ("max_latency_ms", max_latency_ms)):
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v)
        ):
            raise UserError(
                f"--{name} must be a positive number (got {v!r})", fix=f"e.g. --{name} 2.0, or leave it out"
            )
    if prefer not in PREFER:
        raise UserError(
            f"--prefer {prefer!r} is not one of {', '.join(PREFER)}", fix="use --prefer size or --prefer latency"
        )
    return Goal(tolerance, max_size_mb, max_latency_ms, prefer)


def load_ship(path: str | Path) -> dict:
    """Read and check a ship config: its keys, ``ship_dir``, ``baseline``, ``jobs`` and ``bench_processes``."""
    from qharness.recipes.registry import load_recipe

    path = Path(path)
    if not path.is_file():
        raise UserError(f"ship config {path} does not exist", fix="pass a ship YAML such as configs/ship_xnnpack.yaml")
    spec = mapping(read_yaml(path, "ship config"), f"ship config {path}")
    unknown = sorted(set(spec) - TOP_KEYS)
    if unknown:
        raise UserError(f"ship config {path}: unknown keys {unknown}", fix=f"use {', '.join(sorted(TOP_KEYS))}")
    spec.setdefault("ship_dir", str(Path("runs") / path.stem))
    if not isinstance(spec["ship_dir"], str) or not spec["ship_dir"].strip():
        raise UserError(
            f"ship config {path}: ship_dir must be a directory path", fix="e.g. ship_dir: runs/ship_xnnpack"
        )
    check_output_dir(spec["ship_dir"], f"ship config {path}: ship_dir")
    spec.setdefault("baseline", "xnnpack_fp32")
    baseline = load_recipe(spec["baseline"])
    if baseline.quantized:
        raise UserError(
            f"ship config {path}: baseline {spec['baseline']} is quantized; it must be the FP reference",
            fix="e.g. baseline: xnnpack_fp32",
        )
    spec["backend"] = baseline.backend
    spec["config"] = mapping(spec.get("config"), f"ship config {path}: config")
    processes = spec.setdefault("bench_processes", 2)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise UserError(
            f"ship config {path}: bench_processes must be a whole number >= 1 (got {processes!r})",
            fix="e.g. bench_processes: 2 (every candidate is timed in the joint benchmark)",
        )
    check_jobs(spec.setdefault("jobs", 1), processes, f"ship config {path}: jobs")
    return spec
