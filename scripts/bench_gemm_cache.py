"""XNNPACK's decode GEMMs against the size of the weights they stream: does this CPU's cache hold a program?

A decode step reads every weight once, one token at a time (M = 1), so its speed is the rate at which the 4-bit GEMMs
stream their weights. This script lowers programs of nothing but those GEMMs, a model's seven projections per layer
(q, k, v, o, gate, up, down; ``xnnpack_8da4w``'s numerics: int8 dynamic activations, 4-bit weights in groups of
32, bf16 scales) for N layers of one shape, and times a step of each in fresh processes, in alternating rounds. Per
program: the 4-bit weights' MB, ms a step, µs a layer and the weights' GB/s (weight bytes / step time). Where the
rate falls as the layers grow, the weights no longer stay in this CPU's cache between steps: a decode step of a
program that size streams from memory at the lower rate. Set a real program's size beside it (SmolLM2-135M's
``.pte``: 60 MB of 4-bit projections, a 28 MB 8-bit ``lm_head``, 92 MB) and llama.cpp's decode rate on the same
machine (``bench_llamacpp.py``: the GGUF's MB x decode tok/s) to see which side of the cliff each decodes on.

Programs are built once and kept under ``--cache`` (lowering 48 layers takes a few minutes on 2 cores).

    .venv/bin/python scripts/bench_gemm_cache.py                         # SmolLM2-135M's shapes, 15, 30, 48 layers
    .venv/bin/python scripts/bench_gemm_cache.py --layers 8,16,32,64 --shape 576,192,1536 --rounds 4 --json out.json
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GROUP = 32  # xnnpack_8da4w's group size


def build(layers: int, hidden: int, kv: int, mlp: int):
    """The float module: ``layers`` blocks of the seven projections, chained so that every GEMM's output is used."""
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
            self.q, self.k, self.v, self.o = lin(hidden, hidden), lin(hidden, kv), lin(hidden, kv), lin(hidden, hidden)
            self.gate, self.up, self.down = lin(hidden, mlp), lin(hidden, mlp), lin(mlp, hidden)
            self.repeat = -(-hidden // (2 * kv))  # k and v tiled up to the hidden width (GQA's heads, roughly)

        def forward(self, h):
            kv_ = torch.cat([self.k(h), self.v(h)] * self.repeat, dim=-1)[..., :hidden]
            h = h + self.o(self.q(h) * kv_)
            return h + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))

        def forward(self, h):
            for block in self.blocks:
                h = block(h) * 0.5  # keeps the activations' range level over many blocks
            return h

    torch.manual_seed(0)
    return Stack().eval()


def weight_bytes(layers: int, hidden: int, kv: int, mlp: int) -> int:
    """Bytes a step streams: 4-bit codes plus one bf16 scale per group of 32, over the seven projections."""
    params = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp)
    return params // 2 + params // GROUP * 2


def lower(layers: int, hidden: int, kv: int, mlp: int) -> bytes:
    """The ``.pte`` of ``build``'s module, quantized as ``xnnpack_8da4w`` quantizes linears, lowered to XNNPACK."""
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    from qharness.upstream import imports
    from qharness.upstream.fixes import xnnpack_bf16_scales

    model = build(layers, hidden, kv, mlp)
    granularity = PerGroup(GROUP)
    quantize_(
        model,
        Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4,
            weight_granularity=granularity,
            weight_scale_dtype=xnnpack_bf16_scales.scale_dtype(granularity, torch.int4),
        ),
    )
    with torch.no_grad():
        ep = torch.export.export(model, (torch.randn(1, 1, hidden),))
    edge = imports.to_edge_transform_and_lower(ep, partitioner=[imports.xnnpack_partitioner(dynamic_quant=False)])
    return edge.to_executorch().buffer


