"""Quality benchmark (issue 9): how much of PTQ's perplexity loss QAT recovers, per XNNPACK recipe.

The benchmark model is the embedded default's architecture (~1M-parameter Llama, GQA, tied embeddings) with
its own BPE tokenizer, pretrained to convergence on ``--corpus`` (default: tinyshakespeare beside the
project), cached. On it, ``qharness sweep`` runs, each in its own process through the ordinary CLI:

- ``xnnpack_fp32`` (the FP ``.pte``): ppl_fp;
- per recipe, PTQ (``qharness calibrate``) and QAT (``qharness fit``, ``--qat_steps`` steps);
- a control: the FP model fine-tuned with the same steps, data and learning rate (``qharness fit`` with an
  fp32 recipe that allows training), which tells how much of QAT's gain is plain fine-tuning.

Every perplexity is the ``.pte``'s, through the ExecuTorch runtime, on the same held-out blocks (the last 10%
of the corpus, never trained on). Printed per recipe: ppl_ptq, ppl_qat and the recovered fraction
(ppl_ptq - ppl_qat) / (ppl_ptq - ppl_fp). Targets: >= 75% for the 4-bit recipes; int8 recipes within 1% of
ppl_fp. Re-running reuses the cached model and finished runs (``--force`` redoes the runs).

    python scripts/bench_quality.py                         # tinyshakespeare, 3 recipes, about 30 min here
    python scripts/bench_quality.py --corpus my.txt --recipes xnnpack_8da4w --qat_steps 200
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
RECIPES = ["xnnpack_int8_dynamic", "xnnpack_int4w_dynamic", "xnnpack_8da4w"]
FOUR_BIT = {"xnnpack_int4w_dynamic", "xnnpack_8da4w"}
PRETRAIN_STEPS = (
    1500  # tinyshakespeare's held-out loss is lowest here (3.92 at 1500 of 3000 steps; 3.98 at 3000: overfit)
)


def benchmark_model(corpus: str, steps: int) -> Path:
    """The embedded architecture pretrained on ``corpus`` for ``steps`` steps (cached; see qharness.sources.models)."""
    from qharness.sources.embedded import EmbeddedSpec, embedded_dir

    return embedded_dir(replace(EmbeddedSpec(), steps=steps), str(corpus))


def fp_finetune_recipe(out: Path) -> Path:
    """An fp32 recipe that allows ``fit``: the FP fine-tuning control (same pipeline, no fake quantization)."""
    path = out / "fp32_finetune.yaml"
    path.write_text(
        "# fp32 with training allowed: the FP fine-tuning control of bench_quality.py\n"
        "base: xnnpack_fp32\ndescription: XNNPACK fp32, FP fine-tuned (control)\nmodes: [qat]\n"
    )
    return path


def sweep_config(out: Path, model_dir: Path, corpus: str, recipes: list[str], args) -> Path:
    config = {
        "sweep_dir": str(out / "sweep"),
        "baseline": "xnnpack_fp32",
        "runs": [{"recipe": str(fp_finetune_recipe(out)), "modes": ["qat"]}]
        + [{"recipe": r, "modes": ["ptq", "qat"]} for r in recipes],
        "config": {
            "model": {"checkpoint": str(model_dir), "lr": args.lr, "warmup_steps": max(1, args.qat_steps // 10)},
            "data": {"source": str(corpus), "seq_len": 128, "batch_size": args.batch_size},
            "trainer": {
                "max_steps": args.qat_steps,
                "val_check_interval": min(args.qat_steps, 100),
                "limit_val_batches": 8,
            },
            "deploy": {"max_seq_len": 256},
            "parity": {"eval_blocks": args.eval_blocks},
            "calibration": {"blocks": 64},
            "bench": {"enabled": False},
            "eval": {"enabled": False},
            "wandb": {"enabled": False},
        },
        "report": {"metric": "ppl"},
    }
    path = out / "sweep.yaml"
    path.write_text("# written by scripts/bench_quality.py\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def pte_ppl(run_dir: Path) -> float | None:
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return None
    return json.loads(summary.read_text())["metrics"]["pte"]["ppl"]


def recovery_rows(sweep_dir: Path, recipes: list[str]) -> tuple[float, float | None, list[dict]]:
    ppl_fp = pte_ppl(sweep_dir / "xnnpack_fp32-ptq")
    ppl_ft = pte_ppl(sweep_dir / "fp32_finetune-qat")
    if ppl_fp is None:
        sys.exit(f"the FP baseline run did not finish: see {sweep_dir / 'xnnpack_fp32-ptq' / 'sweep.log'}")
    rows = []
    for r in recipes:
        ptq, qat = pte_ppl(sweep_dir / f"{r}-ptq"), pte_ppl(sweep_dir / f"{r}-qat")
        row = {"recipe": r, "ppl_fp": ppl_fp, "ppl_ptq": ptq, "ppl_qat": qat, "recovered": None}
        if ptq is not None and qat is not None and ptq != ppl_fp:
            row["recovered"] = (ptq - qat) / (ptq - ppl_fp)
        if ppl_ft is not None and ptq is not None and qat is not None and ptq != ppl_ft:
            row["recovered_vs_finetuned_fp"] = (ptq - qat) / (ptq - ppl_ft)
        rows.append(row)
    return ppl_fp, ppl_ft, rows


def verdict(row: dict) -> str:
    def pct(v):
        return "n/a" if v is None else f"{v:.1%}"

    if row["ppl_ptq"] is None or row["ppl_qat"] is None:
        return "a run failed (see its sweep.log)"
    if row["recipe"] in FOUR_BIT:
        ok = row["recovered"] is not None and row["recovered"] >= 0.75
        return f"recovered {pct(row['recovered'])} (target >= 75%): {'MET' if ok else 'NOT MET'}"
    worst = max(row["ppl_ptq"], row["ppl_qat"]) / row["ppl_fp"] - 1
    return f"PTQ {row['ppl_ptq'] / row['ppl_fp'] - 1:+.2%}, QAT {row['ppl_qat'] / row['ppl_fp'] - 1:+.2%} of FP (target within 1%): {'MET' if worst <= 0.01 else 'NOT MET'}"


def format_rows(ppl_fp: float, ppl_ft: float | None, rows: list[dict]) -> str:
    def f(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    table = [
        ("recipe", "ppl FP", "ppl PTQ", "ppl QAT", "PTQ - FP", "QAT - FP", "recovered", "recovered vs FP fine-tuned")
    ]
    for r in rows:
        d = lambda v: None if v is None else v - ppl_fp
        table.append(
            (
                r["recipe"],
                f(ppl_fp),
                f(r["ppl_ptq"]),
                f(r["ppl_qat"]),
                f(d(r["ppl_ptq"]), "+.3f"),
                f(d(r["ppl_qat"]), "+.3f"),
                f(r["recovered"], ".1%"),
                f(r.get("recovered_vs_finetuned_fp"), ".1%"),
            )
        )
    width = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, width)) for row in table]
    if ppl_ft is not None:
        lines.append(
            f"control: the FP model fine-tuned with the QAT runs' steps and learning rate: .pte ppl {ppl_ft:.3f} ({ppl_ft / ppl_fp - 1:+.2%} of FP)"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--corpus", default=str(DEFAULT_CORPUS), help="text file (or data.source) to pretrain and evaluate on"
    )
    p.add_argument("--recipes", nargs="+", default=RECIPES)
    p.add_argument("--out", default="runs/bench_quality", help="directory of the sweep, its runs and results.json")
    p.add_argument(
        "--pretrain_steps",
        type=int,
        default=PRETRAIN_STEPS,
        help="pretraining steps of the benchmark model (batch 16 x 128)",
    )
    p.add_argument("--qat_steps", type=int, default=200, help="QAT (and FP control) optimizer steps")
    p.add_argument("--lr", type=float, default=2e-4, help="peak learning rate of QAT (cosine decay after 10%% warm-up)")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--eval_blocks", type=int, default=64, help="held-out blocks of 128 tokens scored on every .pte")
    p.add_argument("--force", action="store_true", help="redo every run (the pretrained model stays cached)")
    a = p.parse_args(argv)
    corpus = Path(a.corpus).expanduser()
    if not corpus.exists():
        sys.exit(
            f"error: --corpus {corpus} does not exist. fix: pass --corpus PATH (a text file), "
            f"or put tinyshakespeare at {DEFAULT_CORPUS}"
        )
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    t0 = time.perf_counter()
    model_dir = benchmark_model(str(corpus.resolve()), a.pretrain_steps)
    info = json.loads((model_dir / "qharness_pretrain.json").read_text())
    t_pretrain = time.perf_counter() - t0
    cmd = [
        sys.executable,
        "-m",
        "qharness",
        "sweep",
        str(sweep_config(out, model_dir, str(corpus.resolve()), a.recipes, a)),
    ]
    if a.force:
        cmd.append("--force")
    print("$ " + " ".join(cmd), flush=True)
    t1 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run(cmd, env=env, check=False)
    t_sweep = time.perf_counter() - t1

    ppl_fp, ppl_ft, rows = recovery_rows(out / "sweep", a.recipes)
    curve = ", ".join(f"{s}: {v:.3f}" for s, v in info.get("val_loss", []))
    print(
        f"\nbenchmark model: {model_dir} ({corpus.name}; pretrained {info['spec']['steps']} steps, batch "
        f"{info['spec']['batch_size']} x {info['spec']['seq_len']}; held-out loss by step: {curve or 'n/a'})"
    )
    print(
        f"QAT: {a.qat_steps} steps, batch {a.batch_size} x 128, lr {a.lr:g}; every ppl: the .pte through the ExecuTorch runtime on "
        f"{a.eval_blocks} held-out blocks of 128 tokens; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"pretraining/cache {t_pretrain:.0f} s, sweep {t_sweep:.0f} s"
    )
    print(format_rows(ppl_fp, ppl_ft, rows))
    for r in rows:
        print(f"{r['recipe']}: {verdict(r)}")
    result = {
        "model_dir": str(model_dir),
        "pretrain": info,
        "ppl_fp": ppl_fp,
        "ppl_fp_finetuned": ppl_ft,
        "rows": rows,
        "args": vars(a),
        "sweep_s": t_sweep,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
