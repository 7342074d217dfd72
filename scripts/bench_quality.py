"""Quality benchmark (issues 9, 16): how much of PTQ's perplexity loss each QAT variant recovers, per 4-bit recipe,
over several seeds.

The benchmark model is the embedded default's architecture (~1M-parameter Llama, GQA, tied embeddings) with
its own BPE tokenizer, pretrained to convergence on ``--corpus`` (default: tinyshakespeare beside the
project), cached. Per seed, one ``qharness sweep`` runs, each run in its own process through the ordinary CLI:

- ``xnnpack_fp32`` (the FP ``.pte``): ppl_fp;
- ``fp32_finetune``: the FP model fine-tuned with the QAT runs' steps, data, seed and learning rate (the control:
  how much of a QAT gain is plain fine-tuning);
- per recipe: ``ptq`` (``qharness calibrate``); ``qat`` (plain straight-through QAT); ``qat_kd`` (QAT with
  distillation from the FP model: ``model.distill``, KL only); ``qat_lsq`` (the recipe's learned-scale twin, e.g.
  ``xnnpack_int4w_lsq``); ``qat_lsq_kd`` (both); ``qat_lora`` (LoRA-QAT: ``model.lora``, adapters of rank 8, alpha 16
  on the attention/MLP projections, the base frozen, at ``--lora_lr``). Not in the default variants: ``qat_kdft`` and
  ``qat_lsq_kdft`` (distillation from the same seed's fine-tuned FP control, ``model.distill.teacher``, with the
  data's labels kept) and the other settings of the latter, ``qat_lsq_kdft_t2`` (temperature 2), ``qat_lsq_kdft_kl``
  (the teacher's logits only), ``qat_lsq_kdft_w4`` (KL weight 4); for recipes with a GPTQ twin (``xnnpack_8da4w_gptq``, ``xnnpack_8da3w_gptq``): ``ptq_gptq``
  (PTQ by GPTQ rounding) and ``qat_gptq`` (QAT with learned scales from GPTQ's weights and scales: the warm start;
  compare with ``qat_lsq``); with a rotation twin (``*_rot``, ``*_rot_gptq``): ``ptq_rot`` (PTQ after a folded
  Hadamard rotation) and ``ptq_rotgptq`` (rotation, then GPTQ).

Every perplexity is the ``.pte``'s, through the ExecuTorch runtime, on the same held-out blocks (the last 10% of
the corpus, never trained on). The recovered fraction of a variant is ``(ppl_ptq - ppl_variant) / (ppl_ptq -
ppl_control)`` with the same seed's fine-tuned FP control (and, printed beside it, against the untrained FP
model). Printed per recipe and variant: mean ± sd over seeds. Targets: the best QAT variant recovers
>= 90% against the control, and beats plain QAT by more than the noise (its paired per-seed gain over plain QAT
has a 95% t-interval above 0). Re-running reuses the cached model and the finished runs (``--force`` redoes them).

Choosing a setting (``--select_blocks N``): the same ``.pte`` files are also scored on the N held-out blocks after the
table's, and the variant that recovers most there is printed. Choose on seeds of its own with it, then report the
chosen variant on other seeds (``--chosen``: the targets are judged for it); without ``--chosen`` they are judged for
the table's best variant, a choice made on the blocks that judge it, which flatters it.

    python scripts/bench_quality.py                                   # 2 recipes x 5 variants x 3 seeds
    python scripts/bench_quality.py --recipes xnnpack_8da4w --seeds 1 2 3 --qat_steps 200
    python scripts/bench_quality.py --recipes xnnpack_int4w_dynamic --variants ptq qat qat_lora   # LoRA-QAT only
    python scripts/bench_quality.py --recipes xnnpack_8da4w --variants ptq qat qat_lsq_kdft qat_lsq_kdft_t2 \
        qat_lsq_kdft_kl qat_lsq_kdft_w4 --seeds 0 --select_blocks 192   # choose on seed 0 (docs/benchmarks/quality.md, 3g)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
RECIPES = ["xnnpack_int4w_dynamic", "xnnpack_8da4w"]
LEARNED_SCALES = {
    "xnnpack_int4w_dynamic": "xnnpack_int4w_lsq",
    "xnnpack_8da4w": "xnnpack_8da4w_lsq",
    "xnnpack_8da3w": "xnnpack_8da3w_lsq",
}
GPTQ = {"xnnpack_8da4w": "xnnpack_8da4w_gptq", "xnnpack_8da3w": "xnnpack_8da3w_gptq"}  # rounding: gptq twins (PTQ)
GPTQ_QAT = {"xnnpack_8da4w": "xnnpack_8da4w_lsq_gptq", "xnnpack_8da3w": "xnnpack_8da3w_lsq_gptq"}  # learned scales
ROTATED = {"xnnpack_8da4w": "xnnpack_8da4w_rot", "xnnpack_8da3w": "xnnpack_8da3w_rot"}  # rotation: hadamard twins
ROTATED_GPTQ = {"xnnpack_8da3w": "xnnpack_8da3w_rot_gptq"}
VARIANTS = [
    "ptq",
    "qat",
    "qat_kd",
    "qat_lsq",
    "qat_lsq_kd",
    "qat_lora",
    "ptq_gptq",
    "qat_gptq",
    "ptq_rot",
    "ptq_rotgptq",
    "qat_kdft",
    "qat_lsq_kdft",
    "qat_lsq_kdft_t2",
    "qat_lsq_kdft_kl",
    "qat_lsq_kdft_w4",
]
DEFAULT_VARIANTS = VARIANTS[:6]
PRETRAIN_STEPS = (
    1500  # tinyshakespeare's held-out loss is lowest here (3.92 at 1500 of 3000 steps; 3.98 at 3000: overfit)
)
DISTILL = {"kl_weight": 1.0, "temperature": 1.0, "hard_loss": False}
# distillation from the same seed's fine-tuned FP control (its run directory, <sweep_dir>/fp32_finetune-qat), the
# data's labels kept; the other settings (suffixes) are candidates for --select_blocks to choose between
DISTILL_FT = {"kl_weight": 1.0, "temperature": 1.0, "hard_loss": True}
DISTILL_FT_GRID = {
    "kdft": DISTILL_FT,
    "kdft_t2": {**DISTILL_FT, "temperature": 2.0},  # softer targets
    "kdft_kl": {**DISTILL_FT, "hard_loss": False},  # the teacher's logits only
    "kdft_w4": {**DISTILL_FT, "kl_weight": 4.0},  # the teacher weighs more than the labels
}
LORA = {"rank": 8, "alpha": 16.0}


def benchmark_model(corpus: str, steps: int) -> Path:
    """The embedded architecture pretrained on ``corpus`` for ``steps`` steps (cached; see qharness.sources.embedded)."""
    from qharness.sources.embedded import EmbeddedSpec, embedded_dir

    return embedded_dir(replace(EmbeddedSpec(), steps=steps), str(corpus))


def variant_runs(
    recipe: str, variants: list[str] = VARIANTS, lora_lr: float = 1e-3, sweep_dir: Path | None = None
) -> list[dict]:
    """The sweep entries of one recipe's ``variants``; run directories ``<recipe>-ptq``, ``<recipe>-qat``,
    ``<recipe>_kd-qat``, ``<recipe>_lsq-qat``, ``<recipe>_lsq_kd-qat``, ``<recipe>_lora-qat``, ...; ``sweep_dir``:
    where the fine-tuned FP control of the ``*_kdft`` variants runs (the sweep runs it first)."""
    kd = {"model": {"distill": DISTILL}}
    teacher = str(Path(sweep_dir or ".") / "fp32_finetune-qat")
    kdft = {k: {"model": {"distill": {**v, "teacher": teacher}}} for k, v in DISTILL_FT_GRID.items()}
    lsq = LEARNED_SCALES.get(recipe)
    runs = {
        "ptq": {"recipe": recipe, "modes": ["ptq"], "name": recipe},
        "qat": {"recipe": recipe, "modes": ["qat"], "name": recipe},
        "qat_kd": {"recipe": recipe, "modes": ["qat"], "name": f"{recipe}_kd", "config": kd},
        "qat_lora": {
            "recipe": recipe,
            "modes": ["qat"],
            "name": f"{recipe}_lora",
            "config": {"model": {"lora": LORA, "lr": lora_lr}},
        },
    }
    if recipe in GPTQ:
        runs["ptq_gptq"] = {"recipe": GPTQ[recipe], "modes": ["ptq"], "name": f"{recipe}_gptq"}
        runs["qat_gptq"] = {"recipe": GPTQ_QAT[recipe], "modes": ["qat"], "name": f"{recipe}_gptq"}
    if recipe in ROTATED:
        runs["ptq_rot"] = {"recipe": ROTATED[recipe], "modes": ["ptq"], "name": f"{recipe}_rot"}
    if recipe in ROTATED_GPTQ:
        runs["ptq_rotgptq"] = {"recipe": ROTATED_GPTQ[recipe], "modes": ["ptq"], "name": f"{recipe}_rotgptq"}
    if lsq:
        runs["qat_lsq"] = {"recipe": lsq, "modes": ["qat"], "name": f"{recipe}_lsq"}
        runs["qat_lsq_kd"] = {"recipe": lsq, "modes": ["qat"], "name": f"{recipe}_lsq_kd", "config": kd}
        for k, config in kdft.items():
            runs[f"qat_lsq_{k}"] = {"recipe": lsq, "modes": ["qat"], "name": f"{recipe}_lsq_{k}", "config": config}
    runs["qat_kdft"] = {"recipe": recipe, "modes": ["qat"], "name": f"{recipe}_kdft", "config": kdft["kdft"]}
    return [runs[v] for v in variants if v in runs]


def run_dir(sweep_dir: Path, recipe: str, variant: str) -> Path:
    """``<recipe>-ptq``, ``<recipe>-qat``, else ``<recipe>_<what>-<mode>`` (``qat_kd``: ``<recipe>_kd-qat``)."""
    if variant in ("ptq", "qat"):
        return sweep_dir / f"{recipe}-{variant}"
    mode, _, what = variant.partition("_")
    return sweep_dir / f"{recipe}_{what}-{mode}"


def sweep_config(out: Path, seed: int, model_dir: Path, corpus: str, recipes: list[str], args) -> Path:
    config = {
        "sweep_dir": str(out / f"seed{seed}"),
        "baseline": "xnnpack_fp32",
        "runs": [{"recipe": "xnnpack_fp32_finetune", "modes": ["qat"], "name": "fp32_finetune"}]
        + [entry for r in recipes for entry in variant_runs(r, args.variants, args.lora_lr, out / f"seed{seed}")],
        "config": {
            "seed_everything": seed,
            "model": {"checkpoint": str(model_dir), "lr": args.lr, "warmup_steps": max(1, args.qat_steps // 10)},
            "data": {"source": str(corpus), "seq_len": 128, "batch_size": args.batch_size, "seed": seed},
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
        "report": {"metric": "ppl", "bench_processes": 0},
    }
    path = out / f"sweep_seed{seed}.yaml"
    path.write_text("# written by scripts/bench_quality.py\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def pte_ppl(path: Path) -> float | None:
    summary = path / "summary.json"
    if not summary.is_file():
        return None
    from qharness.run.summary import RunSummary

    return RunSummary.read(summary).metrics["pte"].ppl


class SelectionBlocks:
    """Held-out blocks ``[start, start + n)`` after the evaluation blocks: the ``.pte`` perplexity a setting is chosen
    on (``--select_blocks``), so that no choice is made on the blocks the table reports. Cached per run directory in
    ``selection_ppl.json``.

    Example::

        ppl = SelectionBlocks(corpus, model_dir, start=64, n=128)(sweep_dir / "xnnpack_8da4w-qat")
    """

    def __init__(self, corpus: str, model_dir: Path, start: int, n: int, seq_len: int = 128):
        self.corpus, self.model_dir, self.start, self.n, self.seq_len = corpus, model_dir, start, n, seq_len
        self.key = f"{start}:{start + n}x{seq_len}"
        self._blocks = None

    def blocks(self):
        if self._blocks is None:
            from qharness.data.datamodule import TextDataModule

            dm = TextDataModule(source=self.corpus, tokenizer=str(self.model_dir), seq_len=self.seq_len, batch_size=1)
            dm.setup()
            if len(dm.val_x) < self.start + self.n:
                sys.exit(
                    f"error: --select_blocks {self.n}: the held-out split has {len(dm.val_x)} blocks, "
                    f"{self.start} of them scored for the table. fix: --select_blocks <= {len(dm.val_x) - self.start}"
                )
            self._blocks = dm.val_x[self.start : self.start + self.n], dm.val_y[self.start : self.start + self.n]
        return self._blocks

    def __call__(self, run: Path) -> float | None:
        summary, cache = run / "summary.json", run / "selection_ppl.json"
        if not summary.is_file():
            return None
        cached = json.loads(cache.read_text()) if cache.is_file() else {}
        if self.key not in cached:
            from qharness.checks.parity import score_deployed
            from qharness.io.atomic import write_bytes_atomic
            from qharness.run.summary import RunSummary
            from qharness.runtime.pte import PteModel

            pte = PteModel(RunSummary.read(summary).pte_file(run))
            cached[self.key] = score_deployed(pte, *self.blocks())["ppl"]
            write_bytes_atomic(cache, json.dumps(cached).encode())
        return cached[self.key]


def seed_rows(sweep_dir: Path, recipes: list[str], variants: list[str] = VARIANTS, score=pte_ppl) -> dict:
    """One seed's ppls: ``{"fp", "control", recipe: {variant: ppl}}`` (None: the run did not finish); ``score``:
    a run directory's perplexity (default: its ``.pte``'s on the evaluation blocks, from ``summary.json``)."""
    out = {"fp": score(sweep_dir / "xnnpack_fp32-ptq"), "control": score(sweep_dir / "fp32_finetune-qat")}
    for r in recipes:
        out[r] = {v: score(run_dir(sweep_dir, r, v)) for v in variants}
    return out


def recovered(ptq: float | None, ppl: float | None, reference: float | None) -> float | None:
    if None in (ptq, ppl, reference) or ptq == reference:
        return None
    return (ptq - ppl) / (ptq - reference)


def mean_sd(values: list[float | None]) -> tuple[float | None, float | None, int]:
    xs = [v for v in values if v is not None]
    if not xs:
        return None, None, 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None), len(xs)


def t_interval(diffs: list[float]) -> tuple[float, float] | None:
    """95% t-interval of the mean of paired differences (None below 2 pairs)."""
    if len(diffs) < 2:
        return None
    from scipy import stats

    m, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    h = stats.t.ppf(0.975, len(diffs) - 1) * se
    return m - h, m + h


def summarize(per_seed: dict[int, dict], recipes: list[str], variants: list[str] = VARIANTS) -> list[dict]:
    rows = []
    for r in recipes:
        for v in variants:
            ppls = [s[r][v] for s in per_seed.values()]
            vs_control = [recovered(s[r]["ptq"], s[r][v], s["control"]) for s in per_seed.values()]
            vs_fp = [recovered(s[r]["ptq"], s[r][v], s["fp"]) for s in per_seed.values()]
            gain = [  # recovered vs control, this variant minus plain QAT, paired by seed
                a - b
                for a, b in zip(
                    vs_control, [recovered(s[r]["ptq"], s[r]["qat"], s["control"]) for s in per_seed.values()]
                )
                if a is not None and b is not None
            ]
            rows.append(
                {
                    "recipe": r,
                    "variant": v,
                    "ppl": mean_sd(ppls),
                    "recovered_vs_control": mean_sd(vs_control) if v != "ptq" else (None, None, 0),
                    "recovered_vs_fp": mean_sd(vs_fp) if v != "ptq" else (None, None, 0),
                    "gain_over_qat_ci": t_interval(gain) if v not in ("ptq", "qat") else None,
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    def ms(t, spec):
        m, sd, n = t
        if m is None:
            return "n/a"
        return format(m, spec) + (f" ± {format(sd, spec)}" if sd is not None else "") + f" (n={n})"

    table = [("recipe", "variant", ".pte ppl", "recovered vs FP fine-tuned", "recovered vs FP", "gain over plain QAT")]
    for r in rows:
        ci = r["gain_over_qat_ci"]
        table.append(
            (
                r["recipe"],
                r["variant"],
                ms(r["ppl"], ".3f"),
                ms(r["recovered_vs_control"], ".1%"),
                ms(r["recovered_vs_fp"], ".1%"),
                "" if ci is None else f"[{ci[0]:+.1%}, {ci[1]:+.1%}]",
            )
        )
    width = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, width)).rstrip() for row in table)


def verdicts(rows: list[dict], recipes: list[str], chosen: str | None = None) -> list[str]:
    """Per recipe, the targets for the variant ``chosen`` beforehand (``--chosen``: on other seeds and
    blocks), else for the best variant of this table (chosen on the blocks it is judged on: optimistic)."""
    out = []
    for r in recipes:
        cands = qat_rows(rows, r)
        if chosen is not None:
            cands = [x for x in cands if x["variant"] == chosen]
        if not cands:
            out.append(f"{r}: no finished QAT variant" + (f" {chosen}" if chosen else ""))
            continue
        best = max(cands, key=lambda x: x["recovered_vs_control"][0])
        ci = best["gain_over_qat_ci"]
        beats = ci is not None and ci[0] > 0
        rec = best["recovered_vs_control"][0]
        which = "variant chosen beforehand" if chosen else "best variant (chosen on this table)"
        out.append(
            f"{r}: {which} {best['variant']} recovers {rec:.1%} vs the fine-tuned FP control (target >= 90%: "
            f"{'MET' if rec >= 0.9 else 'NOT MET'}); gain over plain QAT "
            + (
                "n/a (it is plain QAT)"
                if best["variant"] == "qat"
                else f"95% CI [{ci[0]:+.1%}, {ci[1]:+.1%}]"
                if ci
                else "n/a (< 2 seeds)"
            )
            + f" ({'beats plain QAT beyond the noise' if beats else 'not beyond the noise'})"
            + headroom(qat_rows(rows, r))
        )
    return out


def headroom(cands: list[dict]) -> str:
    """What plain QAT leaves to gain (100% less its recovered fraction) against the noise of the best other variant's
    gain interval: when the interval's half-width exceeds that room, no variant can beat plain QAT beyond the noise
    on this table, however good it is."""
    plain = [x for x in cands if x["variant"] == "qat"]
    others = [x for x in cands if x["variant"] != "qat" and x["gain_over_qat_ci"]]
    if not plain or not others:
        return ""
    room = max(0.0, 1 - plain[0]["recovered_vs_control"][0])
    best = max(others, key=lambda x: x["recovered_vs_control"][0])
    half = (best["gain_over_qat_ci"][1] - best["gain_over_qat_ci"][0]) / 2
    return (
        f"; plain QAT leaves {room:.1%} of PTQ's loss to gain, {best['variant']}'s gain interval is ±{half:.1%} wide"
        + (": too wide for any gain to show beyond the noise here" if half > room else "")
    )


def qat_rows(rows: list[dict], recipe: str) -> list[dict]:
    """The rows of ``recipe``'s QAT variants (``qat*``: not PTQ, GPTQ or rotation) that have a recovered fraction."""
    return [
        x
        for x in rows
        if x["recipe"] == recipe and x["variant"].startswith("qat") and x["recovered_vs_control"][0] is not None
    ]


