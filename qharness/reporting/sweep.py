"""``qharness sweep CONFIG``: the FP baseline and recipes x modes on one model and data, then the report.

A sweep config names the shared run config (``config``: the groups of a fit/calibrate config), the FP
``baseline`` recipe (run first, PTQ) and ``runs``: recipes with their modes (and optionally their own ``config``
over the shared one, and a ``name`` in place of the recipe's, for variants of one recipe). Each run is its own run
directory ``<sweep_dir>/<name or recipe>-<mode>/`` run by the ordinary CLI in a fresh process (``qharness fit`` for
QAT, ``qharness calibrate`` for PTQ) from the generated ``sweep_config.yaml`` there; its output goes to the
console and to ``sweep.log`` there. A failed run is recorded and the sweep goes on. A re-run skips every run
that finished with the same generated config (``sweep_status.json`` + ``summary.json``) and resumes a QAT run
of that config that was killed or failed (``--ckpt_path last``, ``resumable``); ``--force`` reruns all. A run's name must be one plain directory name
(``io.check_name``: no separators, ``..`` or control characters), so every run stays inside ``sweep_dir``; a run
process starts with ``python -P`` (nothing from the current directory is imported). A run's
process gets SIGTERM when the sweep dies, so a killed sweep leaves nothing running. The embedded default model
is resolved (pretrained once, cached) before the first run, so the runs share it; the eager FP model is benchmarked only in the first run (``bench.eager: false`` in the others). lm-eval
(unless the config sets ``eval.models``) scores the FP model and ``.pte`` in the baseline run, the ``.pte`` in
PTQ runs and the fake-quant model and ``.pte`` in QAT runs. Once all runs are finished, every finished run's
``.pte`` is timed jointly (``qharness.runtime.bench.bench_jointly``: ``report.bench_processes`` fresh processes per
program, default 5, round-robin; 0 skips it): each run's summary.json gets ``bench_joint`` and
``<sweep_dir>/bench_joint.json`` holds them all, so the programs are compared under the same conditions. The
sweep ends with ``qharness report <sweep_dir>`` (``report`` section: metric and budgets).

``jobs: N`` (or ``--jobs N``) runs up to N runs at a time, each with its share of the cores (``OMP_NUM_THREADS``,
``QHARNESS_THREADS``: cores // N, unless set), in plan order; a run whose config names an earlier run's directory
(an ``autotuned.yaml`` recipe, a ``model.distill.teacher``) waits for it. Their output then goes to their
``sweep.log`` only. Much of a run is single-threaded (imports, export, lowering, the parity gate), so two runs at a
time finish a sweep sooner on a few cores. The joint benchmark still runs alone, after every run; a run's own
``qharness bench`` would time under the others' load, so ``jobs`` > 1 needs the joint benchmark
(``report.bench_processes`` >= 1), whose numbers the report uses.

Example config::

    sweep_dir: runs/sweep_xnnpack
    baseline: xnnpack_fp32
    runs:
      - {recipe: xnnpack_int8_dynamic, modes: [ptq, qat]}
      - {recipe: xnnpack_int8_dynamic, modes: [qat], name: int8_distill, config: {model: {distill: {}}}}
    config:
      model: {checkpoint: embedded}
      trainer: {max_steps: 100}
    report: {max_size_mb: 2.0}

A run entry may also name an autotune budget instead of (or with) a recipe: ``{autotune: {max_size_mb: 1.6},
modes: [ptq]}`` runs ``qharness autotune`` (base recipe: ``recipe``, default ``xnnpack_8da4w``; other keys of
``autotune``: ``candidates``, ``unit``, ``sensitivity``) in ``<sweep_dir>/<name or autotune_<budget>mb>-<mode>/``, so
its ``.pte`` joins the report and the Pareto plots; its ``autotuned.yaml`` is a recipe file that a later entry (or
any run) can name as ``recipe``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import yaml

from qharness.config import deep_merge
from qharness.errors import UserError
from qharness.io import (
    check_inside,
    check_name,
    check_output_dir,
    hold_run_lock,
    read_yaml,
    write_bytes_atomic,
    write_json_atomic,
)
from qharness.progress import format_seconds
from qharness.upstream import process

TOP_KEYS = {"sweep_dir", "baseline", "runs", "config", "report", "jobs"}
RUN_KEYS = {"recipe", "modes", "mode", "config", "name", "autotune"}
AUTOTUNE_KEYS = {"max_size_mb", "candidates", "unit", "sensitivity"}  # qharness autotune's options
AUTOTUNED = "autotuned"  # the recipe name of an autotune run (its recipe file autotuned.yaml)
REPORT_KEYS = {"metric", "max_latency_ms", "max_size_mb", "wandb", "bench_processes"}
SUBCOMMAND = {"qat": "fit", "ptq": "calibrate"}
STATUS = "sweep_status.json"


@dataclass
class SweepRun:
    """One run of a sweep: ``qharness <subcommand> --config <run_dir>/sweep_config.yaml``."""

    name: str
    recipe: str
    mode: str
    config: dict
    run_dir: Path
    autotune: bool = False

    @property
    def subcommand(self) -> str:
        return "autotune" if self.autotune else SUBCOMMAND[self.mode]

    @property
    def summary_recipe(self) -> str:
        """The recipe name the run's summary.json records."""
        return AUTOTUNED if self.autotune else Path(self.recipe).stem

    @property
    def config_path(self) -> Path:
        return self.run_dir / "sweep_config.yaml"

    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.subcommand, self.config], sort_keys=True).encode()).hexdigest()