def time_program(path: str, hidden: int, threads: int, steps: int, repeats: int) -> float:
    """Median ms of one step of the program at ``path`` (``repeats`` timings of ``steps`` steps, after a warm-up)."""
    import torch

    from qharness.runtime.pte import set_runtime_threads
    from qharness.upstream import imports

    set_runtime_threads(threads)
    program = imports.executorch_runtime().load_program(Path(path).read_bytes())  # the method needs it alive
    method = program.load_method("forward")
    x = torch.randn(1, 1, hidden)
    for _ in range(max(2, steps // 2)):
        method.execute([x])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            method.execute([x])
        times.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(times)


def _fresh(path: Path, args) -> float:
    """``time_program`` of ``path`` in a fresh process (``python -P``, as ``.pte`` benchmark processes run)."""
    from qharness.upstream.process import pte_process_env

    cmd = [sys.executable, "-P", __file__, "--time", str(path), "--shape", ",".join(map(str, args.shape))]
    cmd += ["--threads", str(args.threads), "--steps", str(args.steps), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, env=dict(os.environ, **pte_process_env()), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench_gemm_cache: timing {path} failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
    return float(out.stdout.strip().splitlines()[-1])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="15,30,48", help="comma-separated layer counts, one program each")
    p.add_argument("--shape", default="576,192,1536", help="hidden,kv,mlp widths (default: SmolLM2-135M's)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of one fresh process per program")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=50, help="steps per timing")
    p.add_argument("--repeats", type=int, default=5, help="timings per process (their median is the process's)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "qharness" / "bench_gemm_cache")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--time", help=argparse.SUPPRESS)  # a child process: time this program, print ms a step
    args = p.parse_args(argv)
    try:
        args.layers = [int(n) for n in args.layers.split(",")]
        hidden, kv, mlp = (int(n) for n in args.shape.split(","))
    except ValueError:
        p.error("--layers takes whole numbers (15,30,48) and --shape three (hidden,kv,mlp: 576,192,1536)")
    if min(args.layers) < 1 or min(hidden, kv, mlp) < 1 or args.rounds < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--layers, --shape, --rounds, --steps and --repeats must be at least 1")
    if hidden % GROUP or mlp % GROUP:
        p.error(f"--shape: hidden and mlp widths must be multiples of the group size {GROUP}")
    args.shape = (hidden, kv, mlp)
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    hidden, kv, mlp = args.shape
    if args.time:
        print(time_program(args.time, hidden, args.threads, args.steps, args.repeats))
        return {}
    from qharness.io.atomic import write_bytes_atomic, write_text_atomic
    from qharness.runtime.joint import round_order
    from qharness.runtime.spread import format_spread, median_range

    args.cache.mkdir(parents=True, exist_ok=True)
    paths = {}
    for n in args.layers:
        path = args.cache / f"gemms_{hidden}_{kv}_{mlp}_x{n}.pte"
        if not path.exists():
            print(f"[bench_gemm_cache] lowering {n} layers ...", file=sys.stderr, flush=True)
            write_bytes_atomic(path, lower(n, hidden, kv, mlp))
        paths[n] = path
    times: dict[int, list[float]] = {n: [] for n in args.layers}
    for k in range(args.rounds):
        load = os.getloadavg()[0]
        for n in round_order(args.layers, k):
            times[n].append(_fresh(paths[n], args))
        print(f"[bench_gemm_cache] round {k + 1}/{args.rounds} done (load average before: {load:.2f})", file=sys.stderr)
    rows, cells = [], []
    for n in args.layers:
        mb = weight_bytes(n, hidden, kv, mlp) / 1e6
        ms = median_range(times[n])
        rate = {**median_range([mb / t for t in times[n]]), "median": mb / ms["median"]}  # MB/ms = GB/s
        rows.append(
            {
                "layers": n,
                "weights_mb": round(mb, 2),
                "ms_per_step": round(ms["median"], 3),
                "ms_range": [round(ms["min"], 3), round(ms["max"], 3)],
                "us_per_layer": round(ms["median"] * 1e3 / n, 1),
                "gb_per_s": round(rate["median"], 1),
                "gb_per_s_range": [round(rate["min"], 1), round(rate["max"], 1)],
            }
        )
        cells.append(
            f"| {n} | {mb:.1f} | {format_spread(ms, '.3f')} | {rows[-1]['us_per_layer']:.1f} | {format_spread(rate, '.1f')} |"
        )
    print(
        f"\nXNNPACK 4-bit GEMMs at M=1 (xnnpack_8da4w numerics), shape hidden {hidden}, kv {kv}, mlp {mlp}; "
        f"{args.threads} threads; median (range) over {args.rounds} alternating rounds of fresh processes\n"
    )
    print("| layers | 4-bit weights MB | ms a step | µs a layer | weights GB/s |")
    print("|---|---|---|---|---|")
    print("\n".join(cells))
    result = {"shape": list(args.shape), "threads": args.threads, "rounds": args.rounds, "rows": rows}
    if args.json:
        write_text_atomic(args.json, json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
