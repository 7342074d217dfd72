"""What quantized embeddings cost in quality: perplexity of ``xnnpack_8da4w`` with FP32, 8-bit (per row) and 4-bit
(groups of 32) embedding tables, PTQ and QAT, each through the ordinary CLI (``qharness calibrate`` / ``qharness
fit``), each perplexity the ``.pte``'s through the ExecuTorch runtime on the same held-out blocks, with its 95%
interval and the paired interval of its ratio to the FP model (``summary.json``'s ``metrics.pte``).

Models: the embedded default (``checkpoint: embedded`` on the embedded corpus), and, when tinyshakespeare is beside
the project (``../shared/data/tinyshakespeare/input.txt``) or given with ``--corpus``, also the quality benchmark's
model pretrained on it (``scripts/bench_quality.py``'s, cached). The tied embedding of these models is stored twice
when quantized (``recipes/embedding.py``): the program sizes show it.

    python scripts/bench_embeddings.py                                  # embedded model (+ tinyshakespeare if present)
    python scripts/bench_embeddings.py --qat_steps 100 --out runs/bench_embeddings --only embedded

Writes ``<out>/results.json`` and prints a Markdown table (docs/benchmarks/embeddings.md holds one run's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
TINYSHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
# the embedding tables compared: FP32, 8-bit per row, 4-bit in groups of 32 (the built-in default)
TABLES = {"fp32": (None, None), "w8-pc": (8, None), "w4-g32": (4, 32)}
MODES = ("ptq", "qat")


def recipe_file(out: Path, table: str) -> Path:
    """``xnnpack_8da4w`` with the ``table`` embedding setting, as a recipe file in ``out``."""
    bits, group = TABLES[table]
    path = out / f"8da4w_emb_{table}.yaml"
    quantizer = {"embedding_bits": bits, "embedding_group_size": group}
    text = {"base": "xnnpack_8da4w", "description": f"8da4w, {table} embeddings", "quantizer": quantizer}
    path.write_text("# written by scripts/bench_embeddings.py\n" + yaml.safe_dump(text, sort_keys=False))
    return path


def run_config(out: Path, model: str, corpus: str, recipe: Path, mode: str, args) -> Path:
    config = {
        "seed_everything": args.seed,
        "model": {
            "checkpoint": model,
            "recipe": str(recipe),
            "mode": mode,
            "lr": args.lr,
            "warmup_steps": max(1, args.qat_steps // 10),
        },
        "data": {"source": corpus, "seq_len": 128, "batch_size": args.batch_size, "seed": args.seed},
        "trainer": {
            "default_root_dir": str(out),
            "max_steps": args.qat_steps,
            "val_check_interval": args.qat_steps,
            "limit_val_batches": 4,
        },
        "deploy": {"max_seq_len": 256},
        "parity": {"eval_blocks": args.eval_blocks},
        "calibration": {"blocks": 32},
        "bench": {"enabled": False},
        "eval": {"enabled": False},
        "wandb": {"enabled": False},
    }
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def run_one(out: Path, model: str, corpus: str, table: str, mode: str, args) -> dict | None:
    """One run (skipped when its ``summary.json`` exists and not ``--force``); its row, None when it failed."""
    summary = out / "summary.json"
    if args.force or not summary.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        cfg = run_config(out, model, corpus, recipe_file(out.parent, table), mode, args)
        command = "fit" if mode == "qat" else "calibrate"
        print(f"[{out.name}] qharness {command} {cfg}", flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        r = subprocess.run(
            [sys.executable, "-P", "-m", "qharness", command, str(cfg)], env=env, text=True, capture_output=True
        )
        if r.returncode != 0:
            print(f"[{out.name}] failed:\n{r.stderr[-2000:]}", flush=True)
            return None
    data = json.loads(summary.read_text())
    pte, fp = data["metrics"]["pte"], data["metrics"]["fp"]
    vs = pte.get("vs_fp") or {}
    tables = (data.get("coverage") or {}).get("embeddings") or {}
    return {
        "table": table,
        "mode": mode,
        "ppl": pte["ppl"],
        "ppl_ci": pte.get("ppl_ci"),
        "ppl_fp": fp["ppl"],
        "ratio": vs.get("ppl_ratio"),
        "ratio_ci": vs.get("ci"),
        "block_losses": pte.get("block_losses"),
        "size_bytes": data["pte"]["size_bytes"],
        "parity": data["parity"]["passed"],
        "tables": tables,
    }


def fmt_ci(ci) -> str:
    return "" if not ci else f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def vs_float_table(row: dict, rows: list[dict]) -> str:
    """``row``'s ``.pte`` perplexity over the FP32-table run's of the same mode, paired over the same held-out blocks
    (what the quantized table itself costs), e.g. ``1.0042 [1.001, 1.008]``; ``-`` for the FP32 row itself."""
    from qharness.checks.stats import paired_ratio

    base = next((r for r in rows if r["table"] == "fp32" and r["mode"] == row["mode"]), None)
    if row["table"] == "fp32" or base is None or not row.get("block_losses") or not base.get("block_losses"):
        return "-"
    vs = paired_ratio(row["block_losses"], base["block_losses"])
    return f"{vs['ppl_ratio']:.4f}{fmt_ci(vs['ci'])}"


def table_md(name: str, rows: list[dict]) -> str:
    lines = [
        f"### {name}",
        "",
        "| embedding | mode | .pte ppl [95% CI] | ppl / FP [paired 95% CI] | ppl / FP32 table [paired 95% CI] |"
        " .pte size | table stored | parity |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stored = sum(t.get("stored_bytes") or t.get("bytes") or 0 for t in r["tables"].values())
        lines.append(
            f"| {r['table']} | {r['mode']} | {r['ppl']:.3f}{fmt_ci(r['ppl_ci'])} | "
            f"{r['ratio']:.4f}{fmt_ci(r['ratio_ci'])} | {vs_float_table(r, rows)} | {r['size_bytes'] / 1e6:.3f} MB | "
            f"{f'{stored:,} B' if stored else '-'} | {'passed' if r['parity'] else 'FAILED'} |"
        )
    if rows:
        lines.append(f"\nFP model: ppl {rows[0]['ppl_fp']:.3f} on the same blocks.")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/bench_embeddings", help="the runs, their configs and results.json")
    p.add_argument("--corpus", default=str(TINYSHAKESPEARE), help="the second model's corpus (skipped if absent)")
    p.add_argument("--only", choices=["embedded", "corpus"], help="one of the two models")
    p.add_argument("--qat_steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--eval_blocks", type=int, default=64, help="held-out blocks of 128 tokens each .pte is scored on")
    p.add_argument("--pretrain_steps", type=int, help="the corpus model's pretraining (bench_quality's default)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--force", action="store_true", help="redo finished runs")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    out = Path(args.out)
    models = {}
    if args.only in (None, "embedded"):
        models["embedded model, embedded corpus"] = ("embedded", "embedded", out / "embedded")
    if args.only in (None, "corpus"):
        if Path(args.corpus).is_file():
            sys.path.insert(0, str(ROOT / "scripts"))
            import bench_quality

            steps = args.pretrain_steps or bench_quality.PRETRAIN_STEPS
            model_dir = bench_quality.benchmark_model(args.corpus, steps)
            models[f"benchmark model, {Path(args.corpus).parent.name}"] = (str(model_dir), args.corpus, out / "corpus")
        else:
            print(f"{args.corpus} not found: the embedded model only", flush=True)
    results = {}
    for name, (model, corpus, where) in models.items():
        rows = [
            run_one(where / f"{table}-{mode}", model, corpus, table, mode, args) for mode in MODES for table in TABLES
        ]
        results[name] = [r for r in rows if r is not None]
        print(table_md(name, results[name]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
