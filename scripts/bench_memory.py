"""Memory per parameter of QAT: DDP vs FSDP per decoder layer, with and without activation checkpointing;
and LoRA-QAT against full QAT (``--modes ddp,ddp_lora``).

Each mode runs in its own fresh processes (``--procs`` of them, gloo on CPU, NCCL on CUDA), on a random-init model of
a real shape (default SmolLM2-135M's), through qharness's own pieces: the recipe's QAT graph
(``prepare_for_training``; ``layerwise`` for the FSDP modes), ``training.sharding.shard`` (FSDP2, one unit per
decoder layer) or ``DistributedDataParallel``, AdamW, ``--steps`` optimizer steps on random tokens (optionally under
bf16 autocast, as ``trainer.precision: bf16-mixed``). Per process it measures:

- ``steady``: peak memory during the steps minus the memory before the model was built: weights + gradients +
  optimizer state + activations + communication buffers. CUDA: ``torch.cuda.max_memory_allocated`` (reset after
  set-up); CPU: peak RSS sampled every 2 ms during the steps.
- ``setup``: peak during building (every process exports the whole model before sharding it).

``*_lora`` modes train ``model.lora`` adapters (``--lora_rank``, alpha 2 x rank, the default targets) on the frozen
base instead of every weight; ``params`` still counts the whole model, so B/param compares directly with full QAT.

It prints bytes per parameter (``steady / parameters``; parameters counted once, tied weights once), the spread over
``--repeats`` fresh runs of each mode (modes interleaved), and seconds per step.

Usage::

    python scripts/bench_memory.py --procs 2 --repeats 2                       # CPU, 135M shape
    python scripts/bench_memory.py --device cuda --procs 1 --precision bf16-mixed  # one GPU
    python scripts/bench_memory.py --procs 1 --repeats 4 --modes ddp,ddp_lora --steps 6  # LoRA-QAT vs full QAT
    python scripts/bench_memory.py --shape 1b --layers 2 --procs 1 --repeats 1 --modes ddp,fsdp_ac  # 1B width, 2 layers
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from scale import SHAPES as REAL_SHAPES  # noqa: E402

SHAPES = {  # HF LlamaConfig fields: SmolLM2-135M's, Llama-3.2-1B's (scripts/scale.py) and a tiny one for tests
    **REAL_SHAPES,
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}
MODES = {  # name: (strategy, activation checkpointing, LoRA adapters instead of full QAT)
    "ddp": ("ddp", False, False),
    "ddp_ac": ("ddp", True, False),
    "fsdp": ("fsdp", False, False),
    "fsdp_ac": ("fsdp", True, False),
    "ddp_lora": ("ddp", False, True),
}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Sampler:
    """Peak RSS of this process while running (a thread reading /proc/self/statm every 2 ms)."""

    def __init__(self):
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss())


def worker(args) -> None:
    """One process of one mode: build, (shard), train ``args.steps`` steps, write its numbers to ``args.out``."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from qharness.recipes.registry import load_recipe
    from qharness.schema.model import LoRA
    from qharness.training import sharding
    from qharness.training.layerwise import set_checkpointing
    from qharness.training.prepare import prepare_for_training
    from qharness.upstream.process import map_large_allocations_separately

    map_large_allocations_separately()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    strategy, ac, lora = MODES[args.mode]
    lora = LoRA(rank=args.lora_rank, alpha=2.0 * args.lora_rank) if lora else None

    def used() -> int:
        return torch.cuda.memory_allocated(device) if cuda else rss()

    def build(shape: str, batch: int, seq: int):
        torch.manual_seed(0)
        fields = {"max_position_embeddings": 4096, **SHAPES[shape]}
        if shape == args.shape and args.layers:  # the shape's width and vocabulary, fewer decoder layers
            fields["num_hidden_layers"] = args.layers
        model = LlamaForCausalLM(LlamaConfig(**fields)).to(device)
        layerwise = strategy == "fsdp" or ac
        return model, prepare_for_training(
            model, load_recipe(args.recipe), batch, seq, is_qat=True, layerwise=layerwise, lora=lora
        )

    build("tiny", 1, 8)  # libraries and caches that export and the quantizer load once are not the model's memory
    base = used()
    setup = Sampler()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model, root = build(args.shape, args.batch, args.seq)
    params = sum(p.numel() for n, p in model.named_parameters() if not n.endswith((".lora_a", ".lora_b")))
    trained = sum(p.numel() for p in root.parameters() if p.requires_grad)
    del model
    if ac:
        set_checkpointing(root, True)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        sharding.shard(root, init_device_mesh(device.type, (world,)))
        train = root
    else:
        train = torch.nn.parallel.DistributedDataParallel(root, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW([p for p in root.parameters() if p.requires_grad], lr=1e-5)
    setup_peak = (torch.cuda.max_memory_allocated(device) if cuda else setup.stop()) - base
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    steady = None if cuda else Sampler()
    gen = torch.Generator().manual_seed(rank)
    times, cpu = [], []
    for _ in range(args.steps):
        x = torch.randint(0, SHAPES[args.shape]["vocab_size"], (args.batch, args.seq + 1), generator=gen).to(device)
        t, c = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
            logits = train(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)  # CPU seconds of all this process's threads: the work, less the waiting
    peak = (torch.cuda.max_memory_allocated(device) if cuda else steady.stop()) - base
    result = dict(
        mode=args.mode,
        rank=rank,
        world=world,
        params=params,
        steady=peak,
        setup=setup_peak,
        trained=trained,
        step_s=statistics.median(times[1:] or times),
        cpu_s=statistics.median(cpu[1:] or cpu),
        loss=float(loss.detach()),
    )
    Path(f"{args.out}.{rank}").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run_mode(args, mode: str, out: Path) -> list[dict]:
    import socket

    with socket.socket() as sock:  # a free port for this mode's process group (the last one's may linger)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(args.procs),
    }
    for r in range(args.procs):
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--out", str(out)]
        cmd += [
            f"--{k}={getattr(args, k)}"
            for k in (
                "shape",
                "layers",
                "recipe",
                "batch",
                "seq",
                "steps",
                "device",
                "precision",
                "lora_rank",
                "threads",
            )
        ]
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"mode {mode} failed (exit codes {codes})")
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(args.procs)]
    for r in results:  # as it comes, so a run cut short still reports what it measured
        print(
            f"  {mode} rank {r['rank']}: steady {r['steady'] / r['params']:.2f} B/param ({r['steady'] / 2**30:.2f} GiB), "
            f"set-up {r['setup'] / 2**30:.2f} GiB, {r['step_s']:.3f} s/step ({r['cpu_s']:.3f} CPU s), "
            f"{r['trained'] / 1e6:.2f}M trained",
            flush=True,
        )
    return results


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="135m", choices=sorted(SHAPES))
    p.add_argument(
        "--layers",
        type=int,
        default=0,
        help="decoder layers (0: the shape's own); fewer layers of a shape too large for this machine, to fit "
        "memory = fixed + per-layer x layers",
    )
    p.add_argument("--recipe", default="xnnpack_int8_dynamic")
    p.add_argument("--modes", default="ddp,fsdp,fsdp_ac", help=f"comma-separated among {', '.join(MODES)}")
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads per process (0: the CPUs / processes); 1 makes CPU time clean",
    )
    p.add_argument("--lora_rank", type=int, default=8, help="adapter rank of the *_lora modes (alpha = 2 x rank)")
    p.add_argument("--json", help="write every run's numbers here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    import tempfile

    print(f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for mode in modes if rep % 2 == 0 else reversed(modes):  # interleaved, order alternating
                runs[mode].append(run_mode(args, mode, Path(tmp) / f"{mode}-{rep}"))
                print(f"repeat {rep + 1}/{args.repeats} {mode}: done", flush=True)
    params = runs[modes[0]][0][0]["params"]
    print(
        f"\n{args.shape} shape{f' with {args.layers} layers' if args.layers else ''} ({params / 1e6:.1f}M parameters), recipe {args.recipe}, {args.procs} process(es) on "
        f"{args.device}, {args.precision}, batch {args.batch} x seq {args.seq} per process, {args.steps} steps; "
        f"mean [min, max] over {args.repeats} fresh runs x {args.procs} processes"
    )
    print(
        f"{'mode':<9} {'steady B/param':>22} {'steady GiB/process':>22} {'set-up GiB/process':>22} {'s/step':>20} "
        f"{'CPU s/step':>20}"
    )
    for mode in modes:
        flat = [r for run in runs[mode] for r in run]
        print(
            f"{mode:<9} {spread([r['steady'] / params for r in flat]):>22} "
            f"{spread([r['steady'] / 2**30 for r in flat]):>22} {spread([r['setup'] / 2**30 for r in flat]):>22} "
            f"{spread([r['step_s'] for r in flat]):>20} {spread([r['cpu_s'] for r in flat]):>20}"
        )
    for mode in modes:  # LoRA-QAT against full QAT of the same strategy, paired by repeat (adjacent fresh runs)
        full = mode[: -len("_lora")] if mode.endswith("_lora") else None
        if full not in runs:
            continue
        for key, what in (("steady", "steady memory"), ("step_s", "step time"), ("cpu_s", "step CPU time")):
            ratios = [
                statistics.mean(r[key] for r in lo) / statistics.mean(r[key] for r in fu)
                for lo, fu in zip(runs[mode], runs[full])
            ]
            print(
                f"{mode} / {full} {what}: median {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}] "
                f"over {len(ratios)} paired repeats ({', '.join(f'{x:.2f}' for x in ratios)})"
            )
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
