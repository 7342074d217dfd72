"""Hybrid decode speed: a hybrid ``.pte`` (layers that keep a recurrent state beside attention layers with a KV cache)
against a dense Llama ``.pte`` of the same parameter count (same width, depth, heads and vocabulary; the MLP width
chosen so the totals match), in one joint run. ``--family``:

- ``lfm2``: short gated convolutions (a ``[1, hidden, kernel]`` convolution state; LFM2);
- ``qwen3_5``: gated DeltaNet (a convolution window and the delta rule's ``[heads, key, value]`` state, ExecuTorch's
  ``llama::gated_delta_rule`` kernel; Qwen3.5);
- ``granite_h``: Mamba2 mixers (a convolution window and the selective scan's ``[heads, head_dim, state]`` state, the
  scan as batched matmuls over each call's tokens; Granite-4.0-H, dense);
- ``falcon_h1``: a Mamba2 mixer beside attention in every layer (both a KV cache and the states; Falcon-H1).

qharness carries these states as buffers of the program (``qharness/deploy/fastpath/state_cache.py``); the depthwise
convolution runs in float as one multiply-add per kernel tap (``state_cache.causal_conv``), which the XNNPACK delegate
runs. What a recurrent layer saves against
attention: no KV cache to read (it grows with the position). What it costs: its own math (the convolution, the
recurrence) and the state copy per call. The script measures the net effect at two shapes: ``tiny`` (4 layers, hidden
256) and ``350m`` (LFM2-350M's config: 16 layers, 6 of them attention, hidden 1024, vocabulary 65536; the other
families take the same widths, depth and attention layers).

Each model is random-init (speed depends on shapes, not values), built in-process, quantized by ``--recipe`` (PTQ,
calibrated on random tokens) and lowered with qharness's own deploy functions; then ``qharness.runtime.joint.interleaved``
times both in ``--processes`` fresh processes each, alternating rounds, one thread count. Printed: the joint table
(median (min-max) over processes), the decode ratio hybrid / dense per round (process k against process k), median
(min-max), and each ``.pte``'s size and parameter count.

    python scripts/bench_hybrid.py --shape tiny                       # LFM2, a few minutes here
    python scripts/bench_hybrid.py --shape tiny --family granite_h    # Mamba2 + attention
    python scripts/bench_hybrid.py --shape 350m --processes 3         # export and lowering of two 350M models: ~15 min
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAMILIES = ("lfm2", "qwen3_5", "granite_h", "falcon_h1")
# LFM2-350M's config.json (hidden, layers, heads, KV heads, vocabulary, the attention layers' indices, MLP width)
SHAPES = {
    "tiny": dict(hidden=256, layers=4, heads=4, kv_heads=2, vocab=4096, attention=(1, 3), intermediate=1024),
    "350m": dict(
        hidden=1024, layers=16, heads=16, kv_heads=8, vocab=65536, attention=(2, 5, 8, 10, 12, 14), intermediate=6656
    ),
}


def hybrid_config(family: str, shape: dict, max_seq_len: int):
    """``family``'s config at ``shape``: its recurrent layers everywhere but ``shape["attention"]`` (Falcon-H1: a
    mixer beside attention in every layer)."""
    from transformers import AutoConfig

    h, heads = shape["hidden"], shape["heads"]
    attention = [i in shape["attention"] for i in range(shape["layers"])]
    mamba2 = dict(mamba_n_heads=2 * h // 64, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_expand=2)
    types, model_type, extra = {
        "lfm2": (("full_attention", "conv"), "lfm2", {}),
        "qwen3_5": (
            ("full_attention", "linear_attention"),
            "qwen3_5_text",
            dict(
                linear_num_key_heads=heads,
                linear_num_value_heads=heads,
                linear_key_head_dim=h // heads,
                linear_value_head_dim=h // heads,
                head_dim=h // heads,
            ),
        ),
        "granite_h": (
            ("attention", "mamba"),
            "granitemoehybrid",
            dict(mamba2, num_local_experts=0, shared_intermediate_size=shape["intermediate"]),
        ),
        "falcon_h1": ((None, None), "falcon_h1", dict(mamba2, mamba_d_ssm=2 * h, head_dim=h // heads)),
    }[family]
    if types != (None, None):
        extra["layer_types"] = [types[0] if a else types[1] for a in attention]
    return AutoConfig.for_model(
        model_type,
        vocab_size=shape["vocab"],
        hidden_size=h,
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=heads,
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=True,
        **extra,
    )


def dense_config(shape: dict, max_seq_len: int, params: int):
    """A tied Llama of the same width, depth, heads and vocabulary whose MLP width makes its parameter count
    ``params`` (to the nearest multiple of 32, a group size every recipe takes)."""
    from transformers import AutoConfig

    h, n, head = shape["hidden"], shape["layers"], shape["hidden"] // shape["heads"]
    attention = h * h * 2 + 2 * h * shape["kv_heads"] * head  # q, o; k, v
    fixed = shape["vocab"] * h + n * (attention + 2 * h) + h  # embeddings (tied), attention, norms
    width = max(32, round((params - fixed) / (3 * h * n) / 32) * 32)
    return AutoConfig.for_model(
        "llama",
        vocab_size=shape["vocab"],
        hidden_size=h,
        intermediate_size=width,
        num_hidden_layers=n,
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=head,
        max_position_embeddings=max_seq_len,
        tie_word_embeddings=True,
    )


def build(kind: str, args) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(hybrid_config(args.family, shape, args.max_seq_len)).eval()
    if kind == args.family:
        return hybrid
    params = sum(p.numel() for p in hybrid.parameters())
    del hybrid
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(dense_config(shape, args.max_seq_len, params)).eval()


def export(kind: str, args, out: Path) -> tuple[Path, int]:
    """``out/<kind>_<shape>_<recipe>.pte`` of ``build(kind)`` quantized by ``args.recipe`` (reused when present; the
    dense model's name also carries the family whose parameter count it matches), and the model's parameter count."""
    from qharness.deploy.deployed import export_path
    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.io.atomic import write_bytes_atomic
    from qharness.recipes.registry import load_recipe

    name = kind if kind == args.family else f"{kind}_{args.family}"  # dense_<family>: sized to that family
    path = out / f"{name}_{args.shape}_{args.recipe}.pte"
    model = build(kind, args)
    params = sum(p.numel() for p in model.parameters())
    if path.is_file():
        return path, params
    print(f"exporting {kind} ({args.shape}, {params / 1e6:.1f}M parameters, {args.recipe}) ...", flush=True)
    recipe = load_recipe(args.recipe)
    tokens = torch.randint(0, SHAPES[args.shape]["vocab"], (1, 32))

    def calibrate(graph):
        for _ in range(2):
            graph(tokens, torch.tensor([0]))

    graph = quantize_for_deploy(model, recipe, args.max_seq_len, calibrate)
    if export_path(graph) != "fast":
        raise SystemExit(f"{kind}: not on the fast path")
    meta = runner_metadata(args.max_seq_len, SHAPES[args.shape]["vocab"], None, [])
    write_bytes_atomic(path, lower_to_pte(graph, recipe, args.max_seq_len, meta))
    return path, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--family", choices=FAMILIES, default="lfm2")
    p.add_argument("--recipe", default="xnnpack_8da4w")
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--decode_tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="default: the cores free now")
    p.add_argument("--out", type=Path, default=Path("runs/bench_hybrid"), help="directory for the .pte files")
    p.add_argument(
        "--export_llm",
        type=Path,
        default=None,
        help="also time this .pte of the same shape from ExecuTorch's own export_llm (random weights, 8da4w; "
        "how it was built: docs/benchmarks/speed.md, hybrids)",
    )
    args = p.parse_args()

    from qharness.runtime.joint import format_joint, interleaved
    from qharness.runtime.spread import format_spread, pair_ratios
    from qharness.upstream import quiet

    quiet.install()
    args.out.mkdir(parents=True, exist_ok=True)
    kinds = [args.family, "dense"]
    built = {k: export(k, args, args.out) for k in kinds}
    vocab = SHAPES[args.shape]["vocab"]
    programs = {k: {"kind": "pte", "path": str(path), "vocab_size": vocab} for k, (path, _) in built.items()}
    if args.export_llm is not None:
        kinds.append("export_llm")
        programs["export_llm"] = {"kind": "pte", "path": str(args.export_llm), "vocab_size": vocab}
    joint = interleaved(programs, args.prompt_len, args.decode_tokens, args.reps, args.processes, threads=args.threads)
    print(f"\nshape {args.shape} ({SHAPES[args.shape]}), recipe {args.recipe}, cache {args.max_seq_len} positions")
    print(format_joint(joint))
    for what in ("decode_tok_s", "prefill_tok_s"):
        per = {k: joint["programs"][k][what]["per_process"] for k in kinds}
        for other in kinds[1:]:
            ratio = format_spread(pair_ratios(per[args.family], per[other]))
            print(f"{what}, {args.family} / {other}: {ratio} (per round, median (min-max))")
    for k, (path, params) in built.items():
        print(f"{k}: {params / 1e6:.2f}M parameters, .pte {path.stat().st_size / 1e6:.2f} MB")
    if args.export_llm is not None:
        print(f"export_llm: .pte {args.export_llm.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
