"""Activation outliers moved into the weights where that costs them nothing (a recipe's ``quantizer: {smoothing: α}``;
PTQ).

The input of a gated MLP's ``down_proj`` (``act(gate(x)) * up(x)``) has channels whose values dwarf the others', and
8da recipes round it to int8 per token, so every other channel gets a coarse step. SmoothQuant divides such input
channels by a factor ``s`` and multiplies the weight columns that read them by ``s``: the same function, flatter
activations. Here the division goes into ``up_proj``'s rows (its output feeds the product linearly), and ``s`` is a
power of two, constant over each weight group of ``down_proj``'s inputs. Then nothing changes on the weight side: a
group of ``down_proj`` times ``s`` and a row of ``up_proj`` over ``s`` keep their codes, and their scales (bf16
included) and weighted-scale choices scale exactly; what moves is the int8 rounding of the activations (and of a
zero-point ``down_proj``'s offsets, 8-bit per row, whose columns scale with ``s``).

``s`` for a group is ``2 ** round(α * log2(m / median))``, ``m`` the group's largest absolute input on the
calibration blocks, ``median`` the median of the groups' ``m``; ``α`` is SmoothQuant's migration strength (0.5 its
default). On SmolLM2-135M (zero points on k/v/up/down, weighted scales elsewhere, eager, 40 windows of
tinyshakespeare) α = 0.5 took the loss from +6.0% to +5.1% over float; α = 1 gained nothing (a group large on the
calibration blocks is not large at every token).

Example::

    factors = smoothing_factors(model, ["model.layers.0.mlp"], blocks, alpha=0.5, group=32)
    up, down = smoothed(mlp.up_proj.weight, mlp.down_proj.weight, factors["model.layers.0.mlp"])
"""

from __future__ import annotations

import torch

from qharness.errors import UserError
from qharness.recipes.scale_search import input_statistics


def gated_mlps(model: torch.nn.Module, names: set[str]) -> list[str]:
    """The modules of ``model`` with ``gate_proj``, ``up_proj`` and ``down_proj`` children whose up and down
    projections are both in ``names`` (the linears a step rounds), checked to compute ``down(f(gate(x)) * up(x))``:
    with ``up_proj``'s rows halved and ``down_proj``'s columns doubled the module's output is unchanged; a module that
    is not such an MLP is refused (``UserError``)."""
    out = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if not {"gate_proj", "up_proj", "down_proj"} <= children.keys():
            continue
        if f"{name}.up_proj" not in names or f"{name}.down_proj" not in names:
            continue
        up, down = children["up_proj"], children["down_proj"]
        p = next(module.parameters())
        x = torch.randn(2, up.in_features, generator=torch.Generator().manual_seed(0), device="cpu")
        x = x.to(p.device, p.dtype)  # drawn on CPU, where the generator is, inside a trainer's GPU device context too
        with torch.no_grad():
            before = module(x)
            up.weight.mul_(0.5), down.weight.mul_(2.0)
            after = module(x)
            up.weight.mul_(2.0), down.weight.mul_(0.5)
        if not torch.allclose(before, after, rtol=1e-4, atol=1e-6 * before.abs().max().item()):
            raise UserError(
                f"quantizer smoothing: {name} ({type(module).__name__}) is not a gated MLP down(f(gate(x)) * up(x)): "
                "its output changed when up_proj's rows were halved and down_proj's columns doubled",
                fix="drop smoothing from the recipe for this model",
            )
        out.append(name)
    return out


def smoothing_factors(
    model: torch.nn.Module, mlps: list[str], blocks: torch.Tensor, alpha: float, group: int, batch: int = 4
) -> dict[str, torch.Tensor]:
    """``{mlp name: s [down_proj.in_features]}``: each ``down_proj`` input's power-of-two factor, constant over each
    of its ``group`` inputs, from the largest absolute inputs on ``blocks`` ``[n, seq]`` (one pass of ``model``, left
    unchanged)."""
    stats = input_statistics(model, [f"{name}.down_proj" for name in mlps], blocks, batch)
    return {name: factors(stats[f"{name}.down_proj"][1], alpha, group) for name in mlps}


def factors(peak: torch.Tensor, alpha: float, group: int) -> torch.Tensor:
    """The power-of-two factor of each input of a ``down_proj`` whose inputs' largest absolute values are ``peak``
    ``[in_features]``: ``2 ** round(alpha * log2(m / median))`` for each group's ``m``, repeated over the group."""
    m = peak.reshape(-1, group).amax(-1).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.round(alpha * torch.log2(m / m.median()))).repeat_interleave(group)


def smoothed(up: torch.Tensor, down: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(up / s per row, down * s per column)``: the same MLP, ``down_proj``'s input divided by ``s``."""
    return (up.detach() / s.to(up.dtype)[:, None]), (down.detach() * s.to(down.dtype)[None, :])
