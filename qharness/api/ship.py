"""``qharness.ship``: which recipe to ship for a model and backend, under an accuracy tolerance against FP and
optional size and latency budgets (``qharness ship CONFIG`` calls it). See docs/ship.md.

Example::

    import qharness

    record = qharness.ship("configs/ship_xnnpack.yaml", "2%", max_size_mb=2.0)
    record.outcome, record.chosen, record.chosen_pte, record.decision
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from qharness.errors import UserError


def ship(
    config: str | os.PathLike,
    max_ppl_increase: str | float,
    *,
    max_size_mb: float | None = None,
    max_latency_ms: float | None = None,
    prefer: str = "size",
    jobs: int | None = None,
    exclude: Sequence[str] = (),
):
    """Climb the ship config's ladder (int8 PTQ -> 4-bit PTQ -> per-layer mixed precision -> QAT -> fewer bits) in
    its ``ship_dir``, each candidate a sweep run (finished ones reused), skipping the rungs that cannot change the
    answer; pick the smallest (``prefer="latency"``: fastest) candidate whose perplexity against FP stays within
    the tolerance at the upper end of its paired 95% interval, within the budgets. Every candidate's config is
    checked before any run starts.

    Args:
        config: A ship YAML (``configs/ship_xnnpack.yaml``): ``ship_dir``, ``baseline``, ``jobs``,
            ``bench_processes``, ``config``.
        max_ppl_increase: The tolerance: ``"2%"``, or a fraction (``0.02``).
        max_size_mb: ``.pte`` size budget (MB), or None.
        max_latency_ms: decode latency budget (ms/token, the joint benchmark's median), or None.
        prefer: ``"size"`` (the smallest that meets everything) or ``"latency"`` (the fastest).
        jobs: candidates at a time (default: the config's ``jobs``).
        exclude: recipes of the ladder to leave out (e.g. ``["xnnpack_8da4w_rot_gptq"]`` for a runtime that cannot
            take a rotation).

    Returns:
        The ``ShipRecord`` (``qharness/shipping/record.py``), also written as ``<ship_dir>/ship.json`` and ``ship.md``:
        ``outcome`` (``chosen`` or ``impossible``), ``chosen``, ``chosen_pte``, ``chosen_config`` (re-runs to the
        same program), ``closest``, ``decision``, ``stop_reason``, ``rungs``, ``candidates``, wall times.

    Raises:
        UserError: bad input (a tolerance that is no percentage, a budget <= 0, a config a candidate's pre-check
            refuses), before any run.
    """
    from qharness.api.precheck import check_config
    from qharness.shipping.climb import planned_runs, run_ship
    from qharness.shipping.ladder import ladder_for
    from qharness.shipping.spec import load_ship, make_goal
    from qharness.sweep.spec import check_jobs

    goal = make_goal(max_ppl_increase, max_size_mb, max_latency_ms, prefer)
    spec = load_ship(config)
    if jobs is not None:
        check_jobs(jobs, spec["bench_processes"], "--jobs")
    if isinstance(exclude, str):
        exclude = [exclude]
    for run in planned_runs(spec, ladder_for(spec["backend"], goal.max_size_mb, exclude, goal.max_latency_ms)):
        try:
            check_config(run.config, subcommand=run.subcommand)
        except UserError as e:
            raise UserError(f"ship {config}: candidate {run.name}: {e.what}", fix=e.fix) from e
    return run_ship(config, goal, jobs=jobs, exclude=exclude)
