"""One run's ``summary.json`` -> one flat row: what the report tables and the wandb final row hold."""

from __future__ import annotations

import math
from pathlib import Path

from qharness.checks.answers import Answers
from qharness.run.summary import RunSummary
from qharness.runtime.bench_record import ModelBench

STAGES = ("fp", "fake_quant", "converted", "pte")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _metric_name(name: str) -> str:
    """lm-eval's ``acc,none`` -> ``acc`` (the default filter); other filters stay (``exact_match,strict``)."""
    return name[: -len(",none")] if name.endswith(",none") else name


def summary_row(summary: RunSummary, run: str | None = None) -> dict:
    """The flat row of one run: what the report tables and the wandb final row hold.

    ``eval/<task>/<metric>/<stage>`` columns come from the summary's ``eval`` section (the run's own lm-eval) and
    then its ``evaluations`` (later ``qharness evaluate`` runs, newer last); ``chance/<task>/<metric>`` what guessing
    scores there; ``answers/<score>/<model>`` the answer-quality check of a chat run (none in other runs).
    """
    m, parity = summary.metrics, summary.parity
    bench = summary.bench
    pte_bench = bench.pte if bench and bench.pte else None
    vs_eager = bench.pte_vs_eager if bench else None
    speed = latency_figures(summary)
    ppl = {k: m[k].ppl if k in m else None for k in STAGES}
    vs_ci = m["pte"].vs_fp.ci if "pte" in m and m["pte"].vs_fp else None
    row = {
        "run": run if run is not None else Path(summary.run_dir or "").name,
        "model": summary.model,
        "recipe": summary.recipe,
        "backend": summary.backend,
        "mode": summary.kind,
        # of the linear weight bytes, as deployed (deploy/coverage.py); None: a summary from before it was measured
        "quantized_fraction": summary.coverage.fraction if summary.coverage else None,
        "ppl_fp": ppl["fp"],
        "ppl_fake_quant": ppl["fake_quant"],
        "ppl_converted": ppl["converted"],
        "ppl_pte": ppl["pte"],
        "ppl_pte_vs_fp": ppl["pte"] / ppl["fp"] - 1 if ppl["pte"] and ppl["fp"] else None,
        "ppl_pte_vs_fp_lo": vs_ci[0] - 1 if vs_ci else None,
        "ppl_pte_vs_fp_hi": vs_ci[1] - 1 if vs_ci else None,
        **{
            f"ppl_{k}_{end}": (m[k].ppl_ci if k in m and m[k].ppl_ci else (None, None))[i]
            for k in STAGES
            for i, end in enumerate(("lo", "hi"))
        },
        "n_blocks": m["pte"].n_blocks if "pte" in m else None,
        "parity_passed": parity.passed,
        "parity_max_abs_diff": parity.max_abs_diff,
        "parity_argmax_agreement": parity.argmax_agreement,
        "parity_ppl_rel_diff": parity.ppl_rel_diff,
        "pte_size_mb": summary.pte.size_bytes / 1e6 if summary.pte.size_bytes else None,
        **speed,
        # the runs timed as one latency class with this one (one program structure, samples pooled, one figure)
        "latency_class": ", ".join(joint_class) if (joint_class := latency_class(summary)) else None,
        "bandwidth_fraction": pte_bench.bandwidth_fraction if pte_bench else None,
        "peak_rss_mb": pte_bench.peak_rss_mb if pte_bench else None,
        "decode_speedup_vs_eager": vs_eager.decode_speedup if vs_eager else None,
        "bench_load_avg": bench.load_avg_1m if bench else None,
        "bench_cpus": bench.cpus if bench else None,
    }
    tables = [summary.eval or {}, *(summary.evaluations or [])]
    for task, stages in [item for table in tables for item in sorted((table.get("tasks") or {}).items())]:
        for stage, values in sorted(
            (stages or {}).items(), key=lambda kv: STAGES.index(kv[0]) if kv[0] in STAGES else 99
        ):
            for name, value in sorted((values or {}).items()):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue  # lm-eval's "N/A" standard errors are null in eval.json
                row[f"eval/{task}/{_metric_name(name)}/{stage}"] = float(value)
    for table in tables:  # what guessing scores (eval.json "chance"), one per task and metric
        for task, metrics in (table.get("chance") or {}).items():
            for name, value in metrics.items():
                row[f"chance/{task}/{name}"] = float(value)
    return row | answer_columns(summary.answers)


