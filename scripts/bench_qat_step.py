"""QAT training step against the eager FP training step of the same model: the ratio, with its spread over fresh
processes.

One training step = forward, the token loss, backward and AdamW (``training/optim.py``'s optimizer), on one fixed
batch of ``--batch`` x ``--seq_len`` tokens (seeded random ids: a step's time depends on shapes, not on values).
Programs, each in its own fresh process (``python -P``):

- ``fp``: the eager FP model (``LogitsOnly``, as loaded) in ``train()`` mode;
- ``qat:<recipe>``: the QAT model of ``<recipe>`` built by ``QuantLM.build`` (what ``qharness fit`` trains), switched
  to training as ``fit`` switches it (``QuantLM.to_train``); with ``--lightning``, the steps run inside
  ``Trainer.fit`` with qharness's trainer defaults (``deterministic: true``) and a timing callback;
- with ``--upstream``, also ``qat-upstream:<recipe>``: the same under ``QHARNESS_UPSTREAM_QAT=1`` (torchao's own fake
  quantizers, without ``upstream/qat_speed.py``), in the same rounds.

Each process runs ``--warmup`` untimed steps, then ``--steps`` timed ones, and reports their median wall time and the
median process CPU time per step (CPU time / wall time below the thread count: the process waited for a core); with
``--ops``, also the top-level ATen calls of one more step (PyTorch's profiler; an op another op calls is not
counted): what an eager GPU run issues one by one from the host, so they bound a GPU step from below. Rounds
alternate (fp, qat, qat, fp, ...: ``runtime/joint.round_order``); each round's ratio is QAT median / FP median of
that round, and the ratios' median (min-max) over the rounds is the result. A ratio whose spread straddles the
target is a tie ("TIE/UNDECIDED"), not a verdict. The machine may be shared: the 1-minute load average is printed
with every process.

    .venv/bin/python scripts/bench_qat_step.py                                  # the embedded default model
    .venv/bin/python scripts/bench_qat_step.py --model /work/models/smollm2-hf --rounds 3
    .venv/bin/python scripts/bench_qat_step.py --model DIR --recipe xnnpack_int8_dynamic --recipe xnnpack_8da4w
    .venv/bin/python scripts/bench_qat_step.py --rounds 1 --ops                     # ATen calls per step too
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 3.0  # QAT step <= 3x the eager FP step


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child(args) -> dict:
    """One program in this process: ``{"wall_s", "cpu_s", "steps_wall_s", "threads", "peak_rss_gb", ...}``."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from qharness.training.losses import token_loss
    from qharness.training.optim import adamw_with_schedule
    from qharness.training.prepare import LogitsOnly

    t0 = time.perf_counter()
    program = args.child
    total = args.warmup + args.steps
    if program == "fp":
        from qharness.sources.models import load_model_and_tokenizer, resolve_checkpoint

        model, _ = load_model_and_tokenizer(resolve_checkpoint(args.model))
        graph, module = LogitsOnly(model).train(), None
    else:
        from qharness.training.module import QuantLM

        module = QuantLM(checkpoint=args.model, recipe=program.split(":", 1)[1], mode="qat")
        if not args.lightning:
            module.build(args.batch, args.seq_len)
            module.to_train()
        graph = module.graph
    from transformers import AutoConfig

    from qharness.sources.models import resolve_checkpoint

    vocab = AutoConfig.from_pretrained(resolve_checkpoint(args.model)).get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
    y = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen)
    build_s = time.perf_counter() - t0
    walls, cpus, calls = [], [], None
    if args.lightning and module is not None:
        walls, cpus = _lightning_steps(module, x, y, total)
    else:
        opt = adamw_with_schedule(graph, 1e-5, 0.0, 0, 0.1, total + 1)["optimizer"]

        def step():
            loss = token_loss(graph(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        for _ in range(total):
            w, c = time.perf_counter(), time.process_time()
            step()
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
        calls = _aten_calls(step) if args.ops else None
    walls, cpus = walls[args.warmup :], cpus[args.warmup :]
    return {
        "aten_calls": calls,
        "program": program,
        "wall_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
        "steps_wall_s": walls,
        "build_s": build_s,
        "threads": torch.get_num_threads(),
        "peak_rss_gb": _peak_rss_gb(),
    }


def _aten_calls(step) -> int:
    """The top-level ATen calls of one ``step()`` (an op that another op calls is not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()

    def top(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in prof.events() if e.name.startswith("aten::") and top(e))


def _lightning_steps(module, x, y, total: int) -> tuple[list[float], list[float]]:
    """``total`` steps of ``Trainer.fit`` on the batch ``(x, y)`` (qharness's trainer defaults that matter for speed:
    deterministic), timed from batch start to batch end."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    batch = x.shape[0]

    class Data(L.LightningDataModule):
        batch_size, seq_len = batch, x.shape[1]

        def train_dataloader(self):
            return DataLoader(TensorDataset(x.repeat(total, 1), y.repeat(total, 1)), batch_size=batch)

    walls, cpus = [], []

    class Timer(L.Callback):
        def on_train_batch_start(self, *args):
            self.t = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, *args):
            walls.append(time.perf_counter() - self.t[0])
            cpus.append(time.process_time() - self.t[1])

    trainer = L.Trainer(
        max_steps=total,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Timer()],
    )
    torch.manual_seed(0)
    trainer.fit(module, datamodule=Data())
    return walls, cpus


