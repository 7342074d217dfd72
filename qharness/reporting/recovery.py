"""What QAT recovers of PTQ's loss, in words, for each ``<name>-ptq`` / ``<name>-qat`` pair of a sweep."""

from __future__ import annotations

from qharness.reporting.ranking import compare_accuracy
from qharness.reporting.render import cell
from qharness.reporting.rows import _number


def qat_recovery(rows: list[dict]) -> list[str]:
    """What QAT recovers of PTQ's loss, in words, for every pair of runs named ``<name>-ptq`` / ``<name>-qat``
    (a sweep's run directories; the QAT run may use a variant of the recipe, e.g. its learned-scale twin).

    Per pair, on the ``.pte`` perplexity: PTQ against FP and QAT against PTQ, each with its paired 95% interval, and
    the recovered fraction ``(ppl_ptq - ppl_qat) / (ppl_ptq - ppl_ref)``: ``ref`` is the FP model and, when the sweep
    has one, an FP recipe fine-tuned like the QAT runs (an FP run named ``*-qat``: the control that separates what
    quantization-aware training recovers from what fine-tuning alone gains). A fraction is given only where PTQ loses
    beyond the noise; a QAT-vs-PTQ interval that holds 0 is a tie, whatever the fraction.

    Example line: ``xnnpack_8da3w: PTQ loses ppl +7.19% [+5.69%, +8.72%] against FP; QAT (xnnpack_8da3w_lsq) against
    PTQ: ppl -4.27% [...], better beyond the noise; recovered 64% of PTQ's loss (68% against the fine-tuned FP control
    xnnpack_fp32-qat)``.
    """
    by_run = {r["run"]: r for r in rows if r.get("ppl_pte") is not None and r.get("parity_passed") is not False}
    controls = [r for r in by_run.values() if r["mode"] == "fp" and r["run"].endswith("-qat")]
    control = controls[0] if len(controls) == 1 else None
    lines = []
    for run, ptq in sorted(by_run.items()):
        qat = by_run.get(run[: -len("-ptq")] + "-qat") if run.endswith("-ptq") else None
        if qat is None or ptq["mode"] != "ptq" or qat["mode"] != "qat":
            continue
        name = run[: -len("-ptq")]
        variant = f" ({qat['recipe']})" if qat["recipe"] != ptq["recipe"] else ""
        fp, p, q = ptq.get("ppl_fp"), ptq["ppl_pte"], qat["ppl_pte"]
        loss = cell(ptq, "ppl_pte_vs_fp", "pct")
        vs = compare_accuracy(qat, ptq, "ppl_pte", True)
        verdict = {1: "better beyond the noise", 0: "a tie (inside the noise)", -1: "worse beyond the noise"}[vs.sign]
        text = f"{name}: PTQ loses {loss} against FP; QAT{variant} against PTQ: {vs.text}, {verdict}"
        lo = ptq.get("ppl_pte_vs_fp_lo")
        if not (_number(fp) and p > fp) or (_number(lo) and lo <= 0):
            text += "; PTQ loses nothing beyond the noise, so there is nothing for QAT to recover"
        else:
            text += f"; recovered {(p - q) / (p - fp):.0%} of PTQ's loss"
            c = control["ppl_pte"] if control else None
            if c is not None and p > c:
                text += f" ({(p - q) / (p - c):.0%} against the fine-tuned FP control {control['run']}, ppl {c:.3f})"
        lines.append("- " + text)
    if not lines:
        return []
    head = "What QAT recovers (runs <name>-ptq and <name>-qat; .pte perplexity; recovered = (PTQ - QAT) / (PTQ - FP)):"
    return ["", head, *lines]