ANSWER_SCORES = ("exact_match", "rouge_l", "token_f1", "fp_exact_match", "fp_token_f1")


def answer_columns(answers: Answers | None) -> dict:
    """The row's ``answers/<score>/<model>`` columns (mean, ``_lo``, ``_hi``) and the private ``_answers`` record;
    none without a check."""
    if answers is None:
        return {}
    row: dict = {"answers_conversations": answers.conversations, "_answers": answers}
    for kind, scores in answers.models.items():
        for name in ANSWER_SCORES:
            value = getattr(scores, name)
            if value is not None:
                lo, hi = value.ci or (None, None)
                row |= {
                    f"answers/{name}/{kind}": value.mean,
                    f"answers/{name}/{kind}_lo": lo,
                    f"answers/{name}/{kind}_hi": hi,
                }
    return row


def latency_figures(summary: RunSummary) -> dict:
    """Decode ms/token, decode and prefill tokens/s of the ``.pte`` with their ``_lo``/``_hi`` ranges, and where they
    come from (``latency_source``): the joint benchmark (``bench_joint``: one value per fresh process, all candidates
    timed in alternating rounds in one session) when the summary has one, else the run's own ``bench`` (min/max over
    repetitions inside one process: weak evidence of the noise)."""
    joint = summary.bench_joint
    if joint is not None and joint.decode_ms_per_token is not None:
        out = {"latency_source": f"joint ({joint.processes} processes)"}
        for key in ("decode_ms_per_token", "decode_tok_s", "prefill_tok_s"):
            d = getattr(joint, key)
            out |= {key: d and d.median, f"{key}_lo": d and d.min, f"{key}_hi": d and d.max}
        return out
    own = summary.bench.pte if summary.bench and summary.bench.pte else ModelBench()
    out = {"latency_source": "own bench (1 process)" if own.decode_tok_s is not None else None}
    for key in ("decode_tok_s", "prefill_tok_s"):
        d = getattr(own, key)
        out |= {key: d and d.median, f"{key}_lo": d and d.min, f"{key}_hi": d and d.max}
    for end, tok_s in (("", "decode_tok_s"), ("_lo", "decode_tok_s_hi"), ("_hi", "decode_tok_s_lo")):
        v = out[tok_s]
        out[f"decode_ms_per_token{end}"] = 1000.0 / v if _number(v) and v > 0 else None
    return out


def latency_class(summary: RunSummary) -> list[str] | None:
    """The runs whose programs share this run's structure, timed as one latency class in the joint benchmark (itself
    included; ``joint.pool_classes``); None: a class of its own (or no joint benchmark)."""
    joint = summary.bench_joint
    return list(joint.latency_class) if joint is not None and joint.latency_class else None


def noise_of(summary: RunSummary) -> dict:
    """What the report needs to call ties and that no table shows (private ``_`` keys): per-block losses by stage,
    their standard errors, the validation blocks' id, the ``.pte``'s sha256, the per-process decode timings."""
    m = summary.metrics
    joint = summary.bench_joint
    samples = joint.decode_ms_per_token.per_process if joint and joint.decode_ms_per_token else None
    return {
        "_blocks": {k: m[k].block_losses for k in STAGES if k in m and isinstance(m[k].block_losses, list)},
        "_loss_se": {k: m[k].loss_se for k in STAGES if k in m and _number(m[k].loss_se)},
        "_val": summary.val_blocks,
        "_sha256": summary.pte.sha256,
        "_decode_ms_samples": [float(v) for v in samples] if isinstance(samples, list) and samples else None,
        "_latency_class": tuple(joint_class) if (joint_class := latency_class(summary)) else None,
    }


def row_columns() -> set[str]:
    """The columns every run's row has (``summary_row`` and ``noise_of`` of an empty summary)."""
    blank = RunSummary(
        run_dir="", model="", recipe="", backend="", mode="ptq", quantized=True, seq_len=0, eval_blocks=0
    )
    return set(summary_row(blank)) | set(noise_of(blank))
