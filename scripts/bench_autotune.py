"""Autotune benchmark: does a per-layer assignment chosen by ``qharness autotune`` under a size
budget beat, at equal or smaller ``.pte`` size, the best uniform recipe of that size, beyond the noise?

On the benchmark model of ``bench_quality.py`` (the embedded architecture pretrained on tinyshakespeare), one
``qharness sweep`` runs, all PTQ, each ``.pte`` scored through the ExecuTorch runtime on the same held-out blocks:

- ``xnnpack_fp32`` (FP), ``8da8w_pc`` (int8 per channel), ``xnnpack_8da4w`` (int4 groups of 32), ``8da4w_pc``
  (int4 per channel): the uniform recipes, every linear at one scheme (torchao source-level, as autotune's);
- ``autotune_<B>mb``: ``qharness autotune`` at ``--budget`` MB (default: halfway between the int4-g32 and int8
  ``.pte`` sizes, predicted from the model), its sensitivity table measured in its own run;
- ``autotuned_rerun``: the ``autotuned.yaml`` it wrote, run again as a plain recipe (same size and ppl expected).

Printed: the table (size, ``.pte`` ppl with its paired interval against FP), autotune's predicted against measured
size and ppl, and the paired per-block 95% interval (``checks/stats.py``) of the autotuned ``.pte`` against the best
uniform recipe no larger than it. The sweep's report (``report.md``, ``pareto.png``, ``pareto_size.png``) lies in
``--out``.

    python scripts/bench_autotune.py                    # ~20-30 min on the 2-core CI machine
    python scripts/bench_autotune.py --budget 1.9 --eval_blocks 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import DEFAULT_CORPUS, PRETRAIN_STEPS, benchmark_model  # noqa: E402

UNIFORM = {  # run name -> recipe (files written into --out for the two not shipped)
    "xnnpack_fp32": "xnnpack_fp32",
    "8da8w_pc": "8da8w_pc.yaml",
    "xnnpack_8da4w": "xnnpack_8da4w",
    "8da4w_pc": "8da4w_pc.yaml",
}


def recipe_files(out: Path) -> None:
    (out / "8da8w_pc.yaml").write_text(
        "# uniform int8 per-channel weights, int8 dynamic activations (torchao, as autotune's 8da8w-pc layers)\n"
        "base: xnnpack_8da4w\ndescription: XNNPACK 8da8w per channel (uniform)\n"
        "quantizer: {weight_bits: 8, group_size: null}\n"
    )
    (out / "8da4w_pc.yaml").write_text(
        "# uniform int4 per-channel weights, int8 dynamic activations (as autotune's 8da4w-pc layers)\n"
        "base: xnnpack_8da4w\ndescription: XNNPACK 8da4w per channel (uniform)\nquantizer: {group_size: null}\n"
    )


def predicted_sizes(model_dir: Path, max_seq_len: int) -> dict[str, int]:
    """Uniform ``.pte`` bytes as autotune predicts them (its size model), to place the default budget."""
    import torch
    from transformers import AutoModelForCausalLM

    from qharness.evaluation.autotune import rest_bytes
    from qharness.evaluation.sensitivity import weight_bytes

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    table = {"units": [{"name": n, "layers": [n]} for n in linears]}
    rest = rest_bytes(model, table, max_seq_len)
    return {s: rest + sum(weight_bytes(m, s) for m in linears.values()) for s in ("8da8w-pc", "8da4w-g32", "8da4w-pc")}


def sweep_config(out: Path, model_dir: Path, corpus: str, budget: float, args, rerun: Path | None) -> Path:
    runs = [{"recipe": str(out / r) if r.endswith(".yaml") else r, "modes": ["ptq"]} for r in UNIFORM.values()][1:]
    runs.append({"autotune": {"max_size_mb": budget}, "modes": ["ptq"]})
    if rerun is not None:
        runs.append({"recipe": str(rerun), "modes": ["ptq"], "name": "autotuned_rerun"})
    config = {
        "sweep_dir": str(out / "sweep"),
        "baseline": "xnnpack_fp32",
        "runs": runs,
        "config": {
            "model": {"checkpoint": str(model_dir)},
            "data": {"source": corpus, "seq_len": 128, "batch_size": 16},
            "deploy": {"max_seq_len": args.max_seq_len},
            "parity": {"eval_blocks": args.eval_blocks},
            "calibration": {"blocks": 32},
            "bench": {"prompt_len": 64, "decode_tokens": 32, "reps": 3},
            "eval": {"enabled": False},
            "wandb": {"enabled": False},
        },
        # joint benchmark once, at the end of the second pass (the first pass has no re-run yet)
        "report": {
            "metric": "ppl",
            "bench_processes": args.bench_processes if rerun is not None else 0,
            "wandb": False,
            "max_size_mb": budget,
        },
    }
    path = out / "sweep.yaml"
    path.write_text("# written by scripts/bench_autotune.py\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def summary(run_dir: Path):
    """The run's ``RunSummary`` (None: the run did not finish)."""
    from qharness.run.summary import RunSummary

    path = run_dir / "summary.json"
    return RunSummary.read(path) if path.is_file() else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="text file to pretrain and evaluate on")
    p.add_argument("--pretrain_steps", type=int, default=PRETRAIN_STEPS)
    p.add_argument("--budget", type=float, default=None, help=".pte MB for autotune (default: int4-g32/int8 midpoint)")
    p.add_argument("--eval_blocks", type=int, default=64, help="held-out blocks of 128 tokens scored on every .pte")
    p.add_argument("--max_seq_len", type=int, default=256)
    p.add_argument("--bench_processes", type=int, default=3, help="joint benchmark: fresh processes per .pte")
    p.add_argument("--out", default="runs/bench_autotune")
    p.add_argument("--force", action="store_true", help="redo every run (the pretrained model stays cached)")
    a = p.parse_args(argv)
    from qharness.upstream import quiet

    quiet.install()  # the known-harmless upstream lines hidden, as in the CLI (QHARNESS_VERBOSE=1 shows them)
    corpus = Path(a.corpus).expanduser()
    if not corpus.exists():
        sys.exit(f"error: --corpus {corpus} does not exist. fix: pass --corpus PATH (a text file)")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    t0 = time.perf_counter()
    model_dir = benchmark_model(str(corpus.resolve()), a.pretrain_steps)
    recipe_files(out)
    sizes = predicted_sizes(model_dir, a.max_seq_len)
    budget = a.budget or round((sizes["8da4w-g32"] + sizes["8da8w-pc"]) / 2 / 1e4) / 100
    from qharness.api.jobs import sweep
    from qharness.errors import UserError

    # each sweep run is a child process (by design): it finds this checkout's qharness
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    sweep_dir = out / "sweep"
    tuned_dir = sweep_dir / f"autotune_{budget:g}mb-ptq"
    for rerun in (None, tuned_dir / "autotuned.yaml"):  # the second pass adds the re-run of the written recipe
        if rerun is not None and not rerun.is_file():
            break
        config = sweep_config(out, model_dir, str(corpus), budget, a, rerun)
        force = a.force and rerun is None
        print(f"$ qharness sweep {config}{' --force' if force else ''}", flush=True)
        try:
            sweep(config, force=force)  # a failed run is recorded in the sweep and reported below as not finished
        except UserError as e:
            sys.exit(f"error: {e}")
    wall = time.perf_counter() - t0

    from qharness.checks.stats import paired_ratio

    runs = {n: summary(sweep_dir / f"{n}-ptq") for n in [*UNIFORM, f"autotune_{budget:g}mb", "autotuned_rerun"]}
    fp = runs["xnnpack_fp32"]
    print(
        f"\nbenchmark model {model_dir}; {a.eval_blocks} held-out blocks of 128 tokens; budget {budget:g} MB "
        f"(predicted uniform sizes: {', '.join(f'{k} {v / 1e6:.3f} MB' for k, v in sizes.items())}); "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; wall {wall / 60:.1f} min"
    )
    rows = [("run", ".pte bytes", ".pte ppl", "vs FP [95% paired]", "layers")]
    for name, s in runs.items():
        if s is None:
            rows.append((name, "-", "-", "not finished", ""))
            continue
        m = s.metrics["pte"]
        r = paired_ratio(m.block_losses, fp.metrics["pte"].block_losses) if fp else None
        vs = (
            "-"
            if r is None or name == "xnnpack_fp32"
            else f"{r['ppl_ratio'] - 1:+.2%} [{r['ci'][0] - 1:+.2%}, {r['ci'][1] - 1:+.2%}]"
        )
        layers = ", ".join(f"{n} x {k}" for k, n in sorted(s.layers.counts.items())) if s.layers else ""
        rows.append((name, f"{s.pte.size_bytes:,}", f"{m.ppl:.3f}", vs, layers))
    width = [max(len(r[i]) for r in rows) for i in range(5)]
    print("\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows))

    tuned = runs[f"autotune_{budget:g}mb"]
    if tuned is None:
        sys.exit("autotune run did not finish: see its sweep.log")
    plan = json.loads((tuned_dir / "autotune.json").read_text())
    print(
        f"autotune: predicted {plan['predicted_size_bytes']:,} bytes, measured {plan['measured_size_bytes']:,} "
        f"({(plan['measured_size_bytes'] - plan['predicted_size_bytes']) / plan['measured_size_bytes']:+.2%}); "
        f"predicted ppl {plan['predicted_ppl']:.3f}, .pte ppl {plan['measured_ppl_pte']:.3f}"
    )
    size = tuned.pte.size_bytes
    uniform = {n: s for n, s in runs.items() if n in UNIFORM and n != "xnnpack_fp32" and s is not None}
    fits = {n: s for n, s in uniform.items() if s.pte.size_bytes <= size}
    if fits:
        best = min(fits, key=lambda n: fits[n].metrics["pte"].ppl)
        r = paired_ratio(tuned.metrics["pte"].block_losses, fits[best].metrics["pte"].block_losses)
        lo, hi = r["ci"]
        verdict = (
            "BEATS it beyond the noise"
            if hi < 1
            else "worse beyond the noise"
            if lo > 1
            else "a tie (inside the noise)"
        )
        print(
            f"autotuned ({size:,} bytes) vs the best uniform recipe no larger, {best} ({fits[best].pte.size_bytes:,} "
            f"bytes): ppl {r['ppl_ratio'] - 1:+.2%} [{lo - 1:+.2%}, {hi - 1:+.2%}] (95%, paired over "
            f"{len(tuned.metrics['pte'].block_losses)} blocks): {verdict}"
        )
    rerun = runs["autotuned_rerun"]
    if rerun is not None:
        print(
            f"re-run of autotuned.yaml: {rerun.pte.size_bytes:,} bytes (autotune {size:,}), ppl "
            f"{rerun.metrics['pte'].ppl:.4f} (autotune {tuned.metrics['pte'].ppl:.4f}); same program: "
            f"{rerun.pte.sha256 == tuned.pte.sha256}"
        )
    (out / "results.json").write_text(
        json.dumps({"budget_mb": budget, "sizes": sizes, "plan": plan, "wall_s": wall}, indent=2)
    )


if __name__ == "__main__":
    main()
