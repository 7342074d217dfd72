"""MoE decode speed: a tiny Mixtral ``.pte`` against dense Mistral ``.pte`` files of the same
attention, embeddings and depth whose MLP has the MoE's *active* width (``top_k * I``) and its *total* width
(``experts * I``).

qharness deploys an MoE with every expert applied to every token (``qharness/sources/moe.py``: static shapes, one
quantized linear per expert and projection), so a decode step reads all experts' weights: the expectation is that
the MoE decodes near the total-width dense model and slower than the active-width one (plus the cost of its
``E`` small linears per projection against one wide one). The script measures it.

Each model is random-init (speed depends on shapes, not values), built in-process, quantized by ``--recipe``
(PTQ, calibrated on random tokens) and lowered to ``.pte`` with qharness's own deploy functions; then
``qharness.runtime.joint.interleaved`` times all three in ``--processes`` fresh processes each, alternating rounds, one
thread count. Printed: the joint table (median (min-max) over processes) and the decode ratios MoE / dense taken
per round (process k against process k), median (min-max).

Seen here (defaults: 4 layers, hidden 256, 8 experts of width 512, top-2, xnnpack_8da4w, 3 processes, 1 thread), two
runs on a loaded machine (docs/benchmarks/speed.md, MoE): decode moe / dense_active 0.44 (0.39-0.45) and 0.50 (0.43-0.63), moe /
dense_total 0.79 (0.48-0.92) and 1.04 (0.76-1.18); .pte 12.6 MB (moe), 7.2 MB (dense_active), 12.5 MB (dense_total).

    python scripts/bench_moe.py                                   # about 10 min here (export and lowering most of it)
    python scripts/bench_moe.py --recipe xnnpack_int8_dynamic --processes 5 --experts 8 --top_k 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(kind: str, args) -> torch.nn.Module:
    """The random-init model ``kind``: "moe" (Mixtral), "dense_active" or "dense_total" (Mistral), rewritten as
    qharness loads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qharness.sources.moe import rewrite_moe

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64,
        max_position_embeddings=args.max_seq_len,
        tie_word_embeddings=False,
    )
    if kind == "moe":
        config = AutoConfig.for_model(
            "mixtral",
            intermediate_size=args.intermediate,
            num_local_experts=args.experts,
            num_experts_per_tok=args.top_k,
            **common,
        )
    else:
        width = args.intermediate * (args.top_k if kind == "dense_active" else args.experts)
        config = AutoConfig.for_model("mistral", intermediate_size=width, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    rewrite_moe(model)
    return model


def export(kind: str, args, out: Path) -> Path:
    """``out/<kind>.pte`` of ``build(kind)`` quantized by ``args.recipe`` (reused when present)."""
    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.io.atomic import write_bytes_atomic
    from qharness.recipes.registry import load_recipe

    path = out / f"{kind}_{args.recipe}.pte"
    if path.is_file():
        return path
    print(f"exporting {kind} ({args.recipe}) ...", flush=True)
    model, recipe = build(kind, args), load_recipe(args.recipe)
    tokens = torch.randint(0, args.vocab, (1, 32))

    def calibrate(graph):
        for _ in range(2):
            graph(tokens, torch.tensor([0]))

    graph = quantize_for_deploy(model, recipe, args.max_seq_len, calibrate)
    meta = runner_metadata(args.max_seq_len, args.vocab, None, [])
    write_bytes_atomic(path, lower_to_pte(graph, recipe, args.max_seq_len, meta))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="xnnpack_8da4w")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512, help="each expert's width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max_seq_len", type=int, default=128)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--decode_tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="default: the cores free now")
    p.add_argument("--out", type=Path, default=Path("runs/bench_moe"), help="directory for the .pte files")
    args = p.parse_args()

    from qharness.runtime.joint import format_joint, interleaved
    from qharness.runtime.spread import format_spread, pair_ratios
    from qharness.upstream import quiet

    quiet.install()
    args.out.mkdir(parents=True, exist_ok=True)
    kinds = ["moe", "dense_active", "dense_total"]
    programs = {k: {"kind": "pte", "path": str(export(k, args, args.out)), "vocab_size": args.vocab} for k in kinds}
    joint = interleaved(programs, args.prompt_len, args.decode_tokens, args.reps, args.processes, threads=args.threads)
    print(
        f"\n{args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.intermediate}, top-{args.top_k}; "
        f"dense_active: MLP width {args.top_k * args.intermediate}, dense_total: {args.experts * args.intermediate}; "
        f"recipe {args.recipe}"
    )
    print(format_joint(joint))
    decode = {k: joint["programs"][k]["decode_tok_s"]["per_process"] for k in kinds}
    for other in kinds[1:]:
        ratio = pair_ratios(decode["moe"], decode[other])
        print(f"decode tok/s, moe / {other}: {format_spread(ratio)} (per round, median (min-max))")
    for k in kinds:
        print(f"{k}: {joint['programs'][k]['size_bytes'] / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
