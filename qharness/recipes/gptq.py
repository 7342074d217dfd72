"""GPTQ rounding (Frantar et al., 2022) for the torchao source-level recipes (``quantizer: {rounding: gptq}``).

Each selected linear's weight is rounded onto the recipe's own grid (its bits, its groups, symmetric scales as
torchao's min-max computes them) one input column at a time, and each column's rounding error is spread over the
columns not yet rounded through the inverse Hessian ``H = X^T X`` of that layer's inputs on the calibration blocks
(the FP model's activations; torchao's ``GPTQConfig`` observes the same way). A group's scale is set when GPTQ reaches
the group, from the weights as updated so far (the reference implementation's ``groupsize`` path).

What comes out is what the flow already carries exactly: weights on the grid (``scale * q``) and their scales,
both keyed by weight name like trained scales (``recipes/learned_scales.py``). PTQ deploys them
(``SourceQuantizer.convert(model, qparams)`` quantizes each weight with its GPTQ scale, and
``round(scale * q / scale) == q``; the parity gate checks every scale reached the program). QAT starts from them
(the warm start, for recipes that learn their scales: min-max fake quantization would re-round GPTQ's weights onto
another grid): QAT begins from GPTQ's weights and scales, a tied ``lm_head`` untied first (``untie_layers``) so
that it is rounded and trained like the other linears.

Example::

    quantizer = recipe.make_quantizer(is_qat=False)
    weights, qparams = gptq_round(model, quantizer, calibration_blocks)   # GPTQ-rounded weights and their scales
    put_weights(model, weights)
    quantizer.convert(model, qparams)                                    # the deployed weights are GPTQ's
"""

from __future__ import annotations

import math

import torch

from qharness.progress import stage
from qharness.sources.models import put_weights, tied

DAMP = 0.01  # of the mean Hessian diagonal, added to it (the reference's percdamp)
BLOCK = 128  # columns rounded together before the error reaches the rest (a multiple of every group size)


def grid(config, in_features: int) -> tuple[int, int, int]:
    """``(qmin, qmax, group)`` of a torchao ``Int8DynamicActivationIntxWeightConfig``: symmetric ``weight_dtype``
    codes, ``group`` columns per scale (``in_features`` for one scale per output channel)."""
    bits = {torch.int2: 2, torch.int3: 3, torch.int4: 4, torch.int8: 8}[config.weight_dtype]
    group = getattr(config.weight_granularity, "group_size", None) or in_features
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1, group


def symmetric_scale(w: torch.Tensor, qmin: int, qmax: int, no_clipping: bool = False) -> torch.Tensor:
    """torchao's symmetric min-max scale of each row of ``w`` ``[out, n]``: ``max|w| / ((qmax - qmin) / 2)``, or
    (``no_clipping``: ``MappingType.SYMMETRIC_NO_CLIPPING_ERR``) ``max(min(w, 0) / qmin, max(w, 0) / qmax)``."""
    if no_clipping:
        scale = torch.maximum(w.amin(dim=1).clamp(max=0) / qmin, w.amax(dim=1).clamp(min=0) / qmax)
    else:
        scale = w.abs().amax(dim=1) / ((qmax - qmin) / 2)
    return scale.clamp(min=torch.finfo(torch.float32).eps)


