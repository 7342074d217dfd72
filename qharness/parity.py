"""Scoring and the parity gate: the ``.pte`` against the converted PyTorch model it was lowered from.

Both deploy models are stateful (a static KV cache), called as ``model(tokens[1, n], start) -> logits``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from qharness.progress import bar

StepFn = Callable[[torch.Tensor, int], torch.Tensor]


def perplexity(losses_sum: float, count: int) -> dict:
    loss = losses_sum / max(count, 1)
    return {"loss": loss, "ppl": math.exp(min(loss, 50.0))}


def _maybe_bar(iterable, desc: str | None, total: int, unit: str):
    return iterable if desc is None else bar(iterable, desc, total=total, unit=unit)


def score_deployed(step: StepFn, x: torch.Tensor, y: torch.Tensor, desc: str | None = None) -> dict:
    """Validation loss/perplexity of a cache model: each block prefilled at position 0 (``desc``: progress bar)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for xi, yi in _maybe_bar(zip(x, y), desc, len(x), "block"):
            logits = step(xi[None], 0)[0]
            total += F.cross_entropy(logits.float(), yi, reduction="sum").item()
            count += yi.numel()
    return perplexity(total, count)


def score_batched(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor, batch_size: int, desc: str | None = None) -> dict:
    """Validation loss/perplexity of a no-cache model taking ``[batch_size, seq_len]`` batches (``desc``: progress bar)."""
    total, count = 0.0, 0
    starts = range(0, len(x) - batch_size + 1, batch_size)
    with torch.no_grad():
        for i in _maybe_bar(starts, desc, len(starts), "batch"):
            logits = forward(x[i : i + batch_size])
            total += F.cross_entropy(logits.flatten(0, 1).float(), y[i : i + batch_size].flatten(), reduction="sum").item()
            count += y[i : i + batch_size].numel()
    return perplexity(total, count)


def compare_decoding(pte: StepFn, ref: StepFn, prompts: torch.Tensor, decode_steps: int, desc: str | None = None) -> dict:
    """Prefill each prompt in both models, then decode greedily (the ``.pte``'s tokens fed to both).

    Returns the largest absolute logit difference and how often both pick the same next token,
    over every prefill position and decode step (``desc``: progress bar).
    """
    max_diff, agree, total = 0.0, 0, 0
    with torch.no_grad():
        for prompt in _maybe_bar(prompts, desc, len(prompts), "prompt"):
            a, b = pte(prompt[None], 0)[0], ref(prompt[None], 0)[0]
            pos = prompt.numel()
            for step in range(decode_steps + 1):
                max_diff = max(max_diff, (a - b).abs().max().item())
                agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
                total += a.shape[0]
                if step == decode_steps:
                    break
                token = a[-1].argmax().view(1, 1)
                a, b = pte(token, pos)[0], ref(token, pos)[0]
                pos += 1
    return {"max_abs_diff": max_diff, "argmax_agreement": agree / max(total, 1), "positions": total}


def gate(figures: dict, cfg) -> list[str]:
    """The reasons the ``.pte`` fails the gate (empty: it passes)."""
    reasons = []
    if figures["ppl_rel_diff"] > cfg.max_ppl_rel_diff:
        reasons.append(f"perplexity differs by {figures['ppl_rel_diff']:.2%} > parity.max_ppl_rel_diff={cfg.max_ppl_rel_diff:.2%}")
    if figures["argmax_agreement"] < cfg.min_argmax_agreement:
        reasons.append(f"argmax agreement {figures['argmax_agreement']:.3f} < parity.min_argmax_agreement={cfg.min_argmax_agreement}")
    if cfg.max_abs_diff is not None and figures["max_abs_diff"] > cfg.max_abs_diff:
        reasons.append(f"max abs logit diff {figures['max_abs_diff']:.4g} > parity.max_abs_diff={cfg.max_abs_diff}")
    return reasons
