"""Fix: torchao 0.18's QAT fake quantizers round the gradient of an all-zero group through subnormal floats.

``IntxFakeQuantizer`` (in torchao's ``FakeQuantizedLinear`` and ``FakeQuantizedEmbedding``: the fake quantizers of
the torchao source-level recipes) clamps its min-max scales at ``torch.finfo(float32).smallest_normal`` (1.2e-38), so
an all-zero group (a zeroed padding row of an embedding table, or of a tied ``lm_head``) gets that scale. Its forward
is exact (zeros). Its straight-through gradient is computed as ``(g * scale) / scale`` (the backward of dequantize,
then of quantize): ``g * scale`` is subnormal and keeps only a few significant bits, so the row's gradient is off by
up to ~1e-4 (relative) and depends on how the loss was scaled. One process accumulating two micro-batches (loss / 2
each) and two FSDP processes (gradients / 2 after) gave the tiny Llama's zero padding row (the tied table's row 0,
through ``lm_head``'s fake quantizer) gradients 1.2e-7 apart; after Adam's first step every element of that row sits at
+-7.5 quantization steps, the 4-bit rounding boundary, so the 3e-10 difference flipped a code of the fake-quantized
table and the two runs ended 1e-3 apart (tests/test_distributed.py::
test_fsdp_shards_torchao_source_recipes_eager_decoder_layers_alike).

The workaround fake-quantizes an all-zero group (zero point in range) with scale 1 instead: the same zeros in the
forward, bit for bit, and the gradient ``g`` itself (what the straight-through estimator means; the scale's own path
gives such a group no gradient either way, its scale being clamped). Other groups are untouched.
No upstream issue filed. Test that tells when to retire it:
tests/test_upstream_fixes.py::test_upstream_fake_quant_still_rounds_zero_group_gradients.
Retire: delete this module and its call in ``SourceQuantizer.prepare_qat`` (qharness/recipes/registration.py).
"""

from __future__ import annotations

import torch

_UPSTREAM: dict[str, object] = {}  # torchao's own functions, as they were before ``install``


def exact_zero_groups(x: torch.Tensor, scale: torch.Tensor, zero_point, quant_min, quant_max) -> torch.Tensor:
    """``scale`` with 1 for each all-zero group of ``x`` (``scale``'s elements in order, each over the next
    ``x.numel() / scale.numel()`` values) whose zero point is within [quant_min, quant_max]: such a group fake-quantizes
    to the same zeros with either scale, and scale 1 keeps its gradient out of subnormal numbers."""
    if scale.numel() == 0 or x.numel() % scale.numel():
        return scale
    zero = x.detach().reshape(*scale.shape, -1).abs().amax(-1) == 0
    if zero_point is not None:
        zp = zero_point.detach().reshape(scale.shape)
        zero &= (zp >= quant_min) & (zp <= quant_max)
    return torch.where(zero, torch.ones_like(scale), scale)


def _per_channel_group(input, scales, zero_points, quant_min, quant_max, group_size, *args, **kwargs):
    from torchao.quantization.quant_primitives import ZeroPointDomain

    domain = args[0] if args else kwargs.get("zero_point_domain", ZeroPointDomain.INT)
    if domain in (ZeroPointDomain.INT, ZeroPointDomain.NONE):  # FLOAT: the zero point is an offset scaled apart
        scales = exact_zero_groups(input, scales, zero_points, quant_min, quant_max)
    return _UPSTREAM["per_channel_group"](input, scales, zero_points, quant_min, quant_max, group_size, *args, **kwargs)


def _per_token(input, scales, zero_points, quant_min, quant_max):
    scales = exact_zero_groups(input, scales, zero_points, quant_min, quant_max)
    return _UPSTREAM["per_token"](input, scales, zero_points, quant_min, quant_max)


def install() -> None:
    """Make torchao's ``IntxFakeQuantizer`` (per-group, per-channel and per-token) fake-quantize all-zero groups with
    scale 1 (process-wide, once; the forward values are unchanged)."""
    if _UPSTREAM:
        return
    from torchao.quantization.qat import fake_quantizer

    _UPSTREAM["per_channel_group"] = fake_quantizer._fake_quantize_per_channel_group
    _UPSTREAM["per_token"] = fake_quantizer._fake_quantize_per_token
    fake_quantizer._fake_quantize_per_channel_group = _per_channel_group
    fake_quantizer._fake_quantize_per_token = _per_token
