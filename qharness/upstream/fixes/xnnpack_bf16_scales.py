"""Adaptation: XNNPACK computes group-wise 4-bit weights, and torchao's per-channel 4-bit ones, with bf16 scales.

XNNPACK's ``qb4w`` kernels take their block scales as bf16 (google/XNNPACK PR #6751), and ExecuTorch 1.5.1's
serializer casts a group-wise weight's float32 scales to bf16 (``backends/xnnpack/operators/node_visitor.py``,
``get_quant_params``; pytorch/executorch PR #11031). A program quantized with float32 scales therefore computes with
other weights than its converted graph: on SmolLM2-135M (30 layers, 8da4w) the ``.pte`` and the converted model agreed
on 93% of the decided next tokens, against 95% with bf16 scales, where 95% is what one unit in the last place of the
model's own weights changes (the model's rounding noise).

A torchao per-channel weight of 4 bits or fewer (``PerAxis(0)``; 2- and 3-bit ones ship as 4-bit,
``xnnpack_subbyte.py``) computes the same way: it exports as ``dequantize_affine`` with one block per row, and
ExecuTorch 1.5.1 keeps a 4-bit group as wide as the row group-wise (``qb4w``, bf16 scales included), where it makes
a wider-than-4-bit one per-channel (``backends/xnnpack/operators/quant_params.py``, ``QuantParams.__init__``: "int4
case need more fixes to map qb4w to qc4w. Incorrect scales being passed down to xnnpack"). One real SmolLM2
linear (layer 0's ``q_proj``, 4-bit per channel, 8-bit dynamic activations) lowered alone differs from its converted
graph by 1.2e-3 of its largest output with float32 scales, and by 2.5e-7 (float rounding) with bf16 ones; on the whole
model the ``.pte`` of ``xnnpack_8da3w_pc`` sat at 3.05x the KL of its rounding twin. A torchao 8-bit per-channel
weight lowers as ``qc8w`` and a PT2E per-channel 4-bit one (``quantize_per_channel``) as ``qc4w``: both compute with
their float32 scales (2.9e-7 on the same linear), and stay so.

So every weight XNNPACK computes with bf16 scales is quantized with bf16 scales everywhere: torchao's
``weight_scale_dtype=torch.bfloat16`` at deployment (the weights are quantized with the bf16 scale, whatever chose it:
min-max, HQQ, GPTQ or training) and the same scale precision in QAT's fake quantizers; learned scales train in float32
and compute through their bf16 value. Not a bug upstream (no issue): the kernels' choice. Tests that tell when to
revisit it: tests/test_upstream_fixes.py::test_upstream_xnnpack_still_computes_group_scales_in_bf16 and
::test_upstream_xnnpack_still_computes_torchao_per_channel_4bit_scales_in_bf16.
Retire: when both fail, drop ``weight_scale_dtype`` in ``recipes/torchao.py`` and this module's calls (one of them
failing: narrow ``scale_dtype``).

Example::

    config = Int8DynamicActivationIntxWeightConfig(torch.int4, PerGroup(32), weight_scale_dtype=scale_dtype(PerGroup(32)))
    quantize_(model, qat_config(config))   # torchao's QATConfig(config) refuses weight_scale_dtype
"""

from __future__ import annotations

import dataclasses

import torch

SCALE_DTYPE = torch.bfloat16