def selected(rows: list[dict], recipe: str) -> str | None:
    """The QAT variant of ``recipe`` with the highest mean recovered fraction (against the control) in ``rows``."""
    cands = qat_rows(rows, recipe)
    return max(cands, key=lambda x: x["recovered_vs_control"][0])["variant"] if cands else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--corpus", default=str(DEFAULT_CORPUS), help="text file (or data.source) to pretrain and evaluate on"
    )
    p.add_argument("--recipes", nargs="+", default=RECIPES)
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="one sweep per seed (QAT data order, init)")
    p.add_argument("--out", default="runs/bench_quality", help="directory of the sweeps, their runs and results.json")
    p.add_argument("--pretrain_steps", type=int, default=PRETRAIN_STEPS, help="pretraining steps (batch 16 x 128)")
    p.add_argument("--qat_steps", type=int, default=200, help="QAT (and FP control) optimizer steps")
    p.add_argument("--lr", type=float, default=2e-4, help="peak learning rate of QAT (cosine decay after 10%% warm-up)")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--eval_blocks", type=int, default=64, help="held-out blocks of 128 tokens scored on every .pte")
    p.add_argument(
        "--variants", nargs="+", default=DEFAULT_VARIANTS, choices=VARIANTS, help="which variants (ptq and qat always)"
    )
    p.add_argument("--lora_lr", type=float, default=1e-3, help="peak learning rate of the qat_lora variant")
    p.add_argument(
        "--select_blocks",
        type=int,
        default=0,
        help="also score every .pte on this many held-out blocks after the --eval_blocks ones and print which "
        "variant recovers most there: choose settings this way (on seeds of their own), never on the table's blocks",
    )
    p.add_argument(
        "--chosen",
        choices=VARIANTS,
        help="the variant chosen beforehand (with --select_blocks on other seeds): the targets are judged for it",
    )
    p.add_argument("--force", action="store_true", help="redo every run (the pretrained model stays cached)")
    a = p.parse_args(argv)
    from qharness.upstream import quiet

    quiet.install()  # the known-harmless upstream lines hidden, as in the CLI (QHARNESS_VERBOSE=1 shows them)
    corpus = Path(a.corpus).expanduser()
    if not corpus.exists():
        sys.exit(
            f"error: --corpus {corpus} does not exist. fix: pass --corpus PATH (a text file), "
            f"or put tinyshakespeare at {DEFAULT_CORPUS}"
        )
    a.variants = ["ptq", "qat"] + [v for v in a.variants if v not in ("ptq", "qat")]
    if a.chosen and a.chosen not in a.variants:
        sys.exit(f"error: --chosen {a.chosen} is not among --variants. fix: add it to --variants")
    unknown = [r for r in a.recipes if r not in LEARNED_SCALES]
    if unknown and any(v.startswith("qat_lsq") for v in a.variants):
        sys.exit(f"error: --recipes {unknown}: no learned-scale twin known. fix: choose among {sorted(LEARNED_SCALES)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    t0 = time.perf_counter()
    model_dir = benchmark_model(str(corpus.resolve()), a.pretrain_steps)
    info = json.loads((model_dir / "qharness_pretrain.json").read_text())
    t_pretrain = time.perf_counter() - t0
    from qharness.api.jobs import sweep
    from qharness.errors import UserError

    # each sweep run is a child process (by design): it finds this checkout's qharness
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    per_seed, t1 = {}, time.perf_counter()
    for seed in a.seeds:
        config = sweep_config(out, seed, model_dir, str(corpus.resolve()), a.recipes, a)
        print(f"$ qharness sweep {config}{' --force' if a.force else ''}", flush=True)
        try:
            sweep(config, force=a.force)  # a failed run is recorded in the sweep and left out of the rows
        except UserError as e:
            sys.exit(f"error: {e}")
        per_seed[seed] = seed_rows(out / f"seed{seed}", a.recipes, a.variants)
    t_sweeps = time.perf_counter() - t1

    rows = summarize(per_seed, a.recipes, a.variants)
    curve = ", ".join(f"{s}: {v:.3f}" for s, v in info.get("val_loss", []))
    fp, control = mean_sd([s["fp"] for s in per_seed.values()]), mean_sd([s["control"] for s in per_seed.values()])
    print(
        f"\nbenchmark model: {model_dir} ({corpus.name}; pretrained {info['spec']['steps']} steps, batch "
        f"{info['spec']['batch_size']} x {info['spec']['seq_len']}; held-out loss by step: {curve or 'n/a'})"
    )
    print(
        f"QAT: {a.qat_steps} steps, batch {a.batch_size} x 128, lr {a.lr:g}, seeds {a.seeds}; distillation {DISTILL}, "
        f"from the fine-tuned control {DISTILL_FT_GRID}; "
        f"LoRA {LORA} at lr {a.lora_lr:g}; "
        f"every ppl: the .pte through the ExecuTorch runtime on {a.eval_blocks} held-out blocks of 128 tokens; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; pretraining/cache {t_pretrain:.0f} s, sweeps {t_sweeps:.0f} s"
    )
    print(f"FP .pte ppl: {fp[0]}; FP fine-tuned (control): mean {control[0]}, sd {control[1]} over {control[2]} seeds")
    print(format_table(rows))
    for line in verdicts(rows, a.recipes, a.chosen):
        print(line)
    selection = None
    if a.select_blocks:
        score = SelectionBlocks(str(corpus.resolve()), model_dir, start=a.eval_blocks, n=a.select_blocks)
        sel_seeds = {seed: seed_rows(out / f"seed{seed}", a.recipes, a.variants, score) for seed in a.seeds}
        sel_rows = summarize(sel_seeds, a.recipes, a.variants)
        selection = {"blocks": score.key, "per_seed": sel_seeds, "rows": sel_rows}
        selection["selected"] = {r: selected(sel_rows, r) for r in a.recipes}
        print(f"\nselection: the same .pte files on held-out blocks {score.key} (not the table's)")
        print(format_table(sel_rows))
        for r, v in selection["selected"].items():
            print(f"{r}: selected on these blocks: {v}")
    result = {
        "model_dir": str(model_dir),
        "pretrain": info,
        "per_seed": per_seed,
        "rows": rows,
        "args": vars(a),
        "sweeps_s": t_sweeps,
        "selection": selection,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
