"""The distillation loss: the student's logits against the FP teacher's."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 * KL(softmax(teacher/T) || softmax(student/T))``, averaged over token positions.

    ``student``/``teacher``: logits ``[..., vocab]`` (computed in float32). Example::

        distill_loss(s, s, 2.0)  # 0: identical distributions
    """
    s = F.log_softmax(student.float().flatten(0, -2) / temperature, dim=-1)
    t = F.log_softmax(teacher.float().flatten(0, -2) / temperature, dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * temperature**2
