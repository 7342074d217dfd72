"""SIGKILL of the real CLI inside every stage, then the same command again ("kills everywhere").

Each kill lands at a point chosen from the process's own output: the stage's start line (``[qharness] <stage> ...``)
or, for training, a periodic checkpoint on disk, plus a seeded random delay that is shorter than the stage, and
the kill only counts when the stage's end line had not yet been printed. After each kill: the next command (with
``--ckpt_path last`` once a checkpoint exists, as the README says for a killed run) goes on; no ``model.pte`` or
``summary.json`` says more than was done by then; at most one checkpoint interval of training is lost; a sweep
re-run skips exactly the runs that had finished (their files untouched) and resumes a killed QAT run.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, write_config

pytestmark = pytest.mark.slow

RNG = random.Random(23)  # the delays within each stage: random, and the same on every run of the test


class Killed:
    """The output of a command killed inside a stage."""

    def __init__(self, output: str, pid: int, children: list[int]):
        self.output, self.pid, self.children = output, pid, children


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _start(args):
    proc = subprocess.Popen(
        [sys.executable, "-m", "qharness", *map(str, args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"},
        start_new_session=True,  # its own process group: what it leaves running is ended after the test's checks
    )
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(65536), b"")), daemon=True)
    reader.start()
    return proc, chunks, reader


def _text(chunks) -> str:
    return b"".join(chunks).decode(errors="replace").replace("\r", "\n")


def kill_inside(args, start, end: str | None, max_delay: float, timeout: float = 600) -> Killed:
    """Run ``qharness ARGS``; once ``start`` (a line of its output, or a callable of the output so far that says the
    stage runs) is seen, wait a seeded random delay below ``max_delay`` and SIGKILL the process, which must not have
    printed ``end`` (the stage's end line) by then: the kill landed inside the stage."""
    proc, chunks, reader = _start(args)
    seen = (lambda: start(_text(chunks))) if callable(start) else lambda: start in _text(chunks)
    deadline = time.time() + timeout
    while not seen():
        assert proc.poll() is None, f"qharness {args[0]} ended before {start!r}:\n{_text(chunks)[-3000:]}"
        assert time.time() < deadline, f"no {start!r} within {timeout}s"
        time.sleep(0.02)
    time.sleep(RNG.uniform(0, max_delay))
    children = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join(timeout=10)
    out = _text(chunks)
    assert end is None or end not in out, f"the kill came after the stage ended ({end!r}); shorten its delay"
    return Killed(out, proc.pid, children)


def run(args, timeout: float = 600) -> tuple[int, str]:
    proc, chunks, reader = _start(args)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        _end_group(proc.pid)
    reader.join(timeout=10)
    return code, _text(chunks)


def _end_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)  # a benchmark process the kill orphaned: not the test's business
    except ProcessLookupError:
        pass


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def step_of(ckpt: Path) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]


def temporaries(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if ".tmp" in p.name)


def check_claims(run_dir: Path, done: set[str]) -> dict | None:
    """What the run directory claims against ``done`` (the stages finished before the kill): ``model.pte`` only
    once the gate passed, and then the summary describes that very file; ``summary.json`` says bench/eval only
    once they were done."""
    pte, summary_path = run_dir / "model.pte", run_dir / "summary.json"
    assert pte.exists() == ("gate" in done), sorted(p.name for p in run_dir.iterdir())
    if not summary_path.exists():
        assert "gate" not in done or "summary" not in done
        return None
    summary = json.loads(summary_path.read_text())
    assert summary["parity"]["passed"] is True and "gate" in done
    assert summary["pte"]["sha256"] == sha(pte) and Path(summary["pte"]["path"]) == pte
    assert (summary["bench"] is not None) == ("bench" in done)
    assert (summary["eval"] is not None) == ("eval" in done)
    assert (run_dir / "eval.json").exists() == ("eval" in done)
    return summary


