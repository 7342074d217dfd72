"""The sweep run: each planned run not yet done started in its own process (up to ``jobs`` at a time, each after the
runs it depends on), recorded, then the joint benchmark and the report."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import yaml

from qharness.errors import UserError
from qharness.io.atomic import write_bytes_atomic, write_json_atomic
from qharness.io.locks import hold_run_lock
from qharness.progress import format_seconds
from qharness.sweep.joint_bench import bench_joint
from qharness.sweep.launch import run_logged
from qharness.sweep.plan import SweepRun, depends_on, plan
from qharness.sweep.resume import STATUS, is_done, resumable, write_status
from qharness.sweep.spec import check_jobs, load_sweep, mapping
from qharness.upstream import process

Runner = Callable[[list[str], Path], int]


def resolve_shared_model(runs: list[SweepRun]) -> None:
    """Build (or find in the cache) the built-in models (the embedded default, the embedded chat model) once, before
    the runs that use them."""
    from qharness.sources.models import EMBEDDED_MODELS, resolve_checkpoint

    for name in EMBEDDED_MODELS:
        if any(r.config.get("model", {}).get("checkpoint", "embedded") == name for r in runs):
            print(f"[sweep] shared FP model: {resolve_checkpoint(name)}", flush=True)


def in_parallel(runs: list[SweepRun], pending: list[int], jobs: int, execute: Callable[[int], None]) -> None:
    """``execute(i)`` for each index in ``pending``, up to ``jobs`` at a time in threads, in plan order, each only after
    the pending runs it ``depends_on`` have finished (failed or not, as in a sequential sweep). An exception in one
    is raised here once it ends; the others' processes then die with this one (``process.die_with_parent``)."""
    import queue

    after = {i: {j for j in pending if j < i and depends_on(runs[i], runs[j])} for i in pending}
    ended: queue.Queue = queue.Queue()

    def work(i: int) -> None:
        try:
            execute(i)
            ended.put((i, None))
        except BaseException as e:  # handed to the main thread
            ended.put((i, e))

    waiting, running, finished = list(pending), set(), set()
    while waiting or running:
        for i in [i for i in waiting if after[i] <= finished][: jobs - len(running)]:
            waiting.remove(i)
            running.add(i)
            threading.Thread(target=work, args=(i,), name=f"sweep-{runs[i].name}", daemon=True).start()
        i, error = ended.get()
        if error is not None:
            raise error
        running.discard(i)
        finished.add(i)


def base_record(run: SweepRun) -> dict:
    """What ``sweep.json`` records of every run, whether it ran or not."""
    return {
        "name": run.name,
        "recipe": run.recipe,
        "mode": run.mode,
        "run_dir": str(run.run_dir),
        "command": f"qharness {run.subcommand} {run.config_path}",
    }


@dataclass
class Executor:
    """Runs run ``i`` of ``runs`` (``executor(i)``): writes its config and status, starts its process through
    ``runner`` (resuming a killed QAT run unless ``force``), and records the outcome in ``records[i]``."""

    runs: list[SweepRun]
    records: list[dict | None]
    runner: Runner
    force: bool
    config_path: str | Path
    say: threading.Lock = field(default_factory=threading.Lock)  # one console line at a time from parallel runs

    def __call__(self, i: int) -> None:
        run, n = self.runs[i], len(self.runs)
        record = base_record(run)
        cmd = process.python_command("-m", "qharness", run.subcommand, "--config", str(run.config_path))
        resume = not self.force and resumable(run)
        if resume:
            cmd += ["--ckpt_path", "last"]
            record["command"] += " --ckpt_path last"
        for stale in ("summary.json", STATUS):  # a result of another config must not show up as this run's
            (run.run_dir / stale).unlink(missing_ok=True)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        header = f"# {record['command']}  (written by qharness sweep {self.config_path}; edit the sweep config, not this file)\n"
        write_bytes_atomic(run.config_path, (header + yaml.safe_dump(run.config, sort_keys=False)).encode())
        # started with this config: a kill from here on leaves a run that the next sweep resumes (``resumable``)
        write_status(run, record["command"], None)
        how = "resuming from its last checkpoint: " if resume else ""
        with self.say:
            print(
                f"[sweep {i + 1}/{n}] {run.name}: {how}{record['command']} (log: {run.run_dir / 'sweep.log'})",
                flush=True,
            )
        t = time.perf_counter()
        code = self.runner(cmd, run.run_dir / "sweep.log")
        wall = time.perf_counter() - t
        write_status(run, record["command"], code, wall)
        self.records[i] = {**record, "state": "done" if code == 0 else "failed", "returncode": code, "wall_s": wall}
        outcome = "done" if code == 0 else f"FAILED (exit {code}), see {run.run_dir / 'sweep.log'}"
        with self.say:
            print(f"[sweep {i + 1}/{n}] {run.name}: {outcome} in {format_seconds(wall)}", flush=True)


