"""The training losses: next-token cross-entropy over the targets that count, and distillation against the FP
teacher's logits. A target of -100 (``IGNORE``: chat data's prompts and example boundaries) counts in neither.

Example::

    token_loss(logits, y)                          # mean cross-entropy over the trained targets of y
    distill_loss(student, teacher, 2.0, y)        # T^2 KL on the same positions
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qharness.sources.example_cache import IGNORE


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits[..., vocab]`` against ``y`` over the targets that count (not -100); 0 when none
    does (a block of chat data that is all prompt), where the mean would be NaN.

    Example::

        token_loss(logits, torch.full_like(y, -100))   # tensor(0.)
    """
    flat = y.flatten()
    total = F.cross_entropy(logits.flatten(0, 1), flat, ignore_index=IGNORE, reduction="sum")
    return total / (flat != IGNORE).sum().clamp(min=1)


def distill_loss(
    student: torch.Tensor, teacher: torch.Tensor, temperature: float, y: torch.Tensor | None = None
) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher/T) || softmax(student/T))``, averaged over token positions; with the targets ``y``
    only over the positions whose target is trained (not -100: chat data's answers), 0 when there is none.

    ``student``/``teacher``: logits ``[..., vocab]`` (computed in float32). Example::

        distill_loss(s, s, 2.0)  # 0: identical distributions
    """
    student, teacher = student.flatten(0, -2), teacher.flatten(0, -2)
    if y is not None:
        keep = y.flatten() != IGNORE
        if not keep.all():
            student, teacher = student[keep], teacher[keep]
        if not len(student):
            return student.sum() * 0.0
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2
