"""int8 KV cache against the float cache: perplexity, logits and decode speed of the same recipe's
``.pte`` with ``kv_cache: fp32`` and ``kv_cache: int8``, measured side by side in one run.

Both programs come from one model and one recipe (default ``xnnpack_8da4w``, PTQ) that differ only in the recipe's
``kv_cache``. Then:

- perplexity of each ``.pte`` on held-out blocks, through the runtime, one token per call (every position reads the
  cache it wrote), and the paired ratio int8 / fp32 with its 95% interval over the blocks;
- max |Δlogit| between the two programs on those blocks;
- prefill and decode speed with ``qharness.runtime.joint.interleaved`` (fresh processes, alternating rounds), with a
  long prompt so that decode reads a long cache (``--prompt_len``, default 512 of a 1024-position cache);
- the KV cache's bytes: ``layers x 2 x positions x kv_heads x head_dim`` x 4 (fp32) or x 1 + a float32 scale and
  an int8 zero point per token and head (int8).

    python scripts/bench_kv_cache.py                          # the benchmark model (tinyshakespeare), ~10 min here
    python scripts/bench_kv_cache.py --model smollm2-135m     # SmolLM2-135M's shape, random weights (speed only)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))


def cache_bytes(model, max_seq_len: int, kv_cache: str) -> int:
    config = model.config.get_text_config()
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token_head = head_dim * 4 if kv_cache == "fp32" else head_dim + 4 + 1
    return config.num_hidden_layers * 2 * max_seq_len * kv_heads * per_token_head


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="benchmark", help="benchmark, smollm2-135m, embedded or an HF Llama directory")
    p.add_argument("--recipe", default="xnnpack_8da4w")
    p.add_argument("--out", default="runs/bench_kv_cache")
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "qharness-bench"))
    p.add_argument("--max_seq_len", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=32, help="held-out blocks of 128 tokens for perplexity")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--decode_tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--processes", type=int, default=5)
    args = p.parse_args(argv)

    import bench_speed

    from qharness.checks import stats
    from qharness.checks.parity import score_deployed
    from qharness.runtime.joint import format_joint, interleaved
    from qharness.runtime.pte import PteModel
    from qharness.runtime.spread import pair_ratios
    from qharness.sources.models import load_model_and_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = bench_speed.resolve_model(args.model, Path(args.work))
    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    dm = bench_speed.text_data(model_dir)
    calib, x, y = dm.train_x[:16], dm.val_x[: args.blocks], dm.val_y[: args.blocks]
    vocab = model.config.vocab_size
    results = {"model": str(model_dir), "recipe": args.recipe, "max_seq_len": args.max_seq_len, "programs": {}}
    ptes, scores = {}, {}
    for kv in ("fp32", "int8"):
        recipe = out / f"{args.recipe}_kv_{kv}.yaml"
        recipe.write_text(f"base: {args.recipe}\nkv_cache: {kv}\n")
        ptes[kv] = out / f"kv_{kv}.pte"
        print(f"exporting {args.recipe} with a {kv} KV cache ...", flush=True)
        info = bench_speed.export_ours(model, tokenizer, str(recipe), args.max_seq_len, ptes[kv], calib)
        pte = PteModel(ptes[kv])
        scores[kv] = score_deployed(
            lambda t, s, pte=pte: pte(t, s).reshape(1, -1, vocab), x, y, desc=f"scoring the {kv}-cache .pte"
        )
        results["programs"][kv] = {
            **info,
            "ppl": scores[kv]["ppl"],
            "size_mb": ptes[kv].stat().st_size / 1e6,
            "kv_cache_mb": cache_bytes(model, args.max_seq_len, kv) / 1e6,
        }
    with torch.no_grad():  # the two programs' logits on the first blocks, position by position
        a, b = PteModel(ptes["fp32"]), PteModel(ptes["int8"])
        diffs = []
        for block in x[:4]:
            for i in range(block.numel()):
                t = block[None, i : i + 1]
                diffs.append((a(t, i) - b(t, i)).abs().max().item())
    results["max_abs_logit_diff"] = max(diffs)
    results["ppl_ratio_int8_over_fp32"] = stats.paired_ratio(
        scores["int8"]["block_losses"], scores["fp32"]["block_losses"]
    )
    programs = {kv: {"kind": "pte", "path": str(ptes[kv]), "vocab_size": vocab} for kv in ptes}
    joint = interleaved(programs, args.prompt_len, args.decode_tokens, args.reps, args.processes)
    results["joint"] = joint
    fp, q = joint["programs"]["fp32"], joint["programs"]["int8"]
    results["decode_ratio_int8_over_fp32"] = pair_ratios(
        q["decode_tok_s"]["per_process"], fp["decode_tok_s"]["per_process"]
    )
    results["prefill_ratio_int8_over_fp32"] = pair_ratios(
        q["prefill_tok_s"]["per_process"], fp["prefill_tok_s"]["per_process"]
    )
    (out / "results.json").write_text(json.dumps(results, indent=2))

    r = results["ppl_ratio_int8_over_fp32"]
    print(f"\n== {args.recipe}, model {model_dir.name}, cache {args.max_seq_len} positions; {len(x)} held-out blocks")
    print(f"{'KV cache':9s} {'.pte ppl':>9s} {'size MB':>8s} {'KV cache MB':>12s}")
    for kv, row in results["programs"].items():
        print(f"{kv:9s} {row['ppl']:9.3f} {row['size_mb']:8.2f} {row['kv_cache_mb']:12.2f}")
    print(f"ppl int8 / fp32: {r['ppl_ratio']:.4f} [{r['ci'][0]:.4f}, {r['ci'][1]:.4f}] (95%, paired over blocks)")
    print(f"max |Δlogit| int8 vs fp32 cache (first 4 blocks, every position): {results['max_abs_logit_diff']:.4f}")
    print(format_joint(joint))
    d, f = results["decode_ratio_int8_over_fp32"], results["prefill_ratio_int8_over_fp32"]
    print(
        f"decode int8 / fp32 tok/s: {d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f}); "
        f"prefill: {f['median']:.2f} ({f['min']:.2f}-{f['max']:.2f}) (per round, {args.processes} rounds)"
    )


if __name__ == "__main__":
    main()
