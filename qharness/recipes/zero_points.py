"""Asymmetric 4-bit groups on XNNPACK's symmetric kernels (a recipe's ``quantizer: {zero_points: [globs]}``; PTQ).

XNNPACK's 4-bit group-wise GEMM takes symmetric codes ``-8..7`` times a scale per group. An asymmetric group (16
levels ``min + d*k``, ``k = 0..15``: llama.cpp's Q4_1, and Q4_K's sub-blocks) is the same codes shifted,
``d*(k - 8) + c`` with ``c = min + 8d``, so a linear ``y = W x`` splits exactly into

    y = Q x + C m(x)         Q: the symmetric 4-bit codes times d (the recipe's own 4-bit group-wise layer)
                             C: [out, in/group], one offset per group; m(x): the mean of each group of x's inputs

``ZeroPointLinear`` computes that: ``main`` (``Q``, quantized like any 4-bit linear of the recipe, with the scales
``d`` given) plus ``offsets`` (``C``, an 8-bit per-channel linear, ``8da8w-pc``) of the group means. The means are a
4-D ``mean`` over the two inner dimensions, which XNNPACK's partitioner takes (global average pooling), so the whole
layer stays in the delegate. Both GEMMs quantize their inputs to int8 per token, as every 8da recipe does: the group
means are multiplied by ``ALPHA`` first so that their rounding (at the token's step) moves ``C m(x)`` little.

A model read from a Q4_1 or Q4_K GGUF holds weights exactly on such groups: the split keeps them (the 4-bit scale in
bf16 and the 8-bit offsets aside) where a symmetric grid rounds each a second time. Cost: the offsets, one int8 per
group and output (1/32 of the weights at 8 bits: +0.25 bit per weight) and a scale per output.

Example::

    parts = split(linear.weight, group=32)              # (main weight on the symmetric grid, its scales, offsets)
    attach(model, {"model.layers.0.mlp.down_proj": parts})   # the linear becomes a ZeroPointLinear, same function
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch

ALPHA = 8.0  # the group means are scaled by this before the offsets' GEMM quantizes them (see the module docstring)


def group_means(x: torch.Tensor, group: int) -> torch.Tensor:
    """The mean of each ``group`` consecutive features of ``x`` ``[..., n]``: ``[..., n / group]``, computed as the
    4-D mean over the two inner dimensions that XNNPACK lowers (a 3-D ``mean`` would run outside the delegate)."""
    n = x.shape[-1]
    means = x.reshape(-1, n // group, group, 1).mean(dim=(2, 3), keepdim=True)
    return means.reshape(*x.shape[:-1], n // group)


class ZeroPointOffsets(torch.nn.Linear):
    """The offsets ``C`` of a ``ZeroPointLinear`` (its own type, so that recipes quantize it at 8 bits per channel
    and never as a 4-bit layer)."""


class ZeroPointLinear(torch.nn.Module):
    """``main(x) + offsets(ALPHA * group_means(x))``: a linear whose 4-bit groups have a zero point each."""

    def __init__(self, main: torch.nn.Linear, offsets: ZeroPointOffsets, group: int):
        super().__init__()
        self.main, self.offsets, self.group = main, offsets, group
        self.in_features, self.out_features = main.in_features, main.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x) + self.offsets(group_means(x, self.group) * ALPHA)


def split(
    weight: torch.Tensor, group: int, bits: int = 4, scale_dtype: torch.dtype | None = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(main, scales, offsets)`` of ``weight`` ``[out, in]``: each group of ``group`` inputs rounded to its
    asymmetric ``2**bits`` levels from its min to its max (``scales`` ``[out, in/group]``, in ``scale_dtype`` as the
    kernel keeps them), ``main = scales * (k - 2**(bits-1))`` on the symmetric grid, and ``offsets`` ``[out,
    in/group]`` such that ``main + offsets / ALPHA`` (each offset over its group) is the rounded weight."""
    out, n = weight.shape
    w = weight.detach().float().reshape(out, n // group, group)
    low, high = w.amin(-1), w.amax(-1)
    levels = 2**bits - 1
    scales = ((high - low) / levels).clamp(min=torch.finfo(torch.float32).eps)
    if scale_dtype is not None:
        scales = scales.to(scale_dtype).float()
    half = 2 ** (bits - 1)
    codes = torch.clamp(torch.round((w - low[..., None]) / scales[..., None]), 0, levels) - half
    main = (codes * scales[..., None]).reshape(out, n)
    offsets = (low + half * scales) * group / ALPHA  # times ALPHA * mean = the sum of the group's inputs
    return main.to(weight.dtype), scales, offsets.to(weight.dtype)


def chosen(names: list[str], patterns: list[str] | tuple[str, ...]) -> list[str]:
    """The names among ``names`` that any of ``patterns`` (fnmatch globs) matches."""
    return [n for n in names if any(fnmatchcase(n, p) for p in patterns)]


def attach(model: torch.nn.Module, parts: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Replace each linear named in ``parts`` (``{module name: (main weight, offsets)}``, from ``split``) by a
    ``ZeroPointLinear`` holding them (in place; a bias stays with ``main``)."""
    for name, (main_w, offsets) in parts.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        main = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
        main = main.to(device=old.weight.device, dtype=old.weight.dtype)
        main.weight.data.copy_(main_w)
        if old.bias is not None:
            main.bias.data.copy_(old.bias.data)
        off = ZeroPointOffsets(offsets.shape[1], old.out_features, bias=False)
        off = off.to(device=old.weight.device, dtype=old.weight.dtype)
        off.weight.data.copy_(offsets)
        group = old.in_features // offsets.shape[1]
        setattr(parent, child, ZeroPointLinear(main, off, group))