def _mapping(value, where: str) -> dict:
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
    spec = _mapping(read_yaml(path, "sweep config"), f"sweep config {path}")
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
    spec["config"] = _mapping(spec.get("config"), "sweep config: config")
    spec["report"] = _mapping(spec.get("report"), "sweep config: report")
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
    for i, run in enumerate(spec["runs"]):
        run = _mapping(run, f"sweep config: runs[{i}]")
        unknown = set(run) - RUN_KEYS
        if unknown or ("recipe" not in run and "autotune" not in run):
            raise UserError(
                f"sweep config {path}: runs[{i}] needs recipe (or autotune) and modes (unknown keys: {sorted(unknown)})",
                fix="write runs entries like {recipe: xnnpack_int8_dynamic, modes: [ptq, qat]} or "
                "{autotune: {max_size_mb: 1.6}, modes: [ptq]}",
            )
        if "mode" in run and "modes" in run:
            raise UserError(
                f"sweep config {path}: runs[{i}] has both mode and modes (one of them would be ignored)",
                fix=f"keep one: modes: {_modes_together(run)}",
            )
        if "name" in run:
            check_name(run["name"], f"sweep config {path}: runs[{i}].name", "int8_distill")
        if "autotune" in run:
            _check_autotune(run["autotune"], f"sweep config {path}: runs[{i}].autotune")
            run.setdefault("recipe", "xnnpack_8da4w")
    return spec


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


def depends_on(run: SweepRun, earlier: SweepRun) -> bool:
    """Whether ``run``'s config names a path inside ``earlier``'s run directory (a recipe file it wrote, a teacher it
    trained), so that ``run`` must wait for it when runs go in parallel. A run does not depend on itself."""
    where = earlier.run_dir.resolve()
    if where == run.run_dir.resolve():
        return False

    def names(value) -> bool:
        if isinstance(value, dict):
            return any(names(v) for v in value.values())
        if isinstance(value, list | tuple):
            return any(names(v) for v in value)
        return isinstance(value, str) and bool(value) and Path(value).resolve().is_relative_to(where)

    return names(run.config) or names(run.recipe)


