"""Lowering time, upstream vs qharness (``qharness.upstream.lowering.fast_lowering``), side by side, and whether the .pte is the same.

For each model and recipe the deployable graph is built (``quantize_for_deploy``, fixed calibration data)
and lowered by ``lower_to_pte`` in a fresh process, once with ``QHARNESS_UPSTREAM_LOWERING=1`` (ExecuTorch
as it ships) and once without; the runs alternate. Wall and CPU seconds of ``lower_to_pte`` are printed
with the ratio and whether both ``.pte`` files are byte for byte the same.

Models: ``tiny`` (2 layers, dim 64, random init, like the tests' model) and ``embedded`` (the default).

Usage::

    python scripts/lower_speed.py [--models tiny embedded] [--recipes xnnpack_fp32 xnnpack_int8_dynamic xnnpack_8da4w] [--reps 1]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def model_dir(name: str, work: Path) -> str:
    if name != "tiny":
        from qharness.sources.models import resolve_checkpoint

        return resolve_checkpoint(name)
    out = work / "tiny-llama"
    if not (out / "config.json").is_file():
        import torch

        from qharness.sources.embedded import EmbeddedSpec, new_llama
        from qharness.sources.text import embedded_corpus
        from qharness.sources.tokenizer import train_bpe_tokenizer

        tok = train_bpe_tokenizer(embedded_corpus(max_chars=200_000), 384)
        spec = EmbeddedSpec(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        torch.manual_seed(0)
        new_llama(spec, len(tok)).save_pretrained(out)
        tok.save_pretrained(out)
    return str(out)


def child(path: str, recipe_name: str, max_seq_len: int) -> dict:
    import torch

    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(path)
    recipe = load_recipe(recipe_name)
    blocks = torch.randint(0, len(tok), (4, 32), generator=torch.Generator().manual_seed(0))

    def calibrate(graph):
        for b in blocks:
            graph(b[None], torch.tensor([0]))

    deployed = quantize_for_deploy(model, recipe, max_seq_len, calibrate)
    wall, cpu = time.perf_counter(), time.process_time()
    pte = lower_to_pte(deployed, recipe, max_seq_len, {"get_max_seq_len": max_seq_len})
    return {
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "sha256": hashlib.sha256(pte).hexdigest(),
        "bytes": len(pte),
    }


def run_child(path: str, recipe: str, max_seq_len: int, upstream: bool) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
    )
    env.pop("QHARNESS_UPSTREAM_LOWERING", None)
    if upstream:
        env["QHARNESS_UPSTREAM_LOWERING"] = "1"
    cmd = [sys.executable, __file__, "--child", json.dumps([path, recipe, max_seq_len])]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"lowering {recipe} failed:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "embedded"])
    ap.add_argument("--recipes", nargs="+", default=["xnnpack_fp32", "xnnpack_int8_dynamic", "xnnpack_8da4w"])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--max-seq-len", type=int, default=64)
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qharness-lower-speed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*json.loads(args.child))))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    print(
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; lower_to_pte, median of {args.reps} fresh process(es) each"
    )
    header = f"{'model':9s} {'recipe':22s} {'upstream wall/cpu s':>20s} {'qharness wall/cpu s':>20s} {'speed-up (cpu)':>15s}  same .pte"
    print(header)
    for name in args.models:
        path = model_dir(name, args.work)
        for recipe in args.recipes:
            runs = {True: [], False: []}
            for _ in range(args.reps):
                for upstream in (True, False):
                    runs[upstream].append(run_child(path, recipe, args.max_seq_len, upstream))
            med = {
                k: (statistics.median(r["wall_s"] for r in v), statistics.median(r["cpu_s"] for r in v))
                for k, v in runs.items()
            }
            same = {r["sha256"] for r in runs[True] + runs[False]}
            print(
                f"{name:9s} {recipe:22s} {med[True][0]:10.1f}/{med[True][1]:<9.1f} {med[False][0]:10.1f}/{med[False][1]:<9.1f} "
                f"{med[True][1] / med[False][1]:14.2f}x  {'yes' if len(same) == 1 else 'NO'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
