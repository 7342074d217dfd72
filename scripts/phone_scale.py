"""Phone-scale table: random-init models at the shapes of SmolLM2-135M, Qwen3-0.6B and Llama-3.2-1B, per recipe:
``.pte`` size, decode and prefill tok/s, peak RSS, load time, decode as a fraction of the memory-bandwidth bound, and
ours against ExecuTorch's ``export_llm`` on the same weights, all programs of a shape timed in one joint run.

Per shape: the model is built once under ``--work`` (random init: speed and size depend on shapes, not on weight
values; tied embeddings where the real model ties them). Each recipe's ``.pte`` is exported (PTQ, 8 calibration
blocks) in a fresh process, one at a time (the FP32 export of the 1B shape alone needs several GB), and so is each
``export_llm`` peer (plain Llamas only: SmolLM2 and Llama shapes; ``scripts/bench_fastpath.export_theirs``). Then
every program of the shape is timed with ``qharness.runtime.joint.interleaved`` (``--processes`` fresh processes
each, alternating rounds: A B, B A, ...; one thread count), ``--runs`` times; a ratio (ours / export_llm decode ms
per token, i.e. their tok/s over ours) is taken round by round within one run and shown as median (min-max) over the
rounds of all runs, each run also on its own. Decode against the bound: decode tok/s x bytes read per decoded token
(the ``.pte`` less its embedding table, of which a token reads one row; ``runtime/measure._sizes``) / the measured
copy bandwidth (GB/s, bytes read + written; the median of its measurements before and after each joint run, printed
with their min-max: the host's bandwidth moves).

Recipes: names or recipe YAML paths. ``xnnpack_8da4w`` quantizes the embedding table to 4 bits in groups of 32 (the
built-in default); its peer is ``export_llm`` 8da4w with ``embedding_quantize: 4,32``. ``8da4w+fpemb`` is
``xnnpack_8da4w`` with ``embedding_bits: null`` (FP32 tables; a recipe file written under ``--work``); its peer is
``export_llm`` 8da4w. Peers exist for ``xnnpack_fp32``, ``xnnpack_int8_dynamic``, ``8da4w+fpemb`` and
``xnnpack_8da4w``.

The Llama-3.2-1B shape here has no llama3 rope scaling (``export_llm``'s weight mapping here takes default rotary
only; scaling changes the rotary table's values, not its shape or the work per token).

Usage::

    python scripts/phone_scale.py --shape 135m                      # all four recipes + peers, 2 runs
    python scripts/phone_scale.py --shape 1b --recipes 8da4w+fpemb xnnpack_8da4w --runs 2
    python scripts/phone_scale.py --shape qwen3-0.6b --recipes xnnpack_8da4w --no-peer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import scale  # noqa: E402  the SmolLM2-135M and Llama-3.2-1B shapes

# Qwen3-0.6B (Qwen/Qwen3-0.6B config.json)
QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
    initializer_range=0.02,
    bos_token_id=0,
    eos_token_id=0,
)
LLAMA32_1B = {k: v for k, v in scale.LLAMA32_1B.items() if k != "rope_scaling"}  # see the module docstring
SHAPES = {"135m": ("llama", scale.SMOLLM2_135M), "qwen3-0.6b": ("qwen3", QWEN3_06B), "1b": ("llama", LLAMA32_1B)}
NAMES = {"135m": "SmolLM2-135M", "qwen3-0.6b": "Qwen3-0.6B", "1b": "Llama-3.2-1B"}
FPEMB = "8da4w+fpemb"
RECIPES = ["xnnpack_fp32", "xnnpack_int8_dynamic", FPEMB, "xnnpack_8da4w"]
PEERS = {  # our recipe -> export_llm's LlmConfig.quantization settings
    "xnnpack_fp32": {},
    "xnnpack_int8_dynamic": {"pt2e_quantize": "xnnpack_dynamic"},
    FPEMB: {"qmode": "8da4w", "group_size": 32},
    "xnnpack_8da4w": {"qmode": "8da4w", "group_size": 32, "embedding_quantize": "4,32"},
}
PUBLISHED_1B_4BIT_MIB = 1083  # ExecuTorch's published Llama-3.2-1B 4-bit .pte size (the size target at 1B)


def make_model(out: Path, shape: str) -> None:
    """The random-init model of ``SHAPES[shape]`` and a BPE tokenizer of (at most) its vocabulary, saved in ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from qharness.sources.text import embedded_corpus
    from qharness.sources.tokenizer import train_bpe_tokenizer

    family, dims = SHAPES[shape]
    tokenizer = train_bpe_tokenizer(embedded_corpus(), dims["vocab_size"])
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **dims, pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def recipe_arg(name: str, work: Path) -> str:
    """A recipe name or path for ``load_recipe``; ``8da4w+fpemb`` becomes a recipe file under ``work``."""
    if name != FPEMB:
        return name
    path = work / "xnnpack_8da4w_fpemb.yaml"
    path.write_text(
        "base: xnnpack_8da4w\ndescription: XNNPACK 8da4w with FP32 embedding tables\n"
        "quantizer:\n  embedding_bits: null\n"
    )
    return str(path)


