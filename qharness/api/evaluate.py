"""lm-eval of one model: an FP transformers model, a QAT ``QuantizedModel`` (its fake-quant graph) or a ``Pte``.

The same code as ``qharness evaluate`` (``evaluation/harness.evaluate_models`` over ``evaluation/lm_eval_adapter.py``'s
backends); the offline tasks (``qharness_ppl``, ``qharness_mc``, ``qharness_gen``) are built from ``texts``.

Example::

    result = qharness.evaluate(pte, tasks=["qharness_ppl"], texts=val_text, limit=16)
    result["tasks"]["qharness_ppl"]["pte"]["word_perplexity"]
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from qharness.api.arguments import unwrap_compiled
from qharness.api.prepare import QuantizedModel, check_causal_lm, context_of
from qharness.api.pte import Pte
from qharness.errors import UserError

__all__ = ["evaluate"]

DEFAULT_TASKS = ("qharness_ppl", "qharness_mc")


def evaluate(
    model: torch.nn.Module | Pte,
    tokenizer=None,
    *,
    tasks: Sequence[str] = DEFAULT_TASKS,
    limit: int | None = None,
    num_fewshot: int | None = None,
    texts: str | list[str] | None = None,
    max_length: int | None = None,
    out_dir: str | Path | None = None,
    chat_template: bool | str = False,
    system_instruction: str | None = None,
    fewshot_as_multiturn: bool = True,
) -> dict:
    """lm-eval ``tasks`` on ``model``; returns the result ``qharness evaluate`` writes (``tasks`` -> task -> model kind
    (``fp``, ``fake_quant`` or ``pte``) -> metrics, with ``chance`` levels and ``documents`` counts).

    ``tokenizer``: the transformers tokenizer (default: a ``QuantizedModel``'s own, a ``Pte``'s ``tokenizer/``
    directory). ``texts``: the documents the offline tasks are built from (needed for them). ``limit``: documents per
    task. ``max_length``: tokens the model sees at once (default: a ``QuantizedModel``'s ``seq_len``, a ``.pte``'s KV
    cache - 1, an FP model's context up to 256). ``out_dir``: where ``eval.json`` and the offline tasks are written
    (default: a temporary directory). A PTQ ``QuantizedModel`` computes in FP until export: evaluate its ``Pte``.
    ``chat_template``: render the prompts with a chat template (as ``eval.chat_template``): True: the tokenizer's, or a
    template (``embedded``, a file, the Jinja text); ``system_instruction`` and ``fewshot_as_multiturn`` as
    ``eval.system_instruction`` and ``eval.fewshot_as_multiturn``.

    Example::

        r = qharness.evaluate(qm, tasks=["qharness_ppl"], texts=val_text, limit=8)
        r = qharness.evaluate(qharness.Pte.load("out/model.pte"), tasks=["qharness_mc"], texts=val_text, limit=16)
    """
    from qharness.config import EvalConfig
    from qharness.evaluation.tasks import OFFLINE_TASKS, check_tasks

    if isinstance(tasks, str):
        tasks = [tasks]  # one task name
    if not isinstance(tasks, Sequence) or not all(isinstance(t, str) for t in tasks):
        raise UserError(f"tasks must be task names (got {tasks!r:.80})", fix='e.g. tasks=["qharness_ppl"]')
    cfg = EvalConfig(
        enabled=True,
        tasks=list(tasks),
        limit=limit,
        num_fewshot=num_fewshot,
        max_length=max_length,
        models=["fp"],
        system_instruction=system_instruction,
        fewshot_as_multiturn=fewshot_as_multiturn,
    )
    check_tasks(cfg.tasks)
    if any(t in OFFLINE_TASKS for t in cfg.tasks) and not texts:
        raise UserError(
            f"the offline task(s) {', '.join(t for t in cfg.tasks if t in OFFLINE_TASKS)} need texts",
            fix="pass texts= (held-out text or a list of documents), or name standard lm-eval tasks",
        )
    kind, make_backend, tokenizer = _backend(model, tokenizer, max_length)
    cfg.models = [kind]
    template = _chat_template(chat_template, tokenizer)
    docs = [texts] if isinstance(texts, str) else list(texts or [])
    from qharness.evaluation.harness import evaluate_models

    with tempfile.TemporaryDirectory(prefix="qharness-eval-") as tmp:
        return evaluate_models({kind: make_backend}, tokenizer, cfg, docs, Path(out_dir or tmp), chat_template=template)


def _chat_template(value: bool | str, tokenizer) -> str | None:
    """``chat_template=``: None (off), the tokenizer's template (True) or the given one; a ``UserError`` without one."""
    if value is False or value is None:
        return None
    from qharness.sources.chat import check_template, load_template

    template = None if value is True else load_template(value, "chat_template")
    check_template(tokenizer, template, "chat_template=")
    return template or tokenizer.chat_template


def _backend(model, tokenizer, max_length: int | None):
    """``(kind, () -> backend, tokenizer)`` of ``model``."""
    from qharness.evaluation.lm_eval_adapter import BatchedForward, hf_backend, pte_backend

    if isinstance(model, Pte):
        model.check_file(reopen=True)  # the backend loads the path again: it must be the program loaded
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model.tokenizer_dir or model.path.parent / "tokenizer")
        return "pte", lambda: pte_backend(model.path, max_length), tokenizer
    if isinstance(model, QuantizedModel):
        if model.graph is None:
            raise UserError(
                "a PTQ QuantizedModel computes in floating point until it is exported",
                fix="evaluate its .pte: qharness.evaluate(qharness.Pte.load(result.pte_path), ...)",
            )
        tokenizer = _tokenizer(tokenizer if tokenizer is not None else model.tokenizer)
        length = max_length or model.seq_len
        if length > model.seq_len:
            raise UserError(
                f"max_length={length} exceeds the prepared seq_len={model.seq_len}",
                fix=f"use max_length <= {model.seq_len}",
            )
        model.eval()
        shape = (model.batch_size, model.seq_len)
        device = next(model.graph.parameters()).device
        return (
            "fake_quant",
            lambda: BatchedForward(lambda x: model(x.to(device)).logits.cpu(), length, model.batch_size, shape=shape),
            tokenizer,
        )
    model = unwrap_compiled(model)
    check_causal_lm(model)
    length = max_length or min(256, context_of(model) or 256)
    return "fp", lambda: hf_backend(model, length), _tokenizer(tokenizer)


def _tokenizer(tokenizer):
    if tokenizer is None or not callable(tokenizer) or not hasattr(tokenizer, "eos_token_id"):
        raise UserError("evaluate needs the model's transformers tokenizer", fix="pass tokenizer= (AutoTokenizer)")
    return tokenizer
