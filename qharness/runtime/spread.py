"""Timings over fresh processes: the spread (median, min, max) of per-process values, ratios of two programs round by
round, and the verdict against a target.
"""

from __future__ import annotations

import statistics


def median_range(values: list[float]) -> dict:
    """``{"median", "min", "max"}`` of ``values`` (repetitions in one process, or processes)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread(values: list[float]) -> dict:
    """``{"median", "min", "max", "per_process"}`` of per-process values (e.g. each process's median tok/s)."""
    if not values:
        raise ValueError("spread of no values")
    return {**median_range(values), "per_process": list(values)}


def max_over_min(s: dict) -> float:
    """How far apart the processes were: max/min of a ``spread`` (1.0: identical)."""
    return s["max"] / s["min"]


def pair_ratios(a: list[float], b: list[float]) -> dict:
    """``spread`` of ``a[k] / b[k]``: program A against B process by process (the same round of an interleaved run)."""
    if len(a) != len(b):
        raise ValueError(f"pair_ratios needs as many values of A as of B ({len(a)} vs {len(b)})")
    return spread([x / y for x, y in zip(a, b)])


def verdict(s: dict, target: float, higher_is_better: bool) -> str:
    """ "MET" when the whole spread meets ``target``, "NOT MET" when none of it does, else "TIE/UNDECIDED"."""
    lo, hi = s["min"], s["max"]
    if (lo >= target) if higher_is_better else (hi <= target):
        return "MET"
    if (hi < target) if higher_is_better else (lo > target):
        return "NOT MET"
    return "TIE/UNDECIDED"


def format_spread(s: dict, fmt: str = ".2f") -> str:
    """``0.93 (0.88-0.99)``: median (min-max)."""
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"