def run_sweep(
    config_path: str | Path,
    force: bool = False,
    runner: Runner = run_logged,
    report: bool = True,
    jobs: int | None = None,
    joint: bool = True,
) -> dict:
    """Run every run of the sweep not yet done (all with ``force``), record each, then (``joint``) the joint
    benchmark and (``report``) the report. ``jobs``: runs at a time (default: the config's ``jobs``, else 1).

    Returns ``{"runs": [record, ...], "report": write_report's result or None, "wall_s": ...}``.
    """
    t0 = time.perf_counter()
    spec = load_sweep(config_path)
    if jobs is not None:
        check_jobs(jobs, spec["report"].get("bench_processes", 5), "--jobs")
    runs = plan(spec)
    sweep_dir = Path(spec["sweep_dir"])
    hold_run_lock(sweep_dir)  # one sweep per directory (its runs lock their own run directories)
    todo = [r for r in runs if force or not is_done(r)]
    todo_names = {r.name for r in todo}
    print(
        f"[sweep] {len(runs)} runs in {sweep_dir} ({len(runs) - len(todo)} already finished): "
        + ", ".join(r.name for r in runs),
        flush=True,
    )
    if todo:
        resolve_shared_model(todo)
    jobs = min(spec["jobs"] if jobs is None else jobs, max(1, len(todo)))
    if jobs > 1:
        threads = max(1, (os.cpu_count() or 1) // jobs)
        print(
            f"[sweep] {jobs} runs at a time, {threads} thread(s) each; each run's output goes to its sweep.log",
            flush=True,
        )
        if runner is run_logged:
            runner = partial(run_logged, echo=False, threads=threads)
    records: list[dict | None] = [None] * len(runs)
    execute = Executor(runs, records, runner, force, config_path)
    pending = []
    for i, run in enumerate(runs):
        if run.name in todo_names:
            pending.append(i)
            continue
        records[i] = {**base_record(run), "state": "skipped", "reason": "finished earlier with the same config"}
        print(f"[sweep {i + 1}/{len(runs)}] {run.name}: finished earlier with the same config, skipped", flush=True)
    if jobs == 1:
        for i in pending:
            execute(i)
    else:
        in_parallel(runs, pending, jobs, execute)
    write_json_atomic(sweep_dir / "sweep.json", {"config": str(config_path), "runs": records})
    result = finish(spec, sweep_dir, records, report, joint)
    result["wall_s"] = time.perf_counter() - t0
    return result


def finish(spec: dict, sweep_dir: Path, records: list[dict], report: bool, joint: bool = True) -> dict:
    """After the runs: (``joint``) the joint benchmark, then (``report``) the report, each a printed line when it
    cannot be made (the runs and their own benchmarks stand). Returns ``{"runs", "report", "bench_joint"}``."""
    rep = spec["report"]
    result = {"runs": records, "report": None, "bench_joint": None}
    try:
        if joint:
            result["bench_joint"] = bench_joint(
                sweep_dir, records, rep.get("bench_processes", 5), mapping(spec["config"].get("bench"), "config.bench")
            )
    except (UserError, RuntimeError) as e:  # the runs and their own benchmarks stand; the report still follows
        print(f"[sweep] no joint benchmark: {e}", flush=True)
    if not report:
        return result
    from qharness.reporting.report import write_report

    notes = [
        f"Failed run: {r['name']} (exit {r['returncode']}); log {r['run_dir']}/sweep.log; rerun: {r['command']}"
        for r in records
        if r["state"] == "failed"
    ]
    print(f"[sweep] writing the report into {sweep_dir} ...", flush=True)
    try:
        result["report"] = write_report(
            sweep_dir,
            sweep_dir,
            rep.get("metric", "ppl"),
            rep.get("max_latency_ms"),
            rep.get("max_size_mb"),
            wandb=rep.get("wandb", True),
            notes=notes,
        )
    except UserError as e:
        print(f"[sweep] no report: {e}", flush=True)
    return result