def _check_autotune(value, where: str) -> None:
    from qharness.evaluation.autotune import check_budget

    if not isinstance(value, dict):
        raise UserError(f"{where} must be a mapping (got {value!r})", fix="e.g. autotune: {max_size_mb: 1.6}")
    unknown = sorted(set(value) - AUTOTUNE_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown keys {unknown}", fix=f"use {', '.join(sorted(AUTOTUNE_KEYS))}")
    try:
        check_budget(value.get("max_size_mb"))
    except UserError as e:
        raise UserError(f"{where}.max_size_mb: {e.what}", fix="e.g. autotune: {max_size_mb: 1.6}") from None


def plan(spec: dict) -> list[SweepRun]:
    """The runs of a sweep, baseline first; each config is the shared one, the run's own, then recipe/mode/run dir."""
    from qharness.recipes.registry import load_recipe

    sweep_dir = Path(spec["sweep_dir"])
    entries = ([{"recipe": spec["baseline"], "modes": ["ptq"]}] if spec.get("baseline") else []) + spec["runs"]
    runs, names = [], set()
    for entry in entries:
        modes = entry.get("modes", [entry["mode"]] if "mode" in entry else None)
        if not modes or not isinstance(modes, list):
            raise UserError(f"sweep run {entry['recipe']} names no modes", fix="add modes: [ptq, qat] (or mode: ptq)")
        recipe = load_recipe(entry["recipe"])
        for mode in modes:
            if mode not in SUBCOMMAND:
                raise UserError(f"sweep run {entry['recipe']}: unknown mode {mode!r}", fix="use ptq or qat")
            recipe.check_mode(mode)
            tune = entry.get("autotune")
            default_name = f"autotune_{tune['max_size_mb']:g}mb" if tune else Path(entry["recipe"]).stem
            name = check_name(
                f"{entry.get('name') or default_name}-{mode}", f"sweep run {entry['recipe']}: run name", "int8_distill"
            )
            if name in names:
                baseline = runs[0] if runs else None
                if (
                    baseline is not None
                    and name == baseline.name
                    and not entry.get("config")
                    and _same_recipe(entry["recipe"], baseline.recipe)
                ):
                    continue  # the baseline listed again among the runs
                raise UserError(
                    f"sweep runs: two runs would be named {name} (same run directory)",
                    fix="give one of them a name: e.g. {recipe: ..., name: my_variant, config: {...}}",
                )
            names.add(name)
            run_dir = sweep_dir / name
            check_inside(name, sweep_dir, f"sweep run {name}: its run directory", "remove what links it elsewhere")
            config = deep_merge(spec["config"], _mapping(entry.get("config"), f"sweep run {name}: config"))
            config = deep_merge(
                config,
                {"model": {"recipe": entry["recipe"], "mode": mode}, "trainer": {"default_root_dir": str(run_dir)}},
            )
            config.setdefault("wandb", {}).setdefault("group", sweep_dir.name)
            # lm-eval: the FP model once (the baseline run), then each run's trained fake-quant model (QAT) and
            # .pte; the converted model, which would stand in for PTQ's fake-quant, matches the .pte (parity gate)
            config.setdefault("eval", {}).setdefault(
                "models", (["fp"] if not runs else ["fake_quant"] if mode == "qat" else []) + ["pte"]
            )
            if runs:  # the eager FP model is the same in every run: benchmarked once, in the first (baseline) run
                config.setdefault("bench", {}).setdefault("eager", False)
            if tune:  # autotune's options are top-level keys of its run config
                config.update(tune)
            runs.append(SweepRun(name, entry["recipe"], mode, config, run_dir, autotune=bool(tune)))
    check_report_metric(spec["report"].get("metric", "ppl"), runs)
    return runs


def check_report_metric(metric, runs: list[SweepRun]) -> None:
    """``report.metric`` against what the runs will record (their lm-eval tasks), before any run starts: a metric no
    run has would otherwise be found only by the report, after all runs."""
    from qharness.config import EvalConfig
    from qharness.reporting.report import check_metric

    default = EvalConfig()
    tasks = {}
    for run in runs:
        section = run.config.get("eval") if isinstance(run.config.get("eval"), dict) else {}
        if section.get("enabled", default.enabled):
            given = section.get("tasks", default.tasks)
            tasks |= dict.fromkeys(given if isinstance(given, list) else [given])
    check_metric(metric, [str(t) for t in tasks], "sweep config: report.metric")


def _same_recipe(a: str, b: str) -> bool:
    """Whether two recipe names of a sweep config name the same recipe (a name, or a path to its YAML)."""
    from qharness.recipes.registry import load_recipe

    return a == b or load_recipe(a) == load_recipe(b)


def _status(run: SweepRun) -> dict | None:
    """The run's ``sweep_status.json`` if it was written for this very config (same digest), else None."""
    try:
        status = json.loads((run.run_dir / STATUS).read_text())
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) and status.get("config_sha256") == run.digest() else None


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