def test_fit_killed_in_every_stage_finishes_and_never_claims_more(tmp_path, tiny_llama, corpus, monkeypatch):
    t0 = time.time()
    # a cache of its own: the session's is shared with the other worker, whose builds may be half-way at the end
    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    steps, every = 12, 3
    # a text of its own: the shared corpus's tokens may already be cached by an earlier test in this process, and a
    # cached read ends before any kill can land inside it
    own = tmp_path / "corpus.txt"
    own.write_text(corpus.read_text(encoding="utf-8") + f"\n\n{tmp_path.name}\n", encoding="utf-8")
    corpus = own
    cfg = write_config(
        tmp_path / "fit.yaml",
        tiny_llama,
        corpus,
        run_dir,
        trainer={
            "max_steps": steps,
            "val_check_interval": steps,
            # a bar that prints every step (Rich prints nothing until the end when it has no terminal)
            "callbacks": [{"class_path": "lightning.pytorch.callbacks.TQDMProgressBar"}],
        },
        checkpoint={"every_n_train_steps": every},
        bench={"enabled": True, "reps": 1, "eager": False},
        eval={"enabled": True, "tasks": ["qharness_ppl"], "limit": 4, "models": ["fake_quant", "pte"]},
    )
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    fit = ["fit", cfg]
    resume = ["fit", cfg, "--ckpt_path", "last"]
    log = []

    # data prep: nothing is written yet, and the same command starts over
    k = kill_inside(
        fit, "reading and tokenizing data.source", "reading and tokenizing data.source " + str(corpus) + ": done", 0.0
    )
    assert not ckpt.exists() and check_claims(run_dir, set()) is None
    log.append("data prep")

    # training: killed at a random step after the first periodic checkpoint, at least one checkpoint before the end
    # (a step count, not a delay: an idle machine trains these 12 steps in about a second)
    target = RNG.randint(every + 1, steps - every - 1)
    k = kill_inside(fit, lambda out: ckpt.exists() and max(map(int, _steps_shown(out, steps)), default=0) >= target,
                    "Trainer.fit` stopped", 0.0)  # fmt: skip
    saved = step_of(ckpt)
    shown = max((int(n) for n in _steps_shown(k.output, steps)), default=0)
    assert 0 < saved < steps and saved % every == 0
    assert shown - saved <= every, f"step {shown} was trained, the checkpoint holds step {saved}"
    check_claims(run_dir, set())
    log.append(f"training (step {shown} shown, checkpoint at {saved})")

    # the rest, each killed in turn; every re-run resumes from last.ckpt (training is finished: straight to export)
    stages = [  # (start line, end line, max delay, stages finished before it, what must exist)
        ("static-KV-cache export + quantization", "calibrating the observers", 0.3, set()),
        ("calibrating the observers", "calibrating the observers on 4 blocks: done", 0.0, set()),
        ("lowering to ExecuTorch", "lowering to ExecuTorch (xnnpack_int8_dynamic, xnnpack): done", 4.0, set()),
        ("scoring the .pte", "parity PASSED", 0.0, set()),
        ("benchmarking the .pte", "fresh process): done", 2.0, {"gate", "summary"}),
        ("lm-eval: .pte", "-token window)", 0.3, {"gate", "summary", "bench"}),
    ]
    for start, end, delay, done in stages:
        k = kill_inside(resume, start, end, delay)
        assert f"Restoring states from the checkpoint path at {ckpt}" in k.output, k.output[-2000:]
        check_claims(run_dir, done)
        if start == "scoring the .pte":  # the program exists only under the gate-pending name until the gate passed
            assert (run_dir / "model.pending.pte").is_file() and not (run_dir / "model.pte").exists()
        if start == "benchmarking the .pte":  # its fresh benchmark process ends with it, not seconds later
            assert k.children, "no benchmark process was running"
            _wait_gone(k.children, timeout=3)
        _end_group(k.pid)
        log.append(start)
    assert step_of(ckpt) == steps  # every deploy attempt started from the finished training

    # a write killed half-way leaves a temporary as SIGKILL does; the next command on the directory removes it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = run_dir / f".model.pte.{dead.stdout.strip()}.abcd_123.tmp"
    stale.write_bytes(b"\0" * 4096)
    code, out = run(resume)
    assert code == 0, out[-3000:]
    summary = check_claims(run_dir, {"gate", "summary", "bench", "eval"})
    assert summary["eval"]["tasks"]["qharness_ppl"] and "parity PASSED" in out
    assert not (run_dir / "model.pending.pte").exists() and temporaries(run_dir) == []
    assert step_of(ckpt) == steps
    assert temporaries(Path(os.environ["QHARNESS_CACHE"])) == []  # nothing left in the cache either

    # a re-export of the finished run, killed once its new program is being checked: the checked program and its
    # summary stay as they were, side by side; the unchecked one has the gate-pending name
    before = {name: sha(run_dir / name) for name in ("model.pte", "summary.json")}
    kill_inside(["export", cfg], "scoring the .pte", "parity PASSED", 0.0)
    assert {name: sha(run_dir / name) for name in before} == before and (run_dir / "model.pending.pte").is_file()
    check_claims(run_dir, {"gate", "summary", "bench", "eval"})
    log.append("re-export (parity)")
    print(f"fit killed in: {', '.join(log)}; finished in {time.time() - t0:.0f}s")