def scale_dtype(granularity, weight_dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The scale dtype XNNPACK computes a weight of ``granularity`` and torchao ``weight_dtype`` with: bf16 for groups
    and for per-channel weights of 4 bits or fewer, None (the weight's own float32) for per-channel 8-bit ones.

    >>> scale_dtype(PerAxis(0), torch.int4), scale_dtype(PerAxis(0), torch.int8)
    (torch.bfloat16, None)
    """
    if getattr(granularity, "group_size", None) is not None:
        return SCALE_DTYPE
    return SCALE_DTYPE if weight_dtype is not None and _bits(weight_dtype) <= 4 else None


def _bits(dtype: torch.dtype) -> int:
    from torchao.quantization.quant_primitives import _DTYPE_TO_BIT_WIDTH

    return _DTYPE_TO_BIT_WIDTH[dtype]


def kernel_scale(scale: torch.Tensor, granularity, weight_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``scale`` as the kernel computes with it (bf16 values where ``scale_dtype`` says so), in ``scale``'s own dtype."""
    dtype = scale_dtype(granularity, weight_dtype)
    return scale if dtype is None else _as_bf16(scale.detach())


def _as_bf16(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(SCALE_DTYPE).to(scale.dtype)


def fake_quantize_configs(config, range_learning: bool = False):
    """``(activation, weight)`` fake-quantize configs of a torchao base config whose ``weight_scale_dtype`` is set
    (torchao 0.18's ``QATConfig(config)`` asserts it is not): inferred without it, then the weight fake quantizer's
    scale precision set to it, so QAT's weights are the deployed ones bit for bit. ``range_learning``: the weight
    scale is a float32 parameter (a bf16 one would lose Adam's small steps) that computes through its bf16 value
    (``learned_kernel_scales``)."""
    from torchao.quantization.quant_primitives import MappingType

    from qharness.upstream import imports

    dtype = getattr(config, "weight_scale_dtype", None)
    field = _mapping_field(config)
    mapping = getattr(config, field, MappingType.SYMMETRIC)
    plain = config
    if dtype is not None:
        plain = dataclasses.replace(plain, weight_scale_dtype=None)
    if mapping != MappingType.SYMMETRIC:
        plain = dataclasses.replace(plain, **{field: MappingType.SYMMETRIC})
    activation, weight = imports.torchao_qat().infer_configs(plain)
    if range_learning:
        weight = dataclasses.replace(weight, is_dynamic=False, range_learning=True)
    elif dtype is not None:
        weight = dataclasses.replace(weight, scale_precision=dtype)
    if mapping != MappingType.SYMMETRIC and not range_learning:
        # a learned scale computes with the value it holds: the mapping only picks its start, which a recipe whose
        # learned scales may carry another mapping gives (rounding's scales: recipes/rounding.py, qat_start)
        no_clipping_fake_quantize(weight, mapping)
    return activation, weight


def _mapping_field(config) -> str:
    """The field of a torchao base config that holds its weights' ``MappingType``: ``weight_mapping_type``
    (``Int8DynamicActivationIntxWeightConfig``) or ``mapping_type`` (``IntxWeightOnlyConfig``: embedding tables)."""
    return "weight_mapping_type" if hasattr(config, "weight_mapping_type") else "mapping_type"


def no_clipping_fake_quantize(weight_config, mapping) -> None:
    """Give a weight fake-quantize config torchao's ``SYMMETRIC_NO_CLIPPING_ERR`` scales, which torchao 0.18's
    ``IntxFakeQuantizeConfig`` refuses (SYMMETRIC or ASYMMETRIC only) and its fake quantizer would compute as
    asymmetric: set after construction, and computed by ``upstream/qat_speed.py``'s ``_per_group`` alone
    (``route_no_clipping``: it refuses any input it cannot take rather than fall back to torchao's forward), also
    under ``QHARNESS_UPSTREAM_QAT=1``."""
    from qharness.upstream.qat_speed import route_no_clipping

    route_no_clipping()
    object.__setattr__(weight_config, "mapping_type", mapping)


def qat_config(config):
    """``QATConfig(config, step="prepare")``, for a ``config`` with ``weight_scale_dtype`` too
    (``fake_quantize_configs``)."""
    from torchao.quantization.quant_primitives import MappingType

    from qharness.upstream import imports

    qat = imports.torchao_qat()
    plain = getattr(config, _mapping_field(config), MappingType.SYMMETRIC) == MappingType.SYMMETRIC
    if getattr(config, "weight_scale_dtype", None) is None and plain:
        return qat.QATConfig(config, step="prepare")
    activation, weight = fake_quantize_configs(config)
    return qat.QATConfig(activation_config=activation, weight_config=weight, step="prepare")


def learned_kernel_scales(model: torch.nn.Module) -> int:
    """Make each range-learning weight fake quantizer of ``model`` that XNNPACK computes in bf16 (``scale_dtype``)
    compute with its (float32, trained) scale cast to bf16, as the deployed program will; returns how many."""
    n = 0
    for m in model.modules():
        fq = getattr(m, "weight_fake_quantizer", None)
        if fq is not None and fq.config.range_learning and scale_dtype(fq.config.granularity, fq.config.dtype):
            fq.__class__ = _learned_class(type(fq))
            n += 1
    return n


_LEARNED: dict[type, type] = {}


def _learned_class(base: type) -> type:
    if base in _LEARNED.values():
        return base
    if base not in _LEARNED:

        class KernelScaleFakeQuantizer(base):
            """A range-learning weight fake quantizer whose trained float32 scale computes as bf16."""

            def _per_channel_or_group_forward(self, x):
                from torchao.quantization.qat import fake_quantizer

                if not isinstance(self.scale, torch.nn.Parameter):  # not yet initialised: min-max, then a parameter
                    return super()._per_channel_or_group_forward(x)

                qmin, qmax = fake_quantizer._DTYPE_TO_QVALUE_BOUNDS[self.config.dtype]
                return fake_quantizer._fake_quantize_per_channel_group(
                    x,
                    self.scale.to(SCALE_DTYPE),  # differentiable: the gradient reaches the float32 scale
                    self.zero_point,
                    qmin,
                    qmax,
                    getattr(self.config.granularity, "group_size", None) or x.shape[-1],  # per channel: one group
                    self.config.zero_point_domain,
                )

        _LEARNED[base] = KernelScaleFakeQuantizer
    return _LEARNED[base]
