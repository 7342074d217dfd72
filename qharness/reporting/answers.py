"""The report's "Answer quality" section: each chat run's answer-quality check (``summary.json``'s ``answers``)
through its ``.pte``, with the 95% bootstrap intervals; nothing for runs without one (plain-text sweeps' reports
are as before)."""

from __future__ import annotations

from qharness.checks.answers import format_interval
from qharness.reporting.render import md_cell
from qharness.reporting.rows import ANSWER_SCORES as SCORES

HEADERS = ("exact match", "ROUGE-L", "token F1", "same as FP", "token F1 to FP")


def answer_lines(rows: list[dict], model: str = "pte") -> list[str]:
    """A Markdown table of the runs with an answer-quality check: their ``model``'s (the ``.pte``'s) scores."""
    checked = [r for r in rows if r.get("_answers") is not None and model in r["_answers"].models]
    if not checked:
        return []
    first = checked[0]["_answers"]
    head = (
        f"Answer quality through the .pte (greedy answers to held-out conversations, at most {first.max_new_tokens} "
        "tokens; the reference is the conversation's last answer; \"same as FP\" compares with the run's FP model's "
        "answer; mean [95% bootstrap interval over conversations]):"
    )
    lines = [
        "",
        head,
        "",
        "| run | mode | conversations | " + " | ".join(HEADERS) + " |",
        "|" + "---|" * (3 + len(HEADERS)),
    ]
    for r in sorted(checked, key=lambda r: r["run"]):
        a = r["_answers"]
        s = a.models[model]
        cells = [md_cell(r["run"]), md_cell(r["mode"]), str(a.conversations)]
        cells += [format_interval(getattr(s, name)) for name in SCORES]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