def child_env(threads: int | None = None) -> dict:
    """The environment of a run's process: it imports this same qharness (not an installed copy). ``threads``: its
    torch and ExecuTorch thread counts (``OMP_NUM_THREADS``, ``QHARNESS_THREADS``) where the environment sets none."""
    paths = [
        str(Path(__file__).resolve().parents[2]),
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    # a run that fills the disk tells the user to move the sweep_dir (the runs' root dirs are made from it)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", QHARNESS_OUTPUT_FIELD="sweep_dir")
    if threads is not None:
        for name in ("OMP_NUM_THREADS", "QHARNESS_THREADS"):
            env.setdefault(name, str(threads))
    return env


def run_logged(cmd: list[str], log_path: Path, echo: bool = True, threads: int | None = None) -> int:
    """Run ``cmd``, its output in ``log_path`` and (``echo``) on this console; return its exit code. On a terminal the
    child gets a pseudo-terminal of the same size, so Lightning's progress bars stay live. ``threads``: ``child_env``'s."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    out = sys.stdout.buffer
    with open(log_path, "wb") as log:
        if echo and sys.stdout.isatty() and os.name == "posix":
            import fcntl
            import pty
            import termios

            master, slave = pty.openpty()
            try:
                fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(sys.stdout.fileno(), termios.TIOCGWINSZ, b"\0" * 8))
            except OSError:
                pass
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=slave,
                stderr=slave,
                env=child_env(threads),
                close_fds=True,
                preexec_fn=process.die_with_parent(),
            )
            os.close(slave)
            while True:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out.write(chunk)
                out.flush()
                log.write(chunk)
            os.close(master)
        else:  # without echo the child writes into the log itself
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if echo else log,
                stderr=subprocess.STDOUT,
                env=child_env(threads),
                preexec_fn=process.die_with_parent(),
            )
            for chunk in iter(lambda: proc.stdout.read1(65536), b"") if echo else ():
                out.write(chunk)
                out.flush()
                log.write(chunk)
        return proc.wait()


def resolve_shared_model(runs: list[SweepRun]) -> None:
    """Pretrain (or find in the cache) the embedded default once, before the runs that use it."""
    if any(r.config.get("model", {}).get("checkpoint", "embedded") == "embedded" for r in runs):
        from qharness.sources.models import resolve_checkpoint

        print(f"[sweep] shared FP model: {resolve_checkpoint('embedded')}", flush=True)


Runner = Callable[[list[str], Path], int]


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


def bench_joint(sweep_dir: Path, records: list[dict], processes: int, bench: dict | None = None) -> dict | None:
    """Time the ``.pte`` of every finished run that passed its parity gate jointly (round-robin fresh processes,
    ``processes`` each), with the sweep's bench lengths (``bench``: the shared config's ``bench`` section; the runs'
    own benchmark may be off, ``bench.enabled: false``); add ``bench_joint`` to each run's summary.json and write
    ``<sweep_dir>/bench_joint.json``."""
    from qharness.config import BenchConfig
    from qharness.run.summary import RunSummary
    from qharness.runtime.bench import bench_jointly, joint_entry

    ptes, summaries = {}, {}
    for r in records:
        path = Path(r["run_dir"]) / "summary.json"
        if r["state"] == "failed" or not path.is_file():
            continue
        summary = RunSummary.read(path)
        pte = summary.pte_file(r["run_dir"])
        if summary.passed and pte.suffix == ".pte" and pte.is_file():  # ran here and passed the gate
            ptes[r["name"]], summaries[r["name"]] = pte, (path, summary)
    if not ptes or processes == 0:
        return None
    defaults = BenchConfig()
    b = {"prompt_len": defaults.prompt_len, "decode_tokens": defaults.decode_tokens, "reps": defaults.reps}
    b.update({k: v for k, v in (bench or {}).items() if k in b})  # the same lengths in every run of a sweep
    print(f"[sweep] timing {len(ptes)} programs jointly: {processes} fresh processes each, round-robin", flush=True)
    joint = bench_jointly(
        list(ptes.values()),
        b["prompt_len"],
        b["decode_tokens"],
        max(10, b["reps"]),
        processes,
        names=list(ptes),
        log=lambda line: print(line, flush=True),
    )
    for name, (path, _) in summaries.items():
        RunSummary.update(path, bench_joint=joint_entry(joint, name))
    write_json_atomic(sweep_dir / "bench_joint.json", joint)
    return joint


def run_sweep(
    config_path: str | Path,
    force: bool = False,
    runner: Runner = run_logged,
    report: bool = True,
    jobs: int | None = None,
) -> dict:
    """Run every run of the sweep not yet done (all with ``force``), record each, then write the report. ``jobs``:
    runs at a time (default: the config's ``jobs``, else 1).

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
    say = threading.Lock()  # one console line at a time from parallel runs

    def base_record(run: SweepRun) -> dict:
        return {
            "name": run.name,
            "recipe": run.recipe,
            "mode": run.mode,
            "run_dir": str(run.run_dir),
            "command": f"qharness {run.subcommand} {run.config_path}",
        }

    def execute(i: int) -> None:
        run = runs[i]
        record = base_record(run)
        cmd = process.python_command("-m", "qharness", run.subcommand, "--config", str(run.config_path))
        resume = not force and resumable(run)
        if resume:
            cmd += ["--ckpt_path", "last"]
            record["command"] += " --ckpt_path last"
        for stale in ("summary.json", STATUS):  # a result of another config must not show up as this run's
            (run.run_dir / stale).unlink(missing_ok=True)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        header = (
            f"# {record['command']}  (written by qharness sweep {config_path}; edit the sweep config, not this file)\n"
        )
        write_bytes_atomic(run.config_path, (header + yaml.safe_dump(run.config, sort_keys=False)).encode())
        # started with this config: a kill from here on leaves a run that the next sweep resumes (``resumable``)
        write_json_atomic(
            run.run_dir / STATUS, {"config_sha256": run.digest(), "returncode": None, "command": record["command"]}
        )
        how = "resuming from its last checkpoint: " if resume else ""
        with say:
            print(
                f"[sweep {i + 1}/{len(runs)}] {run.name}: {how}{record['command']} (log: {run.run_dir / 'sweep.log'})",
                flush=True,
            )
        t = time.perf_counter()
        code = runner(cmd, run.run_dir / "sweep.log")
        wall = time.perf_counter() - t
        write_json_atomic(
            run.run_dir / STATUS,
            {"config_sha256": run.digest(), "returncode": code, "wall_s": wall, "command": record["command"]},
        )
        state = "done" if code == 0 else "failed"
        records[i] = {**record, "state": state, "returncode": code, "wall_s": wall}
        outcome = "done" if code == 0 else f"FAILED (exit {code}), see {run.run_dir / 'sweep.log'}"
        with say:
            print(f"[sweep {i + 1}/{len(runs)}] {run.name}: {outcome} in {format_seconds(wall)}", flush=True)

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
    failed = [r for r in records if r["state"] == "failed"]
    write_json_atomic(sweep_dir / "sweep.json", {"config": str(config_path), "runs": records})
    rep = spec["report"]
    result = {"runs": records, "report": None, "bench_joint": None}
    try:
        result["bench_joint"] = bench_joint(
            sweep_dir, records, rep.get("bench_processes", 5), _mapping(spec["config"].get("bench"), "config.bench")
        )
    except (UserError, RuntimeError) as e:  # the runs and their own benchmarks stand; the report still follows
        print(f"[sweep] no joint benchmark: {e}", flush=True)
    if report:
        from qharness.reporting.report import write_report

        notes = [
            f"Failed run: {r['name']} (exit {r['returncode']}); log {r['run_dir']}/sweep.log; rerun: {r['command']}"
            for r in failed
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
    result["wall_s"] = time.perf_counter() - t0
    return result
