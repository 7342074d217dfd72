"""The answer-quality check: greedy answers of a run's models (FP, fake-quant or converted, ``.pte``) to held-out
conversations, scored against the reference answers and the FP model's answers (``checks/answers.py``).

Each conversation's prompt is its turns before the last assistant turn, rendered with the chat template and its
generation prompt; every model decodes greedily from it through the lm-eval adapter's backends (the same window
for every model) until an end-of-turn/EOS id or ``max_new_tokens``. A conversation whose prompt and
``max_new_tokens`` do not fit the window is skipped for every model (counted).

Example::

    result = answer_check({"fp": lambda: hf_backend(model, 128)}, tokenizer, conversations, TEMPLATE,
                          AnswersConfig(limit=16), length=128, stop_ids=[2], source="held-out split")
    print(format_answers(result, MODEL_KINDS))
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from qharness.checks.answers import REFERENCE, Answers, score_answers
from qharness.config import MODEL_KINDS, AnswersConfig
from qharness.sources.chat import prompt_and_reference

log = logging.getLogger(__name__)
EXAMPLES = 3  # conversations kept whole in the summary, to read next to the scores


def greedy_answers(backend, tokenizer, prompts: list[list[int]], max_new: int, stop_ids: list[int]) -> list[str]:
    """Each prompt's greedy continuation, decoded, up to (without) the first stop id."""
    stops = set(stop_ids)
    generated = backend.generate(
        prompts, max_new, lambda logits: int(logits.argmax()), lambda j, tokens: tokens[-1] in stops
    )
    texts = []
    for tokens in generated:
        if tokens and tokens[-1] in stops:
            tokens = tokens[:-1]
        texts.append(tokenizer.decode(tokens, skip_special_tokens=True).strip())
    return texts


def answer_check(
    backends: dict[str, Callable[[], object]],
    tokenizer,
    conversations: list[tuple[str, list[dict]]],
    template: str | None,
    cfg: AnswersConfig,
    length: int,
    stop_ids: list[int],
    source: str,
    models: list[str] = ("fp", "fake_quant", "pte"),
    seed: int = 0,
) -> Answers | None:
    """Answers of ``models`` among ``backends`` (``{kind: () -> backend}``, built lazily; the FP model always, as the
    reference of agreement) to ``conversations`` (``(where, turns)``), scored. None without conversations."""
    prompts, references, skipped = [], [], 0
    for where, messages in conversations:
        text, reference = prompt_and_reference(tokenizer, messages, template, where)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids or len(ids) + cfg.max_new_tokens > length:
            skipped += 1
            continue
        prompts.append((text, ids))
        references.append(reference)
    if not prompts:
        if conversations:
            log.warning(
                "answers: every conversation's prompt + %d new tokens exceeds the %d-token window; none scored",
                cfg.max_new_tokens,
                length,
            )
        return None
    kinds = [REFERENCE, *(k for k in models if k != REFERENCE)]
    answers: dict[str, list[str]] = {}
    for kind in kinds:
        if kind == "fake_quant" and kind not in backends and "converted" in backends and "converted" not in kinds:
            kind = "converted"  # PTQ: the converted model stands in for the fake-quant graph, as in lm-eval
        if kind not in backends:
            continue
        log.info("answers: %s on %d conversations ...", MODEL_KINDS[kind], len(prompts))
        ids = [p[1] for p in prompts]
        answers[kind] = greedy_answers(backends[kind](), tokenizer, ids, cfg.max_new_tokens, stop_ids)
    examples = [
        {"prompt": text, "reference": ref, "answers": {k: a[i] for k, a in answers.items()}}
        for i, ((text, _), ref) in enumerate(zip(prompts[:EXAMPLES], references))
    ]
    return Answers(
        source=source,
        conversations=len(prompts),
        skipped=skipped,
        max_new_tokens=cfg.max_new_tokens,
        models=score_answers(answers, references, seed),
        examples=examples,
    )
