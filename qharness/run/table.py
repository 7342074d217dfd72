"""The table a run prints when its ``.pte`` is written: every model's validation loss and perplexity with their
intervals, the ``.pte``'s size and its parity verdict, what it quantized."""

from __future__ import annotations

import math

from qharness.deploy.coverage import format_coverage
from qharness.run.summary import Agreement, RunSummary


def format_table(summary: RunSummary) -> str:
    """The run's table: every model's validation loss and perplexity with intervals, the ``.pte`` and its gate."""
    m, p = summary.metrics, summary.parity
    rows = [("model", "val loss", "val ppl", "95% interval", "vs FP [95%, paired]")]
    for key, label in (
        ("fp", "FP (before)"),
        ("fake_quant", "fake-quant (trained)"),
        ("converted", "converted (PyTorch)"),
        ("pte", ".pte (ExecuTorch)"),
    ):
        if key in m:
            ci, vs = m[key].ppl_ci, m[key].vs_fp
            rows.append(
                (
                    label,
                    _num(m[key].loss, ".4f"),
                    _num(m[key].ppl, ".3f"),
                    f"[{_num(ci[0], '.3f')}, {_num(ci[1], '.3f')}]" if ci else "-",
                    f"{_num(vs.ppl_ratio, '+.2%', -1)} [{_num(vs.ci[0], '+.2%', -1)}, {_num(vs.ci[1], '+.2%', -1)}]"
                    if vs and vs.ci and vs.ppl_ratio is not None
                    else "-",
                )
            )
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        f"{summary.recipe} ({summary.mode}) on {summary.eval_blocks} validation blocks of {summary.seq_len} tokens"
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    size = f".pte: {summary.pte.path} ({(summary.pte.size_bytes or 0) / 1e6:.2f} MB); parity "
    if p.skipped is not None:
        verdict = f"SKIPPED: {p.skipped}" if p.passed is None else "FAILED: " + "; ".join(p.reasons)
        lines.append(size + verdict)
    else:
        lines.append(
            size + f"{'PASSED' if p.passed else 'FAILED'}: max|Δlogit|={_num(p.max_abs_diff, '.4g')}, "
            f"argmax agreement={_decided(p)}, ppl diff={_num(p.ppl_rel_diff, '.2%')}{_noise(p)}"
        )
        fq = p.fake_quant
        if fq:
            verdict = ("PASSED" if fq.passed else "FAILED") if fq.gated else "reported"
            lines.append(
                f".pte vs trained fake-quant {verdict}: argmax agreement={_decided(fq)}, ppl diff={_num(fq.ppl_rel_diff, '.2%')}"
            )
    coverage = format_coverage(summary.coverage)
    if coverage:
        lines.append(coverage)
    if summary.layers:
        lines.append("layers: " + ", ".join(f"{n} x {scheme}" for scheme, n in summary.layers.counts.items()))
    t = summary.timings
    if t is not None and t.train_step_s is not None:
        lo, hi = t.train_step_s_range or (t.train_step_s, t.train_step_s)
        lines.append(
            f"training: {t.train_steps} steps on {t.train_device}, {t.train_step_s:.3g} s/step "
            f"(median, first step left out; {lo:.3g}-{hi:.3g})"
        )
    return "\n".join(lines)


def _num(value, fmt: str, add: float = 0) -> str:
    """``value + add`` formatted; a NaN/inf (None once written to JSON) as ``nan``."""
    return "nan" if value is None or not math.isfinite(value) else format(value + add, fmt)


def _decided(parity: Agreement) -> str:
    """``0.981 (12/160 near ties)``: the gated agreement, over the positions that are not near ties."""
    if parity.near_ties is None:  # a summary written before near ties were counted
        return _num(parity.argmax_agreement, ".3f")
    decided = parity.argmax_agreement_decided
    if decided is None:
        return f"not compared (all {parity.positions} positions are near ties)"
    return f"{decided:.3f} ({parity.near_ties}/{parity.positions} near ties)"


def _noise(parity) -> str:
    """``, KL 0.012 nats/token = 1.1x rounding noise (twin: argmax 0.95)``: the .pte against the converted model's
    own rounding noise (``parity.noise``), where the gate measured it."""
    noise = getattr(parity, "noise", None)
    if noise is None or parity.kl is None or noise.kl is None:
        return ""
    ratio = parity.kl / noise.kl if noise.kl > 0 else math.inf
    agree = noise.argmax_agreement_decided
    ppl = "" if noise.ppl_rel_diff is None else f", ppl diff {noise.ppl_rel_diff:.2%}"
    twins = "rounding twin" if (noise.twins or 1) == 1 else f"{noise.twins} rounding twins"
    return (
        f", KL {parity.kl:.3g} nats/token = {_num(ratio, '.2g')}x the converted model's rounding noise "
        f"({twins}: KL {noise.kl:.3g}, argmax {'n/a' if agree is None else f'{agree:.3f}'}{ppl})"
    )
