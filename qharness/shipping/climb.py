"""``run_ship``: climb the ladder, each rung a sweep of its candidates in the one ship directory (finished runs are
reused, so a killed ship continues from its finished rungs), skip each rung that cannot change the answer, time
the candidates jointly, decide, and write ``ship.json``/``ship.md``, the chosen ``.pte`` and its recipe and run
config, and the report with every candidate."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import yaml

from qharness.errors import UserError
from qharness.io.atomic import write_bytes_atomic
from qharness.io.locks import hold_run_lock
from qharness.reporting.rows import _number
from qharness.shipping.decide import Goal, Reach, as_do, cannot_win, decide, fits_budgets, misses
from qharness.shipping.ladder import Rung, ladder_for
from qharness.shipping.record import CandidateRecord, RungRecord, ShipRecord
from qharness.shipping.spec import load_ship
from qharness.sweep.launch import run_logged
from qharness.sweep.plan import SweepRun, plan, run_name
from qharness.sweep.scheduler import Runner, run_sweep

RUNG_DIR = "ship_rungs"  # the sweep config of each rung, written where the ship's candidates live
CHOSEN_PTE, CHOSEN_CONFIG, CHOSEN_RECIPE, RERUN_DIR = "chosen.pte", "chosen.yaml", "chosen_recipe.yaml", "chosen_rerun"
AUTOTUNE_OPTIONS = ("max_size_mb", "candidates", "unit", "sensitivity")


def rung_spec(spec: dict, rung: Rung) -> dict:
    """The sweep config of one rung: the baseline (finished once, then reused) and the rung's candidates."""
    return {
        "sweep_dir": spec["ship_dir"],
        "baseline": spec["baseline"],
        "jobs": spec["jobs"],
        "runs": [dict(e) for e in rung.entries],
        "config": spec["config"],
        "report": {"bench_processes": spec["bench_processes"], "wandb": False},
    }


def planned_runs(spec: dict, ladder: list[Rung]) -> list[SweepRun]:
    """Every run the ladder could start (the baseline once), planned as its sweep would plan it."""
    runs: dict[str, SweepRun] = {}
    for rung in ladder:
        if rung.entries:
            runs.update({r.name: r for r in plan(rung_spec(spec, rung))})
    return list(runs.values())


def _row(run_dir: Path, name: str) -> dict | None:
    """The report row of a finished run (None without a readable summary)."""
    from qharness.reporting.rows import noise_of, summary_row
    from qharness.run.summary import RunSummary

    try:
        summary = RunSummary.read(run_dir / "summary.json")
    except (OSError, ValueError, UserError):
        return None
    return summary_row(summary, name) | noise_of(summary) | {"_run_dir": str(run_dir)}


def _reread(runs: dict[str, SweepRun], rows: dict[str, dict]) -> dict[str, dict]:
    """The rows again after the joint benchmark wrote its timings into the summaries."""
    fresh = {n: _row(runs[n].run_dir, n) for n in rows}
    return {n: r for n, r in fresh.items() if r is not None}


def _wall(run_dir: Path) -> float | None:
    """The wall time its sweep recorded for a run (``sweep_status.json``), whenever it ran."""
    import json

    try:
        v = json.loads((run_dir / "sweep_status.json").read_text()).get("wall_s")
    except (OSError, ValueError, AttributeError):
        return None
    return v if _number(v) else None


def _measured(rows: dict[str, dict]) -> dict[str, dict]:
    """The candidates whose checked ``.pte`` has a measured size: what a rung not yet run can be judged against."""
    return {n: r for n, r in rows.items() if r.get("parity_passed") is True and _number(r.get("pte_size_mb"))}


def reach_of(rung: Rung, rows: dict[str, dict]) -> Reach:
    """What the rung's programs can be, from the measured candidates: its QAT runs' PTQ siblings (same program size
    and speed); a mixed-precision rung's, never smaller than the smallest measured candidate; else unknown."""
    measured = _measured(rows)
    if rung.siblings:
        return sibling_reach(list(rung.siblings.values()), measured)
    if rung.mixes and measured:
        small = min(measured.values(), key=lambda r: r["pte_size_mb"])
        return Reach(
            small["pte_size_mb"] * rung.mix_floor,
            None,
            f"{rung.mix_floor:.3g} x the smallest measured candidate, {small['run']}: its smallest scheme's share",
        )
    return Reach(None, None, "")