def _steps_shown(output: str, total: int):
    import re

    return re.findall(rf"(\d+)/{total} \[", output)


@pytest.mark.fast
def test_sweep_killed_between_runs_in_training_and_in_the_report(tmp_path, tiny_llama, corpus):
    t0 = time.time()
    sweep_dir = tmp_path / "sweep"
    shared = yaml.safe_load(write_config(tmp_path / "shared.yaml", tiny_llama, corpus, tmp_path / "unused").read_text())
    del shared["trainer"]["default_root_dir"]
    shared["trainer"].update(max_steps=12, val_check_interval=12)
    shared["bench"].update(enabled=True, reps=1)
    config = tmp_path / "sweep.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "sweep_dir": str(sweep_dir),
                "baseline": None,
                "runs": [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq", "qat"]}],
                "config": shared,
                "report": {"bench_processes": 0, "wandb": False},
            }
        )
    )
    ptq, qat = sweep_dir / "xnnpack_int8_dynamic-ptq", sweep_dir / "xnnpack_int8_dynamic-qat"
    sweep = ["sweep", config]

    # between runs: the first has finished, the second is just starting
    k = kill_inside(
        sweep, "[sweep 1/2] xnnpack_int8_dynamic-ptq: done", "[sweep 2/2] xnnpack_int8_dynamic-qat: done", 0.0
    )
    _wait_gone(k.children)
    finished = {p.name: sha(p) for p in ptq.iterdir() if p.is_file() and p.name != ".qharness.lock"}
    mtimes = {p.name: p.stat().st_mtime_ns for p in ptq.iterdir() if p.is_file()}
    assert {"model.pte", "summary.json", "sweep_status.json"} <= set(finished)

    # in the second run's training: the sweep dies, its run is stopped (SIGTERM, so it saves its checkpoint)
    ckpt = qat / "checkpoints" / "last.ckpt"
    # at once: on an idle machine the 12 tiny steps finish within a second of the first checkpoint
    k = kill_inside(sweep, lambda out: ckpt.exists(), "[sweep 2/2] xnnpack_int8_dynamic-qat: done", 0.0)
    assert "1 already finished" in k.output and "xnnpack_int8_dynamic-ptq: finished earlier" in k.output
    assert k.children, "the sweep had no run going"
    _wait_gone(k.children)  # the run ended with the sweep, not left training in the background
    saved = step_of(ckpt)
    assert 0 < saved < 12 and not (qat / "model.pte").exists() and not (qat / "summary.json").exists()

    # in the report: both runs finished; the re-run resumed the QAT run from its checkpoint and skipped the PTQ one
    k = kill_inside(sweep, "[sweep] writing the report", "sweep: 2/2 runs finished", 1.0)
    assert "xnnpack_int8_dynamic-qat: resuming from its last checkpoint" in k.output, k.output[-3000:]
    assert "--ckpt_path last" in k.output and "xnnpack_int8_dynamic-ptq: finished earlier" in k.output
    assert "Restoring states from the checkpoint path" in (qat / "sweep.log").read_text()
    assert step_of(ckpt) == 12
    for name in ("report.json", "report.md", "report.csv"):  # absent or whole, never half-written
        if (sweep_dir / name).exists() and name == "report.json":
            json.loads((sweep_dir / name).read_text())

    code, out = run(sweep)
    assert code == 0, out[-3000:]
    assert "2 already finished" in out and out.count("finished earlier with the same config, skipped") == 2
    assert {p.name: sha(p) for p in ptq.iterdir() if p.is_file() and p.name in finished} == finished
    assert {p.name: p.stat().st_mtime_ns for p in ptq.iterdir() if p.name in mtimes and p.is_file()} == mtimes
    report = json.loads((sweep_dir / "report.json").read_text())
    assert len(report["rows"]) == 2
    for run_dir in (ptq, qat):
        check_claims(run_dir, {"gate", "summary", "bench"})
        assert temporaries(run_dir) == []
    assert temporaries(sweep_dir) == []
    print(f"sweep killed between runs, in training (checkpoint at {saved}) and in the report; {time.time() - t0:.0f}s")


def _wait_gone(pids: list[int], timeout: float = 120) -> None:
    deadline = time.time() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and _state(pid) != "Z":
            assert time.time() < deadline, f"process {pid} outlived the killed command"
            time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
