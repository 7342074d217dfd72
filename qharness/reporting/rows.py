"""One run's ``summary.json`` -> one flat row: what the report tables and the wandb final row hold."""

from __future__ import annotations

import math
from pathlib import Path

STAGES = ("fp", "fake_quant", "converted", "pte")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _median(d):
    return d.get("median") if isinstance(d, dict) else d


def _metric_name(name: str) -> str:
    """lm-eval's ``acc,none`` -> ``acc`` (the default filter); other filters stay (``exact_match,strict``)."""
    return name[: -len(",none")] if name.endswith(",none") else name


def summary_row(summary: dict, run: str | None = None) -> dict:
    """The flat row of one run: what the report tables and the wandb final row hold.

    ``summary`` is ``RunSummary.to_dict()``. ``eval/<task>/<metric>/<stage>`` columns come from the summary's
    ``eval`` section (the run's own lm-eval) and then its ``evaluations`` (later ``qharness evaluate`` runs, newer last);
    ``chance/<task>/<metric>`` what guessing scores there.
    """
    m = summary.get("metrics", {})
    parity = summary.get("parity", {})
    pte_bench = (summary.get("bench") or {}).get("pte", {})
    speed = latency_figures(summary)
    ppl = {k: m.get(k, {}).get("ppl") for k in STAGES}
    vs_fp = m.get("pte", {}).get("vs_fp") or {}
    row = {
        "run": run if run is not None else Path(summary.get("run_dir", "")).name,
        "model": summary.get("model"),
        "recipe": summary.get("recipe"),
        "backend": summary.get("backend"),
        "mode": summary["mode"] if summary["quantized"] else "fp",  # RunSummary.kind
        # of the linear weight bytes, as deployed (deploy/coverage.py); None: a summary from before it was measured
        "quantized_fraction": (summary.get("coverage") or {}).get("fraction"),
        "ppl_fp": ppl["fp"],
        "ppl_fake_quant": ppl["fake_quant"],
        "ppl_converted": ppl["converted"],
        "ppl_pte": ppl["pte"],
        "ppl_pte_vs_fp": ppl["pte"] / ppl["fp"] - 1 if ppl["pte"] and ppl["fp"] else None,
        "ppl_pte_vs_fp_lo": vs_fp["ci"][0] - 1 if vs_fp.get("ci") else None,
        "ppl_pte_vs_fp_hi": vs_fp["ci"][1] - 1 if vs_fp.get("ci") else None,
        **{
            f"ppl_{k}_{end}": (m.get(k, {}).get("ppl_ci") or (None, None))[i]
            for k in STAGES
            for i, end in enumerate(("lo", "hi"))
        },
        "n_blocks": m.get("pte", {}).get("n_blocks"),
        "parity_passed": parity.get("passed"),
        "parity_max_abs_diff": parity.get("max_abs_diff"),
        "parity_argmax_agreement": parity.get("argmax_agreement"),
        "parity_ppl_rel_diff": parity.get("ppl_rel_diff"),
        "pte_size_mb": summary["pte"]["size_bytes"] / 1e6 if summary.get("pte", {}).get("size_bytes") else None,
        **speed,
        "bandwidth_fraction": pte_bench.get("bandwidth_fraction"),
        "peak_rss_mb": pte_bench.get("peak_rss_mb"),
        "decode_speedup_vs_eager": (summary.get("bench") or {}).get("pte_vs_eager", {}).get("decode_speedup"),
        "bench_load_avg": (summary.get("bench") or {}).get("load_avg_1m"),
        "bench_cpus": (summary.get("bench") or {}).get("cpus"),
    }
    tables = [summary.get("eval") or {}, *(summary.get("evaluations") or [])]
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
    return row


def latency_figures(summary: dict) -> dict:
    """Decode ms/token, decode and prefill tokens/s of the ``.pte`` with their ``_lo``/``_hi`` ranges, and where they
    come from (``latency_source``): the joint benchmark (``bench_joint``: one value per fresh process, all candidates
    timed round-robin in one session) when the summary has one, else the run's own ``bench`` (min/max over
    repetitions inside one process: weak evidence of the noise)."""
    joint = summary.get("bench_joint")
    if isinstance(joint, dict) and isinstance(joint.get("decode_ms_per_token"), dict):
        out = {"latency_source": f"joint ({joint.get('processes')} processes)"}
        for key in ("decode_ms_per_token", "decode_tok_s", "prefill_tok_s"):
            d = joint.get(key) if isinstance(joint.get(key), dict) else {}
            out |= {key: d.get("median"), f"{key}_lo": d.get("min"), f"{key}_hi": d.get("max")}
        return out
    own = (summary.get("bench") or {}).get("pte", {})
    out = {"latency_source": "own bench (1 process)" if own.get("decode_tok_s") is not None else None}
    for key in ("decode_tok_s", "prefill_tok_s"):
        d = own.get(key)
        out |= {key: _median(d), f"{key}_lo": _end(d, "min"), f"{key}_hi": _end(d, "max")}
    for end, tok_s in (("", "decode_tok_s"), ("_lo", "decode_tok_s_hi"), ("_hi", "decode_tok_s_lo")):
        v = out[tok_s]
        out[f"decode_ms_per_token{end}"] = 1000.0 / v if _number(v) and v > 0 else None
    return out


def _end(d, end: str):
    return d.get(end) if isinstance(d, dict) else None


def noise_of(summary: dict) -> dict:
    """What the report needs to call ties and that no table shows (private ``_`` keys): per-block losses by stage,
    their standard errors, the validation blocks' id, the ``.pte``'s sha256, the per-process decode timings."""
    m = summary.get("metrics", {})
    joint = summary.get("bench_joint")
    samples = joint.get("decode_ms_per_token", {}).get("per_process") if isinstance(joint, dict) else None
    return {
        "_blocks": {k: m[k]["block_losses"] for k in STAGES if isinstance(m.get(k, {}).get("block_losses"), list)},
        "_loss_se": {k: m[k]["loss_se"] for k in STAGES if _number(m.get(k, {}).get("loss_se"))},
        "_val": summary.get("val_blocks"),
        "_sha256": summary.get("pte", {}).get("sha256"),
        "_decode_ms_samples": [float(v) for v in samples] if isinstance(samples, list) and samples else None,
    }
