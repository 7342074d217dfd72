"""QAT's optimizer and learning-rate schedule: AdamW, no weight decay on learned quantization scales, a linear
warm-up then a cosine decay to ``min_lr_ratio`` of the rate (``QuantLM.configure_optimizers``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def param_groups(graph: torch.nn.Module, weight_decay: float, lr: float, scale_lr_ratio: float = 1.0) -> list[dict]:
    """The trainable parameters of ``graph`` in AdamW groups: the model's weights with ``weight_decay`` at ``lr``;
    learned quantization scales (fake quantizers' parameters, e.g. ``activation_post_process_3.scale`` or
    ``...q_proj.weight_fake_quantizer.scale``) without, at ``lr * scale_lr_ratio`` (0: left out, they stay where
    they start); anything else outside ``model.`` without, at ``lr``. Empty groups are left out."""
    from qharness.recipes.learned_scales import quantization_parameter_names

    scales = quantization_parameter_names(graph)
    params = [(n, p) for n, p in graph.named_parameters() if p.requires_grad]
    kind = ["scale" if n in scales else "decayed" if n.startswith("model.") else "other" for n, _ in params]
    groups = [
        {"params": [p for (_, p), k in zip(params, kind) if k == "decayed"], "weight_decay": weight_decay, "lr": lr},
        {"params": [p for (_, p), k in zip(params, kind) if k == "other"], "weight_decay": 0.0, "lr": lr},
    ]
    if scale_lr_ratio > 0:
        groups.append(
            {
                "params": [p for (_, p), k in zip(params, kind) if k == "scale"],
                "weight_decay": 0.0,
                "lr": lr * scale_lr_ratio,
            }
        )
    return [g for g in groups if g["params"]]


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """The rate's factor at each step: linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at
    ``total_steps``."""

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return schedule


def adamw_with_schedule(
    graph: torch.nn.Module,
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    min_lr_ratio: float,
    total_steps: int,
    scale_lr_ratio: float = 1.0,
) -> dict:
    """What Lightning's ``configure_optimizers`` returns: AdamW over ``param_groups`` and the ``warmup_cosine``
    schedule stepped every optimizer step over ``total_steps`` (at least 1)."""
    opt = torch.optim.AdamW(param_groups(graph, weight_decay, lr, scale_lr_ratio), lr=lr)
    schedule = warmup_cosine(warmup_steps, max(1, total_steps), min_lr_ratio)
    return {
        "optimizer": opt,
        "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule), "interval": "step"},
    }
