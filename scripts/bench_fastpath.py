"""Our fast-path ``.pte`` against ExecuTorch's own LLM export (``export_llm``) of the same weights.

For each kind (fp32, int8 dynamic, 8da4w) both programs are built from one HF Llama: ours through
``qharness.deploy.lower`` (the recipe ``xnnpack_fp32`` / ``xnnpack_int8_dynamic`` / ``xnnpack_8da4w``), theirs by
mapping the HF weights into ExecuTorch's Llama definition (``examples/models/llama``: a Meta-format
checkpoint + ``params.json``) and running ``export_llama(LlmConfig)`` with the KV cache, custom SDPA,
dynamic shapes and XNNPACK (``extended_ops``) on. The ``.pte`` files are then timed with
``qharness.runtime.joint.interleaved`` (``--processes`` fresh processes each, alternating rounds, one thread count):
prefill and decode ms/token, and each ratio ours/theirs taken per round (process k of ours against process k of
theirs) and given as median (min-max) over the rounds. Targets: decode ratio <= 1.05, prefill ratio <= 1;
"MET" only when the whole spread meets them, "TIE/UNDECIDED" when it straddles them.

    python scripts/bench_fastpath.py                       # the embedded default model
    python scripts/bench_fastpath.py --model random        # random-init Llama, 4 layers, dim 256
    python scripts/bench_fastpath.py --kinds fp32 --prompt_len 64 --decode_tokens 32 --reps 3 --processes 2
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from qharness.runtime.spread import format_spread, pair_ratios, verdict

KINDS = {  # kind: (our recipe, their LlmConfig.quantization settings)
    "fp32": ("xnnpack_fp32", {}),
    "int8_dynamic": ("xnnpack_int8_dynamic", {"pt2e_quantize": "xnnpack_dynamic"}),
    "8da4w": ("xnnpack_8da4w", {"qmode": "8da4w", "group_size": 32}),
}


def load_model(source: str):
    """``(HF LlamaForCausalLM, bos_id, eos_ids)``: "embedded" (the default model) or "random"
    (a random-init Llama with 4 layers, dim 256, 8 heads, 4 KV heads, FFN 768, vocab 2048)."""
    from qharness.sources.models import load_model_and_tokenizer, resolve_checkpoint

    if source == "random":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=2048,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        )
        return LlamaForCausalLM(config).eval(), 0, [0]
    model, tok = load_model_and_tokenizer(resolve_checkpoint(source))
    return model, tok.bos_token_id, [tok.eos_token_id]


def export_ours(model, recipe_name: str, max_seq_len: int, path: Path, bos_id, eos_ids) -> dict:
    """Our ``.pte`` of ``recipe_name`` (PTQ, calibrated on 4 random blocks); returns timings and the export path."""
    from qharness.deploy.deployed import export_path
    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe

    recipe = load_recipe(recipe_name)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, vocab, (4, 1, 64), generator=gen)

    def calibrate(graph):
        for b in blocks:
            graph(b, torch.tensor([0]))

    t = time.perf_counter()
    deployed = quantize_for_deploy(copy.deepcopy(model), recipe, max_seq_len, calibrate)
    path.write_bytes(lower_to_pte(deployed, recipe, max_seq_len, runner_metadata(max_seq_len, vocab, bos_id, eos_ids)))
    return {"export_s": time.perf_counter() - t, "export_path": export_path(deployed)}


def export_ours_all_logits(model, max_seq_len: int, path: Path, bos_id, eos_ids) -> None:
    """Our fp32 fast path returning every position's logits (``FastDecoder(all_logits=True)``): what keeping
    all-position logits would cost in prefill."""
    from qharness.deploy.fastpath.decoder import export_fast
    from qharness.deploy.lower import runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.upstream import imports

    recipe = load_recipe("xnnpack_fp32")
    m = copy.deepcopy(model).requires_grad_(False)
    ep = export_fast(m, max_seq_len, all_logits=True).run_decompositions({})
    meta = runner_metadata(max_seq_len, model.config.vocab_size, bos_id, eos_ids, use_sdpa_with_kv_cache=True)
    edge = imports.to_edge_transform_and_lower(ep, partitioner=recipe.make_partitioners(), constant_methods=meta)
    path.write_bytes(edge.to_executorch(imports.executorch_backend_config()).buffer)


def hf_to_meta(model) -> tuple[dict, dict]:
    """ExecuTorch Llama ``(state_dict, params)`` from an HF Llama: keys renamed, q/k rows permuted from
    HF's rotate-half layout to Meta's interleaved rotary layout, the tied embedding copied to ``output``."""
    c = model.config
    rope = getattr(c, "rope_parameters", None) or {}
    if (
        type(model).__name__ != "LlamaForCausalLM"
        or rope.get("rope_type", "default") != "default"
        or c.attention_bias
        or c.mlp_bias
    ):
        raise SystemExit(
            f"bench_fastpath maps plain Llamas only (default rotary, no biases); got {type(model).__name__} {rope}"
        )
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    def unpermute(w, heads):  # inverse of transformers' convert_llama_weights_to_hf permute
        return w.view(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)

    sd = {
        "tok_embeddings.weight": model.model.embed_tokens.weight,
        "norm.weight": model.model.norm.weight,
        "output.weight": model.lm_head.weight,
    }
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        sd |= {
            f"layers.{i}.attention.wq.weight": unpermute(a.q_proj.weight, c.num_attention_heads),
            f"layers.{i}.attention.wk.weight": unpermute(a.k_proj.weight, c.num_key_value_heads),
            f"layers.{i}.attention.wv.weight": a.v_proj.weight,
            f"layers.{i}.attention.wo.weight": a.o_proj.weight,
            f"layers.{i}.attention_norm.weight": layer.input_layernorm.weight,
            f"layers.{i}.ffn_norm.weight": layer.post_attention_layernorm.weight,
            f"layers.{i}.feed_forward.w1.weight": m.gate_proj.weight,
            f"layers.{i}.feed_forward.w2.weight": m.down_proj.weight,
            f"layers.{i}.feed_forward.w3.weight": m.up_proj.weight,
        }
    params = {
        "dim": c.hidden_size,
        "n_layers": c.num_hidden_layers,
        "n_heads": c.num_attention_heads,
        "n_kv_heads": c.num_key_value_heads,
        "vocab_size": c.vocab_size,
        "hidden_dim": c.intermediate_size,
        "head_dim": head_dim,
        "norm_eps": c.rms_norm_eps,
        "rope_theta": float(rope["rope_theta"]),
    }
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}, params


def export_theirs(
    model, quant: dict, max_seq_len: int, out_dir: Path, bos_id, eos_ids, fast_lowering: bool = False
) -> dict:
    """``export_llama(LlmConfig)`` of ExecuTorch's Llama holding ``model``'s weights; returns timings and the path.

    ``fast_lowering``: run it inside ``qharness.upstream.lowering.fast_lowering()`` (the same ``.pte``, byte for byte, in a
    fraction of the time: upstream lowering of a 30-layer model takes tens of minutes here)."""
    import contextlib

    from executorch.examples.models.llama.export_llama_lib import export_llama
    from executorch.extension.llm.export.config.llm_config import LlmConfig, ModelType, Pt2eQuantize

    from qharness.upstream import lowering

    out_dir.mkdir(parents=True, exist_ok=True)
    sd, params = hf_to_meta(model)
    # a temporary directory: export_llama treats a checkpoint path containing "int8" or "8da4w" as pre-quantized
    ckpt_dir = Path(tempfile.mkdtemp(prefix="hf_weights_"))
    torch.save(sd, ckpt_dir / "checkpoint.pth")
    (ckpt_dir / "params.json").write_text(json.dumps(params))
    cfg = LlmConfig()
    cfg.base.model_class = ModelType.llama3
    cfg.base.checkpoint = str(ckpt_dir / "checkpoint.pth")
    cfg.base.params = str(ckpt_dir / "params.json")
    cfg.base.metadata = json.dumps({"get_bos_id": bos_id, "get_eos_ids": eos_ids})
    cfg.model.use_kv_cache = True
    cfg.model.use_sdpa_with_kv_cache = True
    cfg.model.enable_dynamic_shape = True
    cfg.export.max_seq_length = max_seq_len
    cfg.export.max_context_length = max_seq_len
    cfg.export.output_dir = str(out_dir)
    cfg.export.output_name = str(out_dir / "theirs.pte")  # a bare name lands in the cwd
    cfg.backend.xnnpack.enabled = True
    cfg.backend.xnnpack.extended_ops = True
    if "qmode" in quant:
        cfg.quantization.qmode = quant["qmode"]
        cfg.quantization.group_size = quant["group_size"]
    if "pt2e_quantize" in quant:
        cfg.quantization.pt2e_quantize = Pt2eQuantize(quant["pt2e_quantize"])
    if "embedding_quantize" in quant:  # e.g. "4,32": weight-only embedding table, bits and group size
        cfg.quantization.embedding_quantize = quant["embedding_quantize"]
    t = time.perf_counter()
    try:
        with lowering.fast_lowering() if fast_lowering else contextlib.nullcontext():
            path = export_llama(cfg)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return {"export_s": time.perf_counter() - t, "path": path}


def agreement(ours: Path, theirs: Path, vocab: int, prompt_len: int = 32, decode: int = 16) -> dict:
    """Both ``.pte``s on one random prompt, then greedy decoding (ours' tokens fed to both): the largest
    last-token logit difference and how often both pick the same token."""
    from qharness.runtime.pte import PteModel

    a, b = PteModel(ours), PteModel(theirs)
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    la, lb = a(prompt, 0).reshape(-1, vocab)[-1], b(prompt, 0).reshape(-1, vocab)[-1]
    diff, same = 0.0, 0
    for i in range(decode + 1):
        diff, same = max(diff, (la - lb).abs().max().item()), same + int(la.argmax() == lb.argmax())
        token = la.argmax().view(1, 1)
        la, lb = a(token, prompt_len + i).reshape(-1), b(token, prompt_len + i).reshape(-1)
    return {"max_abs_diff": diff, "argmax_agreement": same / (decode + 1)}


def time_both(paths: dict, vocab: int, prompt_len: int, decode_tokens: int, reps: int, processes: int) -> dict:
    """``qharness.runtime.joint.interleaved`` over the ``.pte`` files; per model the ms/token spread over processes (prefill,
    decode) and its per-process values, which ``run`` pairs round by round into ratios."""
    from qharness.runtime.joint import interleaved
    from qharness.runtime.spread import spread

    programs = {name: {"kind": "pte", "path": str(path), "vocab_size": vocab} for name, path in paths.items()}
    joint = interleaved(programs, prompt_len, decode_tokens, reps, processes)
    out = {"threads": joint["threads"], "load_avg_1m": joint["load_avg_1m"]}
    for name, p in joint["programs"].items():
        out[name] = {
            "prefill": spread([1e3 / x for x in p["prefill_tok_s"]["per_process"]]),
            "decode": p["decode_ms_per_token"],
        }
    return out


def run(
    model_source: str,
    kinds: list[str],
    out_dir: Path,
    max_seq_len: int,
    prompt_len: int,
    decode_tokens: int,
    reps: int,
    processes: int,
    all_logits: bool = True,
    reuse: bool = False,
) -> list[dict]:
    """Build both ``.pte``s per kind, check they agree, time them; one result row per kind (``all_logits``: for
    fp32 also time our fast path returning every position's logits; ``reuse``: time the ``.pte``s an earlier
    run left in ``out_dir`` instead of exporting again)."""
    model, bos_id, eos_ids = load_model(model_source)
    vocab = model.config.vocab_size
    rows = []
    for kind in kinds:
        recipe, quant = KINDS[kind]
        kdir = out_dir / kind
        kdir.mkdir(parents=True, exist_ok=True)
        paths = {"ours": kdir / "ours.pte", "theirs": kdir / "export_llm" / "theirs.pte"}
        if kind == "fp32" and all_logits:
            paths["ours_all_logits"] = kdir / "ours_all_logits.pte"
        if reuse and all(p.is_file() for p in paths.values()):
            log = json.loads((kdir / "export.json").read_text())
            ours, theirs = log["ours"], log["theirs"]
        else:
            ours = export_ours(model, recipe, max_seq_len, paths["ours"], bos_id, eos_ids)
            theirs = export_theirs(model, quant, max_seq_len, paths["theirs"].parent, bos_id, eos_ids)
            if "ours_all_logits" in paths:
                export_ours_all_logits(model, max_seq_len, paths["ours_all_logits"], bos_id, eos_ids)
            (kdir / "export.json").write_text(json.dumps({"ours": ours, "theirs": theirs}))
        row = {
            "kind": kind,
            "recipe": recipe,
            "export_path": ours["export_path"],
            "export_s": {"ours": ours["export_s"], "theirs": theirs["export_s"]},
            "size_mb": {n: p.stat().st_size / 1e6 for n, p in paths.items()},
            "agreement": agreement(paths["ours"], paths["theirs"], vocab),
        }
        t = time_both(paths, vocab, prompt_len, decode_tokens, reps, processes)
        row["threads"], row["load_avg_1m"] = t.pop("threads"), t.pop("load_avg_1m")
        row["ms_per_token"] = t
        row["ratio"] = {
            k: pair_ratios(t["ours"][k]["per_process"], t["theirs"][k]["per_process"]) for k in ("prefill", "decode")
        }
        if "ours_all_logits" in t:
            row["all_logits_prefill_ratio"] = pair_ratios(
                t["ours_all_logits"]["prefill"]["per_process"], t["ours"]["prefill"]["per_process"]
            )
        rows.append(row)
        print(format_rows([row]), flush=True)
    return rows


def verdicts(row: dict) -> str:
    """ "MET" when both whole spreads meet their targets, "NOT MET" when either misses entirely, else "TIE/UNDECIDED"."""
    v = {verdict(row["ratio"]["decode"], 1.05, False), verdict(row["ratio"]["prefill"], 1.0, False)}
    return "NOT MET" if "NOT MET" in v else "TIE/UNDECIDED" if "TIE/UNDECIDED" in v else "MET"


def format_rows(rows: list[dict]) -> str:
    head = (
        "kind",
        "path",
        "prefill ms/tok ours",
        "theirs",
        "ratio (spread)",
        "decode ms/tok ours",
        "theirs",
        "ratio (spread)",
        "size MB o/t",
        "max|Δlogit|",
        "argmax agree",
    )
    table = [head]
    for r in rows:
        t = r["ms_per_token"]
        table.append(
            (
                r["kind"],
                r["export_path"],
                format_spread(t["ours"]["prefill"], ".3f"),
                format_spread(t["theirs"]["prefill"], ".3f"),
                format_spread(r["ratio"]["prefill"]),
                format_spread(t["ours"]["decode"], ".3f"),
                format_spread(t["theirs"]["decode"], ".3f"),
                format_spread(r["ratio"]["decode"]),
                f"{r['size_mb']['ours']:.2f}/{r['size_mb']['theirs']:.2f}",
                f"{r['agreement']['max_abs_diff']:.3g}",
                f"{r['agreement']['argmax_agreement']:.2f}",
            )
        )
    width = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, width)) for row in table]
    for r in rows:
        if "all_logits_prefill_ratio" in r:
            t = r["ms_per_token"]["ours_all_logits"]
            lines.append(
                f"{r['kind']}: ours with all-position logits: prefill {format_spread(t['prefill'], '.3f')} ms/tok "
                f"(x{format_spread(r['all_logits_prefill_ratio'])} of last-token logits), decode {format_spread(t['decode'], '.3f')} ms/tok"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="embedded", help="embedded, random (4 layers, dim 256) or an HF LlamaForCausalLM directory"
    )
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--out", default="runs/bench_fastpath", help="directory for the .pte files and results.json")
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--prompt_len", type=int, default=128)
    p.add_argument("--decode_tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=10, help="repetitions per fresh process (after a warm-up)")
    p.add_argument("--processes", "--rounds", type=int, default=5, help="fresh processes per model, alternating rounds")
    p.add_argument(
        "--no_all_logits", action="store_true", help="skip timing the fp32 fast path with all-position logits"
    )
    p.add_argument(
        "--reuse", action="store_true", help="time the .pte files an earlier run of the same --model left in --out"
    )
    a = p.parse_args(argv)
    out = Path(a.out)
    rows = run(
        a.model,
        a.kinds,
        out,
        a.max_seq_len,
        a.prompt_len,
        a.decode_tokens,
        a.reps,
        a.processes,
        not a.no_all_logits,
        a.reuse,
    )
    print(
        f"\nmodel {a.model}: HF weights mapped into ExecuTorch's Llama for export_llm; prompt {a.prompt_len} tokens, "
        f"{a.decode_tokens} decode steps, {a.reps} reps x {a.processes} fresh processes per program, alternating rounds; ms/token: median (min-max) "
        f"of the process medians; ratios: median (min-max) over the rounds' ours/theirs; {rows[0]['threads']} threads; {os.cpu_count()} CPUs, "
        f"load average " + ", ".join(f"{r['load_avg_1m'][0]:.1f}->{r['load_avg_1m'][1]:.1f}" for r in rows)
    )
    print(format_rows(rows))
    for r in rows:
        print(
            f"{r['kind']}: decode ours/theirs {format_spread(r['ratio']['decode'])} (target <= 1.05), "
            f"prefill {format_spread(r['ratio']['prefill'])} (target <= 1.00): {verdicts(r)}"
        )
    (out / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