def child_export(model_dir: Path, name: str, recipe: str, out: Path, max_seq_len: int) -> dict:
    """Our PTQ ``.pte`` of ``recipe`` (``bench_speed.export_ours``), in this (fresh) process."""
    import bench_speed

    from qharness.runtime.measure import peak_rss_mb
    from qharness.sources.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    stream_tokens = bench_speed.text_data(model_dir).train_x[:8]
    r = bench_speed.export_ours(model, tokenizer, recipe, max_seq_len, out, stream_tokens)
    return {**r, "export_peak_rss_mb": peak_rss_mb()}


def child_peer(model_dir: Path, name: str, out_dir: Path, max_seq_len: int) -> dict:
    """``export_llm``'s ``.pte`` of the same weights with ``PEERS[name]``, in this (fresh) process."""
    import bench_fastpath

    from qharness.runtime.measure import peak_rss_mb
    from qharness.sources.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(model_dir))
    r = bench_fastpath.export_theirs(
        model, PEERS[name], max_seq_len, out_dir, tokenizer.bos_token_id, [tokenizer.eos_token_id], fast_lowering=True
    )
    return {"path": str(r["path"]), "export_s": r["export_s"], "export_peak_rss_mb": peak_rss_mb()}


def in_child(*args: str) -> dict:
    """Run this script's ``--child`` mode in a fresh interpreter; its last ``RESULT`` line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-P", __file__, "--child", *args], capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="135m", choices=sorted(SHAPES))
    p.add_argument("--recipes", nargs="+", default=RECIPES, help=f"recipe names or YAML paths; {FPEMB}: see above")
    p.add_argument("--no-peer", action="store_true", help="no export_llm programs")
    p.add_argument("--peers", nargs="+", default=None, help="the recipes that get an export_llm peer (default: all)")
    p.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qharness-phone")
    p.add_argument("--out", type=Path, default=Path("runs/phone_scale"))
    p.add_argument("--max-seq-len", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=2, help="repetitions per fresh process (after a warm-up)")
    p.add_argument("--processes", type=int, default=2, help="fresh processes per program per run, alternating rounds")
    p.add_argument("--runs", type=int, default=2, help="joint runs (each with --processes rounds); 0: export only")
    p.add_argument("--reuse", action="store_true", help="time the .pte files an earlier invocation left in --out")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    model_dir = a.work / f"{a.shape}-random"
    out = a.out / a.shape
    if a.child:
        kind, name, recipe = a.child
        fn = child_export if kind == "ours" else child_peer
        args = (model_dir, name, recipe, out / f"{name}.pte") if kind == "ours" else (model_dir, name, out / name)
        print("RESULT " + json.dumps(fn(*args, a.max_seq_len)))
        return

    from qharness.runtime.joint import interleaved
    from qharness.runtime.measure import memory_bandwidth
    from qharness.runtime.spread import format_spread, pair_ratios, spread, verdict

    a.work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if not (model_dir / "config.json").is_file():
        print(f"building the random-init {NAMES[a.shape]}-shaped model in {model_dir} ...", flush=True)
        make_model(model_dir, a.shape)
    family = SHAPES[a.shape][0]
    peer_ok = family == "llama" and not a.no_peer
    record = out / "export.json"
    exports = json.loads(record.read_text()) if record.is_file() else {}
    programs = {}
    for name in a.recipes:
        path = out / f"{Path(name).stem}.pte"
        if not (a.reuse and name in exports and path.is_file()):
            print(f"[{a.shape}] exporting ours: {name} ...", flush=True)
            exports[name] = in_child("ours", Path(name).stem, recipe_arg(name, a.work), "--shape", a.shape, *_common(a))
            record.write_text(json.dumps(exports, indent=2))
        programs[name] = path
        peer = f"export_llm {name}"
        if peer_ok and name in PEERS and (a.peers is None or name in a.peers):
            if not (a.reuse and peer in exports and Path(exports[peer]["path"]).is_file()):
                print(f"[{a.shape}] exporting {peer} ...", flush=True)
                exports[peer] = in_child("peer", name, "-", "--shape", a.shape, *_common(a))
                record.write_text(json.dumps(exports, indent=2))
            programs[peer] = Path(exports[peer]["path"])
    if a.runs == 0:
        print(json.dumps(exports, indent=2))
        return
    vocab = SHAPES[a.shape][1]["vocab_size"]
    bandwidths = [memory_bandwidth()]  # before and after each joint run: the bound uses their median
    runs = []
    for k in range(a.runs):
        print(f"[{a.shape}] joint run {k + 1}/{a.runs}: {len(programs)} programs ...", flush=True)
        runs.append(
            interleaved(
                {n: {"kind": "pte", "path": str(pth), "vocab_size": vocab} for n, pth in programs.items()},
                a.prompt_len,
                a.decode_tokens,
                a.reps,
                a.processes,
            )
        )
        bandwidths.append(memory_bandwidth())
    bandwidth = spread(bandwidths)
    (out / "results.json").write_text(
        json.dumps({"bandwidth_gb_s": bandwidth, "exports": exports, "runs": runs}, indent=2, default=str)
    )
    print(table(a, runs, exports, bandwidth, format_spread, pair_ratios, spread, verdict))


def _common(a) -> list[str]:
    return ["--work", str(a.work), "--out", str(a.out), "--max-seq-len", str(a.max_seq_len)]


def table(a, runs, exports, bandwidth, format_spread, pair_ratios, spread, verdict) -> str:
    """The shape's Markdown table (all runs' process medians pooled per program) and the ratios and bound lines."""

    def pooled(name, key):
        return spread([v for r in runs for v in r["programs"][name][key]["per_process"]])

    first = runs[0]
    lines = [
        f"{NAMES[a.shape]} shape (random init), max_seq_len {a.max_seq_len}, prompt {a.prompt_len} tokens, "
        f"{a.decode_tokens} decode steps, {a.reps} reps x {a.processes} fresh processes per program per run, "
        f"{len(runs)} joint run(s), {first['threads']} threads, {os.cpu_count()} CPUs, load average "
        + ", ".join(f"{r['load_avg_1m'][0]:.1f}->{r['load_avg_1m'][1]:.1f}" for r in runs)
        + f"; copy bandwidth {format_spread(bandwidth, '.2f')} GB/s (bytes read + written; before and after each run)",
        "",
        "| program | .pte MiB | decode tok/s | prefill tok/s | peak RSS MiB | load s | decode / bw bound |"
        " export s | export peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in first["programs"].items():
        e = exports.get(name, {})
        dec = pooled(name, "decode_tok_s")
        frac = [v * p["weight_bytes"] / (bandwidth["median"] * 1e9) for v in dec["per_process"]]
        export_s = e.get("export_s", (e.get("export_quantize_s") or 0) + (e.get("lower_s") or 0))
        lines.append(
            f"| {name} | {p['size_bytes'] / 2**20:.0f} | {format_spread(dec, '.1f')} | "
            f"{format_spread(pooled(name, 'prefill_tok_s'), '.1f')} | {format_spread(pooled(name, 'peak_rss_mb'), '.0f')} | "
            f"{format_spread(pooled(name, 'load_s'), '.2f')} | {format_spread(spread(frac), '.0%')} | {export_s:.0f} | "
            f"{e.get('export_peak_rss_mb', 0):.0f} |"
        )
    lines.append("")
    for name in first["programs"]:
        peer = f"export_llm {name}"
        if peer not in first["programs"]:
            continue
        per_run = [
            pair_ratios(
                r["programs"][peer]["decode_tok_s"]["per_process"], r["programs"][name]["decode_tok_s"]["per_process"]
            )
            for r in runs
        ]
        allr = spread([v for s in per_run for v in s["per_process"]])
        pre = spread(
            [
                v
                for r in runs
                for v in pair_ratios(
                    r["programs"][peer]["prefill_tok_s"]["per_process"],
                    r["programs"][name]["prefill_tok_s"]["per_process"],
                )["per_process"]
            ]
        )
        lines.append(
            f"- {name}: decode ms/token ours / export_llm {format_spread(allr)} over {len(allr['per_process'])} rounds "
            f"({'; '.join(f'run {k + 1}: {format_spread(s)}' for k, s in enumerate(per_run))}); target <= 1.0: "
            f"{verdict(allr, 1.0, False)}{'' if len(runs) > 1 else ' (one run only)'}; prefill ms/token ratio "
            f"{format_spread(pre)}"
        )
    if a.shape == "1b":
        for name, p in first["programs"].items():
            if "8da4w" in name and not name.startswith("export_llm"):
                mib = p["size_bytes"] / 2**20
                lines.append(
                    f"- {name}: .pte {mib:.0f} MiB vs ExecuTorch's published {PUBLISHED_1B_4BIT_MIB} MiB for 4-bit: "
                    f"{'MET' if mib <= PUBLISHED_1B_4BIT_MIB else 'NOT MET'}"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
