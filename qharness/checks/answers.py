"""Answer quality: a model's answers against reference answers (exact match, ROUGE-L, token F1) and against another
model's answers (agreement), each a mean over conversations with its 95% bootstrap interval (``checks/stats.py``).

Texts are compared as normalized word sequences: lower case, runs of letters/digits/underscore as words,
punctuation and whitespace dropped (SQuAD's normalization without its English article rule).

Example::

    token_f1("Return the sum.", "return the total")   # 2 shared words of 3 and 3 -> 0.667
    rouge_l("a b c d", "a c d e")                      # LCS "a c d": P = R = 3/4 -> 0.75
    score_answers({"fp": fp, "pte": pte}, references)  # {"fp": ModelAnswers(...), "pte": ModelAnswers(...)}
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from qharness.checks.stats import bootstrap_interval

_WORD = re.compile(r"\w+")
REFERENCE = "fp"  # the model whose greedy answers the others are compared with (agreement)


def words(text: str) -> list[str]:
    """The normalized words of ``text``."""
    return _WORD.findall(text.lower())


def exact_match(answer: str, reference: str) -> float:
    """1.0 when the normalized words are the same, else 0.0."""
    return float(words(answer) == words(reference))


def token_f1(answer: str, reference: str) -> float:
    """F1 of the words the two share (as a multiset); 1.0 when both are empty."""
    a, r = words(answer), words(reference)
    if not a or not r:
        return float(a == r)
    shared = sum((Counter(a) & Counter(r)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(a), shared / len(r)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two word lists (one row of the dynamic program at a time)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(answer: str, reference: str) -> float:
    """ROUGE-L F1: the longest common word subsequence's precision and recall, harmonic mean; 1.0 when both are empty."""
    a, r = words(answer), words(reference)
    if not a or not r:
        return float(a == r)
    lcs = lcs_length(a, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


@dataclass
class Interval:
    """A mean over conversations and its 95% bootstrap interval ``ci`` ([lo, hi]; None below two conversations)."""

    mean: float
    ci: list[float] | None = None


def interval(values: list[float], seed: int = 0) -> Interval:
    return Interval(sum(values) / len(values), bootstrap_interval(values, seed=seed))


@dataclass
class ModelAnswers:
    """One model's answers scored against the references, and (not for the FP model itself) against the FP model's
    answers: ``fp_exact_match`` (the same answer) and ``fp_token_f1``."""

    exact_match: Interval
    rouge_l: Interval
    token_f1: Interval
    fp_exact_match: Interval | None = None
    fp_token_f1: Interval | None = None


@dataclass
class Answers:
    """The answer-quality check of a run (``summary.json``'s ``answers``).

    Args:
        source: Where the conversations came from (``eval.answers.source``, or the run's held-out chat data).
        conversations: Conversations answered by every model.
        skipped: Conversations left out: the prompt and ``max_new_tokens`` do not fit the window.
        max_new_tokens: Tokens each model could generate per answer.
        models: Per model (``fp``, ``fake_quant``, ``converted``, ``pte``): its scores.
        examples: The first few conversations: ``prompt``, ``reference`` and each model's ``answers``.
    """

    source: str
    conversations: int
    skipped: int
    max_new_tokens: int
    models: dict[str, ModelAnswers] = field(default_factory=dict)
    examples: list[dict] = field(default_factory=list)


def score_answers(answers: dict[str, list[str]], references: list[str], seed: int = 0) -> dict[str, ModelAnswers]:
    """Each model's answers (``{model: [answer per conversation]}``, same order as ``references``) scored; models
    other than ``REFERENCE`` also against its answers when it is among them."""
    ref = answers.get(REFERENCE)
    out = {}
    for name, texts in answers.items():
        if len(texts) != len(references):
            raise ValueError(f"{name}: {len(texts)} answers for {len(references)} references")
        scores = ModelAnswers(
            exact_match=interval([exact_match(a, r) for a, r in zip(texts, references)], seed),
            rouge_l=interval([rouge_l(a, r) for a, r in zip(texts, references)], seed),
            token_f1=interval([token_f1(a, r) for a, r in zip(texts, references)], seed),
        )
        if ref is not None and name != REFERENCE:
            scores.fp_exact_match = interval([exact_match(a, r) for a, r in zip(texts, ref)], seed)
            scores.fp_token_f1 = interval([token_f1(a, r) for a, r in zip(texts, ref)], seed)
        out[name] = scores
    return out


def format_interval(value: Interval | None) -> str:
    """``0.412 [0.331, 0.497]`` (``-`` when missing)."""
    if value is None:
        return "-"
    return f"{value.mean:.3f}" + ("" if value.ci is None else f" [{value.ci[0]:.3f}, {value.ci[1]:.3f}]")


def format_answers(result: Answers, names: dict[str, str]) -> str:
    """The check as a table: one row per model (``names``: its column name), a column per score."""
    head = (
        f"answer quality ({result.conversations} held-out conversations from {result.source}"
        + (f", {result.skipped} too long skipped" if result.skipped else "")
        + f"; greedy, at most {result.max_new_tokens} tokens; mean [95% bootstrap interval])"
    )
    rows = [("model", "exact match", "ROUGE-L", "token F1", "same as FP", "token F1 to FP")]
    for kind, s in result.models.items():
        rows.append(
            (
                names.get(kind, kind),
                *map(format_interval, (s.exact_match, s.rouge_l, s.token_f1, s.fp_exact_match, s.fp_token_f1)),
            )
        )
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join([head, *("  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in rows)])
