"""Scale check (issues 7, 17): a model of a real shape (SmolLM2-135M's, Llama-3.2-1B's) through PTQ, export,
lowering and benchmark.

The model is random-init (the shapes are what matter for time and memory), saved with ``save_pretrained``
with a byte-level BPE tokenizer trained on the embedded corpus, under ``--work`` (built once). The stages
then run in one fresh process, as ``qharness calibrate`` runs them: load, static-KV-cache export +
``prepare_pt2e`` + calibration + ``convert_pt2e`` (``quantize_for_deploy``), lowering to ``.pte``
(``lower_to_pte``), then the ``.pte`` benchmark (``qharness.runtime.bench``, its own processes). Per stage: wall
time and the process's peak RSS during the stage (Linux ``VmHWM``, reset before each stage through
``/proc/self/clear_refs``). Targets per shape (``TARGETS``): 135m: export + lowering <= 2 minutes, peak RSS <= 4x
the FP32 model size; 1b: <= 5 minutes, <= 2.5x.

Usage::

    python scripts/scale.py [--shape 135m] [--recipe xnnpack_int8_dynamic] [--max-seq-len 512] [--work /tmp/qharness-scale]
    python scripts/scale.py --shape 1b --recipe xnnpack_8da4w --no-bench
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from qharness.runtime.measure import peak_rss_mb

ROOT = Path(__file__).resolve().parent.parent

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json)
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
    initializer_range=0.041666666666666664,
    bos_token_id=0,
    eos_token_id=0,
)
# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json; rope_scaling llama3 as there)
LLAMA32_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
    initializer_range=0.02,
    bos_token_id=0,
    eos_token_id=0,
)
SHAPES = {"135m": SMOLLM2_135M, "1b": LLAMA32_1B}
NAMES = {"135m": "SmolLM2-135M", "1b": "Llama-3.2-1B"}
TARGETS = {"135m": (120, 4.0), "1b": (300, 2.5)}  # export + lower seconds, peak RSS / FP32 weights


def make_model(out: Path, shape: str = "135m") -> None:
    """Random-init Llama of ``SHAPES[shape]`` + a BPE tokenizer of (at most) the same vocabulary, saved in ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from qharness.sources.text import embedded_corpus
    from qharness.sources.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(embedded_corpus(), SHAPES[shape]["vocab_size"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[shape], pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS (Linux only)")


class Stages:
    """Times each ``with stages("name"):`` block and records the process's peak RSS inside it."""

    def __init__(self):
        self.rows = []

    def __call__(self, name):
        stages = self

        class _Stage:
            def __enter__(self):
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
                self.rss0, self.t = _rss_mb(), time.perf_counter()

            def __exit__(self, *exc):
                if exc[0] is None:
                    stages.rows.append(
                        {
                            "stage": name,
                            "wall_s": time.perf_counter() - self.t,
                            "rss_start_mb": self.rss0,
                            "peak_rss_mb": peak_rss_mb(),
                        }
                    )

        return _Stage()


def run_stages(
    model_dir: Path, recipe_name: str, max_seq_len: int, calib_blocks: int, calib_len: int, out: Path
) -> dict:
    """The measured stages, in this process (call it in a fresh one)."""
    stages = Stages()
    with stages("import libraries"):
        import torch
        import transformers  # noqa: F401

        from qharness.deploy.deployed import export_path
        from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
        from qharness.recipes.registry import load_recipe
        from qharness.run.pipeline import eos_ids
        from qharness.sources.models import load_model_and_tokenizer
        from qharness.sources.text import embedded_corpus, tokenize_stream
        from qharness.training.calibration import calibrate
        from qharness.upstream import imports, process
        from qharness.upstream.fixes import xnnpack_scalars

        imports.pt2e(), xnnpack_scalars.xnnpack_quantizer_cls(), imports.executorch_backend_config()
    torch.manual_seed(0)
    process.map_large_allocations_separately()  # as qharness.run.pipeline.deploy_and_check does
    recipe = load_recipe(recipe_name)
    with stages("load model"):
        model, tokenizer = load_model_and_tokenizer(str(model_dir))
        fp32_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        stream = tokenize_stream(embedded_corpus(max_chars=200_000)[:50], tokenizer)
        blocks = stream[: calib_blocks * calib_len].view(calib_blocks, calib_len)
    with stages("export + PTQ calibrate + convert"):
        deployed = quantize_for_deploy(model, recipe, max_seq_len, lambda graph: calibrate(graph, blocks))
    meta = runner_metadata(max_seq_len, model.config.vocab_size, tokenizer.bos_token_id, eos_ids(model, tokenizer))
    del model
    with stages("lower to .pte"):
        pte = lower_to_pte(deployed, recipe, max_seq_len, meta)
        pte_path = out / f"{recipe_name}.pte"
        pte_path.write_bytes(pte)
    return {
        "stages": stages.rows,
        "fp32_bytes": fp32_bytes,
        "pte_path": str(pte_path),
        "pte_bytes": len(pte),
        "export_path": export_path(deployed),  # fast (custom_sdpa / update_cache) or generic (HF static cache)
        "params": fp32_bytes // 4,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="135m", choices=sorted(SHAPES))
    ap.add_argument("--recipe", default="xnnpack_int8_dynamic")
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--calib-blocks", type=int, default=8)
    ap.add_argument("--calib-len", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qharness-scale")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = args.work / f"{args.shape}-random"
    if args.child:
        result = run_stages(model_dir, args.recipe, args.max_seq_len, args.calib_blocks, args.calib_len, args.work)
        print("RESULT " + json.dumps(result))
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    args.work.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    if not (model_dir / "config.json").is_file():
        print(f"building the random-init {NAMES[args.shape]}-shaped model in {model_dir} ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-P",  # not the current directory on sys.path (the script's folder is added explicitly)
                "-c",
                f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import scale; "
                f"scale.make_model(__import__('pathlib').Path({str(model_dir)!r}), {args.shape!r})",
            ],
            check=True,
            env=env,
        )
    make_s = time.perf_counter() - t
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--shape",
        args.shape,
        "--recipe",
        args.recipe,
        "--max-seq-len",
        str(args.max_seq_len),
        "--calib-blocks",
        str(args.calib_blocks),
        "--calib-len",
        str(args.calib_len),
        "--work",
        str(args.work),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        sys.exit(f"stages failed:\n{r.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    rows = result["stages"]
    if not args.no_bench:
        from qharness.runtime.bench import bench

        t = time.perf_counter()
        b = bench(result["pte_path"], str(model_dir), prompt_len=64, decode_tokens=32, reps=2)
        rows.append(
            {
                "stage": ".pte benchmark (own processes)",
                "wall_s": time.perf_counter() - t,
                "rss_start_mb": b.pte.base_rss_mb,
                "peak_rss_mb": b.pte.peak_rss_mb,
            }
        )
        result["bench"] = b  # a runtime.bench_record.Bench

    fp32_mb = result["fp32_bytes"] / 2**20
    print(
        f"\n{NAMES[args.shape]} shape, random init: {result['params'] / 1e6:.1f}M parameters, FP32 {fp32_mb:.0f} MiB; "
        f"recipe {args.recipe}, max_seq_len {args.max_seq_len}, calibration {args.calib_blocks}x{args.calib_len} tokens; "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    if make_s > 1:
        print(f"(building the model and tokenizer once: {make_s:.0f} s, not counted)")
    print(f"{'stage':36s} {'wall s':>8s} {'RSS at start MiB':>17s} {'peak RSS MiB':>13s} {'peak / FP32':>12s}")
    for row in rows:
        print(
            f"{row['stage']:36s} {row['wall_s']:8.1f} {row['rss_start_mb']:17.0f} {row['peak_rss_mb']:13.0f} {row['peak_rss_mb'] / fp32_mb:11.2f}x"
        )
    export_lower = sum(r["wall_s"] for r in rows if r["stage"] in ("export + PTQ calibrate + convert", "lower to .pte"))
    peak = max(r["peak_rss_mb"] for r in rows)
    print(f".pte: {result['pte_path']} ({result['pte_bytes'] / 1e6:.1f} MB), export path: {result['export_path']}")
    if "bench" in result:
        p, eager = result["bench"].pte, result["bench"].eager
        print(
            f".pte decode {p.decode_tok_s.median:.1f} tok/s, prefill {p.prefill_tok_s.median:.1f} tok/s "
            f"(eager FP32: decode {eager.decode_tok_s.median:.1f} tok/s)"
        )
    max_s, max_ratio = TARGETS[args.shape]
    ok1, ok2 = export_lower <= max_s, peak <= max_ratio * fp32_mb
    print(f"target export + lower <= {max_s} s: {export_lower:.0f} s {'MET' if ok1 else 'MISSED'}")
    print(
        f"target peak RSS <= {max_ratio}x FP32 ({max_ratio * fp32_mb:.0f} MiB): {peak:.0f} MiB = {peak / fp32_mb:.2f}x "
        f"{'MET' if ok2 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