def sibling_reach(siblings: list[str], measured: dict[str, dict]) -> Reach:
    """What QAT programs can be whose PTQ ``siblings`` (run names) are ``measured``: the smallest and fastest of them
    (unknown unless every sibling was measured)."""
    sibs = [measured[s] for s in siblings if s in measured]
    if not sibs or len(sibs) < len(siblings):
        return Reach(None, None, "")
    lat = [r["decode_ms_per_token"] for r in sibs if _number(r.get("decode_ms_per_token"))]
    return Reach(
        min(r["pte_size_mb"] for r in sibs),
        min(lat) if len(lat) == len(sibs) else None,
        "the same program as its PTQ sibling " + " and ".join(r["run"] for r in sibs),
    )


def prune(rung: Rung, rows: dict[str, dict], goal: Goal) -> tuple[Rung, list[str]]:
    """``rung`` without the entries whose own PTQ sibling shows they cannot change the answer (a QAT program the
    size of a sibling over the budget, or no smaller than a candidate that meets everything), and why each was left
    out: a rung that runs trains only what could win."""
    if not rung.siblings:
        return rung, []
    measured = _measured(rows)
    kept, left_out = [], []
    for entry in rung.entries:
        name = run_name(entry, entry["modes"][0])
        sibling = rung.siblings.get(name)
        why = cannot_win(sibling_reach([sibling], measured), list(rows.values()), goal) if sibling else None
        if why:
            left_out.append(f"{name}: {why}")
        else:
            kept.append(entry)
    return Rung(**{**rung.__dict__, "entries": tuple(kept)}), left_out


def skip_reason(rung: Rung, rows: dict[str, dict], bits: dict[str, int], goal: Goal) -> str | None:
    """Why ``rung`` cannot change the answer given the candidates measured so far (``rows``; ``bits``: each one's
    rung's weight bits), or None when it must run."""
    if rung.needs_size_budget and goal.max_size_mb is None:
        return "per-layer mixed precision fits a .pte size budget; no --max_size_mb given"
    if not rung.entries:
        return "none of its recipes is available for this backend and mode"
    ok = sorted((r for r in rows.values() if not misses(r, goal)), key=lambda r: (r["pte_size_mb"], r["run"]))
    if rung.on_demand:
        if ok:
            return (
                f"{ok[0]['run']} already meets everything{as_do(ok[0], ok)}; fewer bits are tried only when the "
                "budgets demand them"
            )
        fitting = sorted(n for n, r in rows.items() if bits.get(n, 0) > rung.bits and fits_budgets(r, goal))
        if fitting:
            return (
                f"{', '.join(fitting)} at more bits fit the budgets but miss the tolerance; fewer bits lose more "
                "accuracy, so the budgets do not demand them"
            )
    if rung.mixes and ok:
        return (
            f"{ok[0]['run']} already meets everything{as_do(ok[0], ok)}; per-layer mixed precision spends the size "
            "budget on accuracy, it does not look for a smaller program"
        )
    reach = reach_of(rung, rows)
    why = cannot_win(reach, list(rows.values()), goal)
    if why:
        return why
    if rung.trains and ok and reach.size_mb is None:  # its PTQ siblings unmeasured: nothing says training could win
        return f"{ok[0]['run']} already meets everything without training{as_do(ok[0], ok)}"
    return None


def _candidate(name: str, rung: str, run: SweepRun, state: str, row: dict | None, goal: Goal) -> CandidateRecord:
    c = CandidateRecord(name, rung, run.recipe, run.mode, state, str(run.run_dir), wall_s=_wall(run.run_dir))
    if row is None:
        c.verdict = "no summary: the run failed (see its sweep.log)"
        return c
    c.ppl, c.ppl_vs_fp = row.get("ppl_pte"), row.get("ppl_pte_vs_fp")
    c.ppl_vs_fp_lo, c.ppl_vs_fp_hi = row.get("ppl_pte_vs_fp_lo"), row.get("ppl_pte_vs_fp_hi")
    c.size_mb, c.latency_ms = row.get("pte_size_mb"), row.get("decode_ms_per_token")
    c.latency_source, c.parity_passed = row.get("latency_source"), row.get("parity_passed")
    missed = misses(row, goal)
    c.verdict = "meets everything" if not missed else "dropped: " + "; ".join(missed)
    return c


def _bench(spec: dict, ship_dir: Path, runs: dict[str, SweepRun], rows: dict[str, dict]) -> None:
    """Every finished candidate that passed its gate timed jointly (``sweep/joint_bench.py``)."""
    from qharness.sweep.joint_bench import bench_joint

    records = [
        {"name": n, "run_dir": str(runs[n].run_dir), "state": "done"} for n, r in rows.items() if r.get("parity_passed")
    ]
    if _timed_together(ship_dir, {r["name"] for r in records}, rows):
        print(
            f"[ship] the {len(records)} candidates were timed in one joint benchmark already (bench_joint.json): kept",
            flush=True,
        )
        return
    try:
        bench_joint(ship_dir, records, spec["bench_processes"], spec["config"].get("bench") or {})
    except (UserError, RuntimeError) as e:
        print(f"[ship] no joint benchmark: {e}", flush=True)