def gptq_layer(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    qmin: int,
    qmax: int,
    group: int,
    damp: float = DAMP,
    scale_dtype: torch.dtype | None = None,
    no_clipping: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of one weight ``[out, in]`` with its input Hessian ``[in, in]``: ``(codes [out, in] int8, scales
    [out, in // group])`` with ``codes * scales`` (per group) the rounded weight. ``scale_dtype``: the precision the
    program's kernels compute the scales in (bf16 for XNNPACK's groups): GPTQ rounds onto that grid. ``no_clipping``:
    each group's scale by ``MappingType.SYMMETRIC_NO_CLIPPING_ERR`` (``symmetric_scale``)."""
    w = weight.detach().to(torch.float64).clone()
    h = hessian.to(torch.float64).clone()
    out_f, in_f = w.shape
    if in_f % group:
        raise ValueError(f"group {group} does not divide in_features {in_f}")
    dead = torch.diag(h) == 0  # inputs that never fire: nothing to spread their error over
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(in_f, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros(out_f, in_f, dtype=torch.int8)
    scales = torch.zeros(out_f, in_f // group, dtype=torch.float64)
    block = math.lcm(BLOCK, group) if group < in_f else in_f
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros_like(w[:, i1:i2]), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group == 0:  # a new group: its scale from the weights as GPTQ has updated them
                scale = symmetric_scale(w1[:, i : i + group], qmin, qmax, no_clipping)
                scales[:, col // group] = scale if scale_dtype is None else scale.float().to(scale_dtype).double()
            s = scales[:, col // group]
            q = torch.clamp(torch.round(w1[:, i] / s), qmin, qmax)
            codes[:, col] = q.to(torch.int8)
            err = (w1[:, i] - q * s) / hinv1[i, i]
            w1[:, i:] -= err.unsqueeze(1) @ hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return codes, scales.to(torch.float32)


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``codes * scale`` per group: the weight a program with these codes and scales computes with (fp32)."""
    group = codes.shape[1] // scales.shape[1]
    return (codes.to(torch.float32) * scales.repeat_interleave(group, dim=1)).contiguous()


def hessians(model: torch.nn.Module, layers: dict[str, torch.nn.Linear], blocks: torch.Tensor, batch_size: int = 8):
    """``{name: X^T X / n}`` of each linear's inputs over ``blocks`` ``[n, seq_len]`` of tokens (the FP model)."""
    sums = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in layers.items()}
    count = [0]

    def hook(name):
        def record(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64).cpu()
            sums[name] += x.T @ x

        return record

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in layers.items()]
    try:
        with torch.no_grad():
            for i in range(0, len(blocks), batch_size):
                x = blocks[i : i + batch_size]
                model(input_ids=x.to(next(model.parameters()).device))
                count[0] += x.numel()
    finally:
        for h in handles:
            h.remove()
    return {name: 2 * s / count[0] for name, s in sums.items()}


def gptq_layers(model: torch.nn.Module, quantizer) -> dict[str, tuple[torch.nn.Linear, object]]:
    """``{module name: (linear, torchao config)}`` of the linears a ``SourceQuantizer``'s GPTQ steps quantize."""
    return {
        name: (m, step.config)
        for name, m, step in quantizer.owners(model)
        if step.gptq and isinstance(m, torch.nn.Linear)
    }


def untie_layers(model: torch.nn.Module, quantizer) -> list[str]:
    """Give each GPTQ layer whose weight is tied to another module (a tied ``lm_head``) a weight of its own, so GPTQ
    can round it and QAT train it apart from the embedding; returns their weight names."""
    shared = tied(model)
    names = [f"{n}.weight" for n in gptq_layers(model, quantizer) if f"{n}.weight" in shared]
    put_weights(model, {n: model.get_parameter(n) for n in names})
    return names


def gptq_round(
    model: torch.nn.Module, quantizer, blocks: torch.Tensor, damp: float = DAMP
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """GPTQ of every GPTQ layer of ``model`` (an FP HF causal LM, left unchanged): ``(weights, qparams)``, the
    rounded weights and their ``(scale, zero_point)``, both keyed by weight name (``put_weights`` puts the weights
    into a model; ``SourceQuantizer.convert`` takes the qparams). The Hessians come from one pass of the FP model
    over ``blocks``."""
    from torchao.quantization.quant_primitives import MappingType

    layers = gptq_layers(model, quantizer)
    if not layers:
        raise ValueError("the recipe rounds no layer with GPTQ")
    with stage(f"GPTQ: Hessians of {len(layers)} layers' inputs on {len(blocks)} calibration blocks"):
        hs = hessians(model, {name: m for name, (m, _) in layers.items()}, blocks)
    weights, qparams = {}, {}
    with stage(f"GPTQ: rounding {len(layers)} layers"):
        for name, (m, config) in layers.items():
            qmin, qmax, group = grid(config, m.in_features)
            scale_dtype = getattr(config, "weight_scale_dtype", None)
            no_clipping = getattr(config, "weight_mapping_type", None) == MappingType.SYMMETRIC_NO_CLIPPING_ERR
            codes, scales = gptq_layer(m.weight, hs[name], qmin, qmax, group, damp, scale_dtype, no_clipping)
            weights[f"{name}.weight"] = dequantize(codes, scales).to(m.weight.dtype)
            qparams[f"{name}.weight"] = (scales, torch.zeros_like(scales))
    return weights, qparams