def run_fresh(args, program: str) -> dict:
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--child", program, "--model", args.model]
    cmd += ["--batch", str(args.batch), "--seq_len", str(args.seq_len), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.lightning:
        cmd += ["--lightning"]
    if args.ops:
        cmd += ["--ops"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if program.startswith("qat-upstream:"):
        env["QHARNESS_UPSTREAM_QAT"] = "1"
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode != 0 or not lines:
        sys.stderr.write(r.stderr[-4000:])
        raise SystemExit(f"{program}: the child process failed (exit {r.returncode})")
    return json.loads(lines[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded", help="an HF model directory (default: the embedded default model)")
    p.add_argument("--recipe", action="append", help="QAT recipe(s) (default: xnnpack_8da4w)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (allocator, first-call work)")
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per program, in alternating rounds")
    p.add_argument("--threads", type=int, default=None, help="torch threads in every process (default: torch's)")
    p.add_argument("--lightning", action="store_true", help="QAT steps inside Trainer.fit (what `qharness fit` runs)")
    p.add_argument("--upstream", action="store_true", help="also each recipe with torchao's own fake quantizers")
    p.add_argument(
        "--ops", action="store_true", help="also count one more step's top-level ATen calls (not --lightning)"
    )
    p.add_argument("--json", default=None, help="also write every process's numbers here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return

    from qharness.runtime.joint import round_order
    from qharness.runtime.spread import format_spread, pair_ratios, spread, verdict

    recipes = args.recipe or ["xnnpack_8da4w"]
    kinds = ("qat", "qat-upstream") if args.upstream else ("qat",)
    programs = ["fp", *(f"{kind}:{r}" for r in recipes for kind in kinds)]
    runs: dict[str, list[dict]] = {name: [] for name in programs}
    print(
        f"model {args.model}, batch {args.batch} x {args.seq_len}, {args.steps} timed steps (+{args.warmup} warm-up) "
        f"per process, {args.rounds} rounds, threads {args.threads or 'default'}"
        f"{', QAT through Trainer.fit' if args.lightning else ''}",
        flush=True,
    )
    for k in range(args.rounds):
        for name in round_order(programs, k):
            load = os.getloadavg()[0]
            r = run_fresh(args, name)
            runs[name].append(r)
            steps = " ".join(f"{s:.2f}" for s in r["steps_wall_s"])
            calls = f", {r['aten_calls']} ATen calls" if r.get("aten_calls") is not None else ""
            print(
                f"  round {k + 1} {name:>28}: {r['wall_s']:7.2f} s/step (steps {steps}; cpu {r['cpu_s']:.2f} s, "
                f"{r['threads']} threads, peak RSS {r['peak_rss_gb']:.2f} GiB, load {load:.1f}{calls})",
                flush=True,
            )
    fp_wall = [r["wall_s"] for r in runs["fp"]]
    fp_cpu = [r["cpu_s"] for r in runs["fp"]]
    print(f"fp step: {format_spread(spread(fp_wall))} s (cpu {format_spread(spread(fp_cpu))} s)")
    for name in programs[1:]:
        wall = [r["wall_s"] for r in runs[name]]
        ratio = pair_ratios(wall, fp_wall)
        cpu_ratio = pair_ratios([r["cpu_s"] for r in runs[name]], fp_cpu)
        print(f"{name} step: {format_spread(spread(wall))} s")
        print(
            f"{name} / fp: {format_spread(ratio)} (cpu time: {format_spread(cpu_ratio)}); "
            f"target <= {TARGET:g}x: {verdict(ratio, TARGET, higher_is_better=False)}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