def _timed_together(ship_dir: Path, names: set[str], rows: dict[str, dict]) -> bool:
    """Whether the last joint benchmark in ``ship_dir`` timed these candidates (and maybe more) in one session and each
    one's summary still carries its timing (a candidate made again since has a new summary without one)."""
    import json

    try:
        timed = set(json.loads((ship_dir / "bench_joint.json").read_text())["programs"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return names <= timed and all(rows[n].get("_decode_ms_samples") for n in names)


def write_chosen(ship_dir: Path, run: SweepRun, row: dict) -> dict:
    """The chosen ``.pte`` copied to ``chosen.pte``; its recipe (the autotuned one, or the recipe's YAML) to
    ``chosen_recipe.yaml`` with its ``base:`` chain merged in (a relative ``base:`` would not be found from there);
    ``chosen.yaml``: the candidate's run config naming that recipe file, run into ``chosen_rerun/`` (its first line
    the command), which makes the same program again."""
    from qharness.recipes.registry import RECIPES_DIR, flattened_recipe
    from qharness.run.summary import RunSummary
    from qharness.runtime.pte import data_file

    summary = RunSummary.read(run.run_dir / "summary.json")
    pte = summary.pte_file(run.run_dir)
    if data_file(pte).is_file():  # its data file first: a chosen.pte is never found without it
        write_bytes_atomic(data_file(ship_dir / CHOSEN_PTE), data_file(pte).read_bytes())
    else:
        data_file(ship_dir / CHOSEN_PTE).unlink(missing_ok=True)
    write_bytes_atomic(ship_dir / CHOSEN_PTE, pte.read_bytes())
    source = run.run_dir / "autotuned.yaml" if run.autotune else Path(run.recipe)
    if not run.autotune and not source.is_file():
        source = RECIPES_DIR / f"{run.recipe}.yaml"
    write_bytes_atomic(ship_dir / CHOSEN_RECIPE, flattened_recipe(str(source)).encode())  # no relative base: left
    config = {k: v for k, v in run.config.items() if not (run.autotune and k in AUTOTUNE_OPTIONS)}
    config = {**config, "model": {**config["model"], "recipe": str(ship_dir / CHOSEN_RECIPE)}}
    config["trainer"] = {**config.get("trainer", {}), "default_root_dir": str(ship_dir / RERUN_DIR)}
    sub = "fit" if run.mode == "qat" else "calibrate"
    command = f"qharness {sub} {ship_dir / CHOSEN_CONFIG}"
    header = f"# {command}\n# the run config of {run.name}, chosen by qharness ship; it makes the same program again\n"
    write_bytes_atomic(ship_dir / CHOSEN_CONFIG, (header + yaml.safe_dump(config, sort_keys=False)).encode())
    return {
        "chosen_pte": str(ship_dir / CHOSEN_PTE),
        "chosen_config": str(ship_dir / CHOSEN_CONFIG),
        "chosen_recipe": str(ship_dir / CHOSEN_RECIPE),
        "rerun": command,
    }


def _stop_reason(rungs: list[RungRecord]) -> str:
    """Where the climb ended and why the rungs after it could not change the answer."""
    tried = [i for i, r in enumerate(rungs) if r.state == "tried"]
    if not tried:
        return "no rung could run: " + "; ".join(f"{r.name}: {r.reason}" for r in rungs)
    last = tried[-1]
    after = rungs[last + 1 :]
    if not after:
        return f"the ladder's last rung ({rungs[last].name}) was tried"
    return f"after {rungs[last].name}, no further rung could change the answer: " + "; ".join(
        f"{r.name}: {r.reason}" for r in after
    )


def run_ship(
    config: str | Path,
    goal: Goal,
    jobs: int | None = None,
    runner: Runner = run_logged,
    exclude: Sequence[str] = (),
) -> ShipRecord:
    """Climb the ladder of the ship config for ``goal`` (without the recipes in ``exclude``); returns the
    ``ShipRecord`` also written as ship.json/.md."""
    t0 = time.perf_counter()
    spec = load_ship(config)
    ship_dir = Path(spec["ship_dir"])
    ladder = ladder_for(spec["backend"], goal.max_size_mb, exclude, goal.max_latency_ms)
    hold_run_lock(ship_dir)
    (ship_dir / RUNG_DIR).mkdir(parents=True, exist_ok=True)
    goal_record = asdict(goal) | {"text": goal.text(), "exclude": list(exclude)}
    rec = ShipRecord(str(config), str(ship_dir), goal_record, "running")
    runs: dict[str, SweepRun] = {}
    rows: dict[str, dict] = {}
    rung_of: dict[str, str] = {}
    bits: dict[str, int] = {}
    order: dict[str, int] = {}
    states: dict[str, str] = {}
    baseline: SweepRun | None = None
    print(f"[ship] goal: {goal.text()}; ladder: {' -> '.join(r.name for r in ladder)}", flush=True)
    for i, rung in enumerate(ladder):
        reason = skip_reason(rung, rows, bits, goal)
        if reason is None:
            rung, left_out = prune(rung, rows, goal)
            reason = None if rung.entries else "every entry left out: " + "; ".join(left_out)
        if reason is not None:
            print(f"[ship] rung {rung.name}: skipped: {reason}", flush=True)
            rec.rungs.append(RungRecord(rung.name, rung.why, "skipped", reason))
            rec.write(ship_dir)
            continue
        print(f"[ship] rung {rung.name}: {rung.why}", flush=True)
        for line in left_out:
            print(f"[ship]   left out {line}", flush=True)
        t = time.perf_counter()
        path = ship_dir / RUNG_DIR / f"{rung.name}.yaml"
        write_bytes_atomic(path, yaml.safe_dump(rung_spec(spec, rung), sort_keys=False).encode())
        result = run_sweep(path, runner=runner, report=False, jobs=jobs, joint=False)
        planned = plan(rung_spec(spec, rung))
        baseline = planned[0]
        names = []
        for run, record in zip(planned[1:], result["runs"][1:], strict=True):
            names.append(run.name)
            runs[run.name], rung_of[run.name], bits[run.name], order[run.name] = run, rung.name, rung.bits, i
            states[run.name] = {"done": "ran", "skipped": "reused"}.get(record["state"], "failed")
            row = _row(run.run_dir, run.name) if record["state"] != "failed" else None
            if row is not None:
                rows[run.name] = row
        if goal.needs_latency:  # the decision reads latencies: every candidate so far timed jointly, now
            _bench(spec, ship_dir, runs, rows)
            rows = _reread(runs, rows)
        reason = "left out " + "; ".join(left_out) if left_out else ""
        rec.rungs.append(RungRecord(rung.name, rung.why, "tried", reason, names, time.perf_counter() - t))
        rec.candidates = [_candidate(n, rung_of[n], runs[n], states[n], rows.get(n), goal) for n in runs]
        rec.write(ship_dir)  # a killed ship leaves the finished rungs recorded (their runs are reused on re-run)
    if rows and not goal.needs_latency:  # one joint benchmark of every candidate, for the record and the report
        _bench(spec, ship_dir, runs, rows)
        rows = _reread(runs, rows)
    decision = decide(list(rows.values()), goal, order)
    rec.candidates = [_candidate(n, rung_of[n], runs[n], states[n], rows.get(n), goal) for n in runs]
    rec.stop_reason = _stop_reason(rec.rungs)
    rec.decision = decision.text
    if decision.chosen is not None:
        name = decision.chosen["run"]
        rec.outcome, rec.chosen, rec.tied = "chosen", name, [r["run"] for r in decision.tied]
        for k, v in write_chosen(ship_dir, runs[name], decision.chosen).items():
            setattr(rec, k, v)
        for c in rec.candidates:
            if c.name == name:
                c.verdict = "CHOSEN: " + c.verdict
            elif c.name in rec.tied:
                c.verdict = "tie, not chosen by the tie rule: " + c.verdict
    else:
        rec.outcome = "impossible"
        rec.closest = decision.closest["run"] if decision.closest else None
        for c in rec.candidates:
            if c.name == rec.closest:
                c.verdict = "CLOSEST: " + c.verdict
    rec.report = _report(ship_dir, goal, decision.text)
    walls = [_wall(r.run_dir) for r in [*([baseline] if baseline else []), *runs.values()]]
    rec.candidates_wall_s = sum(w for w in walls if w is not None)
    rec.wall_s = time.perf_counter() - t0
    rec.write(ship_dir)
    return rec


def _report(ship_dir: Path, goal: Goal, decision: str) -> str | None:
    """The report of every run in the ship directory (table, Pareto plots), the decision as its note."""
    from qharness.reporting.report import write_report

    try:
        out = write_report(
            ship_dir, ship_dir, "ppl", goal.max_latency_ms, goal.max_size_mb, wandb=False, notes=[f"Ship: {decision}"]
        )
    except UserError as e:
        print(f"[ship] no report: {e}", flush=True)
        return None
    return out["paths"]["markdown"]
