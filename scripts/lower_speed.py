"""Lowering time of ``lower_program``, side by side in fresh processes, alternating, and whether the .pte is the same.

Sides: ``upstream`` (this checkout with ``QHARNESS_UPSTREAM_LOWERING=1``: ExecuTorch as it ships), ``qharness`` (this
checkout, ``qharness.upstream.lowering.fast_lowering``) and ``baseline`` (the qharness of another checkout,
``--baseline DIR``, e.g. a worktree of main: before/after a change). Every round runs each side once in a fresh
process, every other round in reverse order (a side's place in the round weighs on its time on a busy machine).
Printed per side: median wall and CPU seconds of ``lower_program`` with their range over rounds, its phases
(export, decompositions, Edge + partitioning + delegation, of which the backends' preprocess, to_executorch), the
median ratio against the first side with its range, "tie" where the ranges overlap, and whether every .pte is byte
for byte the same.

The deployable graph is built once per model, recipe and length (``quantize_for_deploy`` with fixed random
calibration tokens) and saved as the program ``lower_program`` re-exports (``torch.export.save`` under ``--work``);
each timed process loads it and lowers its ``module()``. Models: ``tiny`` (2 layers, dim 64, random init, like the
tests' model), ``embedded`` (the default), or any checkpoint (an HF directory, e.g. /work/models/smollm2-hf).

``--profile FILE``: one more ``qharness`` process under cProfile (stats to FILE, the top entries printed).

Usage::

    python scripts/lower_speed.py --models /work/models/smollm2-hf --recipes xnnpack_8da4w --max-seq-len 512 \\
        --sides baseline qharness --baseline /tmp/main-worktree --reps 3
    python scripts/lower_speed.py [--models tiny embedded] [--recipes xnnpack_fp32 xnnpack_int8_dynamic] [--reps 1]
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
PHASES = ("export", "decompositions", "edge_and_delegation", "preprocess", "to_executorch")


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


def graph_file(work: Path, path: str, recipe: str, max_seq_len: int) -> Path:
    key = hashlib.sha256(json.dumps([str(Path(path).resolve()), recipe, max_seq_len]).encode()).hexdigest()[:16]
    return work / "graphs" / f"{recipe}-{max_seq_len}-{key}.pt2"


def build(path: str, recipe_name: str, max_seq_len: int, out: str) -> dict:
    """The deployable graph, re-exported as ``lower_program`` does, saved with its export path."""
    import torch

    from qharness.deploy.deployed import export_path, record_of
    from qharness.deploy.fastpath.decoder import dynamic_shapes, example_inputs
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(path)
    recipe = load_recipe(recipe_name)
    blocks = torch.randint(0, len(tok), (4, 32), generator=torch.Generator().manual_seed(0))

    def calibrate(graph):
        for b in blocks:
            graph(b[None], torch.tensor([0]))

    deployed = quantize_for_deploy(model, recipe, max_seq_len, calibrate)
    for p in deployed.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        ep = torch.export.export(deployed, example_inputs(max_seq_len), dynamic_shapes=dynamic_shapes(max_seq_len))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(ep, out + ".tmp")
    os.replace(out + ".tmp", out)
    record = record_of(deployed)
    Path(out + ".json").write_text(json.dumps({"export_path": export_path(deployed), "kv_cache": record.kv_cache}))
    return {"built": out}


def timed_phases() -> dict:
    """Seconds spent in each lowering phase, filled as ``lower_program`` runs (its calls wrapped where it makes them)."""
    import executorch.exir.backend.backend_api as backend_api
    from executorch.exir.program._program import EdgeProgramManager

    from qharness.upstream import imports, lowering

    spent = dict.fromkeys(PHASES, 0.0)

    def wrap(owner, name, phase):
        upstream = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return upstream(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - t

        setattr(owner, name, timed)

    wrap(lowering, "export_for_lowering", "export")
    wrap(lowering, "decompose_for_lowering", "decompositions")
    wrap(imports, "to_edge_transform_and_lower", "edge_and_delegation")
    wrap(backend_api, "lower_all_submodules_to_backend", "preprocess")
    wrap(EdgeProgramManager, "to_executorch", "to_executorch")
    return spent


def child(path: str, recipe_name: str, max_seq_len: int, graph: str, profile: str | None) -> dict:
    import torch

    from qharness.upstream.fixes.custom_sdpa import llm_custom_ops

    llm_custom_ops()  # the fast path's llama:: ops, before the saved program is read
    import torchao.quantization.quant_primitives  # noqa: F401  torchao:: ops

    from qharness.deploy.deployed import DeployRecord, stamp
    from qharness.deploy.lower import lower_program
    from qharness.recipes.registry import load_recipe

    saved = json.loads(Path(graph + ".json").read_text())
    deployed = torch.export.load(graph).module()
    stamp(deployed, DeployRecord(export_path=saved["export_path"], fallback_reason=None, kv_cache=saved["kv_cache"]))
    recipe = load_recipe(recipe_name)
    metadata = {"get_max_seq_len": max_seq_len, "use_sdpa_with_kv_cache": False}
    spent = timed_phases()
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    wall, cpu = time.perf_counter(), time.process_time()
    pte = lower_program(deployed, recipe, max_seq_len, metadata).pte
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    return {"wall_s": wall, "cpu_s": cpu, "sha256": hashlib.sha256(pte).hexdigest(), "bytes": len(pte), **spent}


def run_child(args: list, side: str, root: Path, work: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    env.update(HF_HUB_OFFLINE="1", TMPDIR=str(work))
    env.pop("QHARNESS_UPSTREAM_LOWERING", None)
    if side == "upstream":
        env["QHARNESS_UPSTREAM_LOWERING"] = "1"
    cmd = [sys.executable, "-P", __file__, "--child", json.dumps(args)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{side} {args[:3]} failed:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} ({min(values):.1f}-{max(values):.1f})"


def compare(first: list[dict], other: list[dict], key: str) -> str:
    """``other``'s median time over ``first``'s (speed-up of ``other`` when above 1), its range over every pair of
    processes, and "tie" when the two sides' ranges overlap."""
    a, b = [r[key] for r in first], [r[key] for r in other]
    ratio = statistics.median(a) / statistics.median(b)
    tie = min(a) <= max(b) and min(b) <= max(a)
    return f"{ratio:.2f}x ({min(a) / max(b):.2f}-{max(a) / min(b):.2f}){' tie' if tie else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "embedded"])
    ap.add_argument("--recipes", nargs="+", default=["xnnpack_fp32", "xnnpack_int8_dynamic", "xnnpack_8da4w"])
    ap.add_argument(
        "--sides", nargs="+", default=["upstream", "qharness"], choices=["upstream", "qharness", "baseline"]
    )
    ap.add_argument("--baseline", type=Path, help="checkout whose qharness is the 'baseline' side (e.g. main's)")
    ap.add_argument("--reps", type=int, default=1, help="rounds: each side once per round, in fresh processes")
    ap.add_argument("--max-seq-len", type=int, default=64)
    ap.add_argument("--profile", help="cProfile stats of one more 'qharness' process to this file")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "qharness-lower-speed")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--build", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*json.loads(args.child))))
        return
    if args.build:
        print("RESULT " + json.dumps(build(*json.loads(args.build))))
        return
    if "baseline" in args.sides and (args.baseline is None or not (args.baseline / "qharness").is_dir()):
        ap.error("--sides baseline needs --baseline DIR, a checkout holding qharness/")
    roots = {"upstream": ROOT, "qharness": ROOT, "baseline": args.baseline}
    args.work.mkdir(parents=True, exist_ok=True)
    print(
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; lower_program, {args.reps} round(s) of fresh processes"
    )
    for name in args.models:
        path = model_dir(name, args.work)
        for recipe in args.recipes:
            graph = graph_file(args.work, path, recipe, args.max_seq_len)
            if not graph.is_file():
                t = time.perf_counter()
                cmd = [
                    sys.executable,
                    "-P",
                    __file__,
                    "--build",
                    json.dumps([path, recipe, args.max_seq_len, str(graph)]),
                ]
                env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
                subprocess.run(cmd, check=True, capture_output=True, env=env)
                print(f"{name} {recipe}: deployable graph built in {time.perf_counter() - t:.0f}s ({graph})")
            runs = {side: [] for side in args.sides}
            for rnd in range(args.reps):
                for side in args.sides if rnd % 2 == 0 else args.sides[::-1]:
                    r = run_child([path, recipe, args.max_seq_len, str(graph), None], side, roots[side], args.work)
                    runs[side].append(r)
                    print(f"  round {rnd + 1} {side:9s} wall {r['wall_s']:6.1f}s cpu {r['cpu_s']:6.1f}s", flush=True)
            same = {r["sha256"] for rs in runs.values() for r in rs}
            first = args.sides[0]
            print(f"{name} {recipe} (max_seq_len {args.max_seq_len}): same .pte in every process: {len(same) == 1}")
            print(f"  {'side':9s} {'wall s':>18s} {'cpu s':>18s}   " + " ".join(f"{p:>14s}" for p in PHASES))
            for side, rs in runs.items():
                phases = " ".join(f"{statistics.median(r[p] for r in rs):14.1f}" for p in PHASES)
                ratio = "" if side == first else f"   {first}/{side}: wall {compare(runs[first], rs, 'wall_s')}"
                ratio += "" if side == first else f", cpu {compare(runs[first], rs, 'cpu_s')}"
                print(
                    f"  {side:9s} {spread([r['wall_s'] for r in rs]):>18s} {spread([r['cpu_s'] for r in rs]):>18s}   {phases}{ratio}"
                )
            if args.profile:
                child_args = [path, recipe, args.max_seq_len, str(graph), str(Path(args.profile).resolve())]
                r = run_child(child_args, "qharness", ROOT, args.work)
                import pstats

                print(f"  profile of one qharness process (wall {r['wall_s']:.1f}s under cProfile): {args.profile}")
                pstats.Stats(args.profile).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
