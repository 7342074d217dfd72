"""QAT speed-up: torchao 0.18's fake quantizers (source-level recipes) computed with fewer passes, bit for bit the
same values and gradients.

torchao's ``IntxFakeQuantizer`` fake-quantizes through ~15 separate autograd ops per call (``choose_qparams_affine``,
then ``quantize_affine`` / ``dequantize_affine`` with ``_Round``'s straight-through gradient and ``clamp``'s mask), each
one a full pass over the tensor that autograd keeps for the backward pass. On SmolLM2-135M (30 layers, 4-bit groups of
32, a 4-bit embedding table tied to ``lm_head``) that is every weight of the model twice per step (forward and
backward) plus every linear's input: the 49152 x 576 table alone is fake-quantized twice, once as the embedding (whose
lookup reads 1024 of its rows at batch 4 x 256) and once as ``lm_head``. Here:

- ``FastIntxFakeQuantizer``: the same ops (reciprocal of the scale, round, zero point, clamp, dequantize), in place,
  in one ``autograd.Function`` that keeps only the clamp's mask for the backward pass, whose gradient is torchao's
  chain written out: ``where(mask, g * scale, 0) * (1 / scale)``. The scales are computed as torchao computes them
  and all-zero groups get scale 1 as
  ``fixes/torchao_zero_groups.py`` makes torchao do. Dynamic int weights (symmetric, per group or per channel) and
  activations (asymmetric, per token) of float32 tensors; any other config (range learning, static scales, other
  dtypes) runs torchao's own forward.
- ``RowwiseFakeQuantizedEmbedding``: an embedding table whose groups lie within rows fake-quantizes only the rows the
  batch looks up (each once: ``torch.unique``), then looks up in them: the same values, and the same gradient (the
  lookup's backward sums a row's uses in the same order; rows not looked up get zero gradient either way, except a
  row holding NaN or inf, whose zero gradient torchao would turn into NaN: training has diverged by then, and
  ``QuantLM.optimizer_step`` stops it).

tests/test_upstream_qat_speed.py compares values and gradients bit for bit against torchao's own modules (and fails
once torchao's numerics change). ``QHARNESS_UPSTREAM_QAT=1`` turns this off (torchao's own modules train).
Retire: when torchao's fake quantizers are fused upstream (no faster than these), delete this module and its call in
``training/prepare.py``.

Example::

    SourceQuantizer(configs).prepare_qat(model)
    install(model)   # -> how many fake quantizers and tables were swapped; the same training, fewer passes
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def upstream_qat() -> bool:
    """``QHARNESS_UPSTREAM_QAT=1``: train with torchao's own fake quantizers."""
    return os.environ.get("QHARNESS_UPSTREAM_QAT") == "1"


def _fake_quantize(x, scale, inverse, zero_point, quant_min: int, quant_max: int, keep_mask: bool):
    """``(dequantize(quantize(x)), mask)`` with torchao's ``_do_fake_quantize_affine`` ops (INT zero-point domain) in
    place: ``x`` grouped as ``[..., groups, group]``; ``scale``, ``inverse`` (``1.0 / scale`` in the scale's own dtype,
    as torchao computes it) and ``zero_point`` as ``[..., groups, 1]`` tensors of ``x``'s dtype; ``mask`` (``clamp``'s:
    where the rounded value was in range) when ``keep_mask``, else None."""
    q = x * inverse
    q.round_()
    q.add_(zero_point)
    mask = q.ge(quant_min).logical_and_(q.le(quant_max)) if keep_mask else None
    q.clamp_(quant_min, quant_max)
    q.sub_(zero_point)  # dequantize: (q - zero_point) * scale
    q.mul_(scale)
    return q, mask


class _FakeQuantize(torch.autograd.Function):
    """``_fake_quantize`` with the gradient torchao's op chain computes: ``dequantize``'s ``* scale``, ``clamp``'s
    mask, ``_Round``'s identity, ``quantize``'s ``* (1 / scale)`` (scale and zero point carry none: computed under
    ``no_grad``, as torchao's ``choose_qparams_affine``)."""

    @staticmethod
    def forward(ctx, x, scale, inverse, zero_point, quant_min, quant_max):
        q, mask = _fake_quantize(x, scale, inverse, zero_point, quant_min, quant_max, keep_mask=True)
        ctx.save_for_backward(mask, scale, inverse)
        return q

    @staticmethod
    def backward(ctx, grad):
        mask, scale, inverse = ctx.saved_tensors
        out = (grad * scale).masked_fill_(~mask, 0)  # clamp's backward: where(mask, grad, 0)
        return out.mul_(inverse), None, None, None, None, None


def _apply(x, scale, zero_point, quant_min, quant_max):
    """Fake-quantize ``x`` (``[..., groups, group]``) with ``scale`` and ``zero_point`` (``[..., groups]``, torchao's
    dtypes: e.g. bf16 and int32), differentiable in ``x`` when autograd needs it."""
    inverse = (1.0 / scale).unsqueeze(-1).to(x.dtype)  # in the scale's dtype, as torchao's quantize_affine computes it
    # bf16 scales and int32 zero points are exact in float32: the values torchao's mixed-dtype ops promote them to
    scale, zero_point = scale.unsqueeze(-1).to(x.dtype), zero_point.unsqueeze(-1).to(x.dtype)
    if torch.is_grad_enabled() and x.requires_grad:
        return _FakeQuantize.apply(x, scale, inverse, zero_point, quant_min, quant_max)
    with torch.no_grad():
        return _fake_quantize(x, scale, inverse, zero_point, quant_min, quant_max, keep_mask=False)[0]


def _zero_groups_to_one(scale, zero_point, lo, hi, quant_min, quant_max):
    """``fixes/torchao_zero_groups.exact_zero_groups`` from the groups' min and max: scale 1 where a group is all
    zeros (min == max == 0) and its zero point is in range."""
    zero = (lo == 0) & (hi == 0) & (zero_point >= quant_min) & (zero_point <= quant_max)
    return torch.where(zero, torch.ones_like(scale), scale)


def _per_group(fq, x: torch.Tensor) -> torch.Tensor:
    """torchao's ``_per_channel_or_group_forward`` for a symmetric, dynamic config (``get_group_qparams_symmetric``,
    then ``_fake_quantize_per_channel_group`` as ``torchao_zero_groups`` patches it)."""
    from torchao.quantization.granularity import PerAxis
    from torchao.quantization.quant_primitives import _DTYPE_TO_BIT_WIDTH, _DTYPE_TO_QVALUE_BOUNDS, MappingType

    config = fq.config
    rows, cols = x.shape
    group = cols if isinstance(config.granularity, PerAxis) else config.granularity.group_size
    bits = _DTYPE_TO_BIT_WIDTH[config.dtype]
    choose_min, choose_max = (-1, 0) if bits == 1 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    eps = config.eps if config.eps is not None else torch.finfo(x.dtype).smallest_normal
    grouped = x.view(rows, cols // group, group)
    with torch.no_grad():  # choose_qparams_affine (symmetric), as torchao computes it
        lo, hi = grouped.amin(-1), grouped.amax(-1)  # (torch.aminmax along rows is ~10x slower here)
        min_neg = torch.min(lo, torch.zeros_like(lo))
        max_pos = torch.max(hi, torch.zeros_like(hi))
        if config.mapping_type == MappingType.SYMMETRIC_NO_CLIPPING_ERR:  # choose_qparams_affine's rule
            smin, smax = min_neg / float(choose_min), max_pos / float(choose_max)
            scale = torch.where(smin > smax, smin, smax)
        else:
            scale = torch.max(-min_neg, max_pos) / (float(choose_max - choose_min) / 2)
        zero_point = torch.full_like(scale, int((choose_max + choose_min + 1) / 2))
        scale = torch.clamp(scale, min=eps).to(dtype=config.scale_precision or x.dtype)
        zero_point = zero_point.to(config.zero_point_precision)
        quant_min, quant_max = _DTYPE_TO_QVALUE_BOUNDS[config.dtype]
        used = _zero_groups_to_one(scale, zero_point, lo, hi, quant_min, quant_max)
    fq.scale, fq.zero_point = scale, zero_point
    out = _apply(grouped, used, zero_point, quant_min, quant_max)
    return out.view(rows, cols)


def _per_token(fq, x: torch.Tensor) -> torch.Tensor:
    """torchao's ``_per_token_forward`` (asymmetric, ``choose_qparams_affine`` then ``_fake_quantize_per_token`` as
    ``torchao_zero_groups`` patches it)."""
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

    config = fq.config
    quant_min, quant_max = _DTYPE_TO_QVALUE_BOUNDS[config.dtype]
    eps = config.eps if config.eps is not None else torch.finfo(x.dtype).smallest_normal
    with torch.no_grad():  # choose_qparams_affine (asymmetric), as torchao computes it
        lo, hi = x.amin(-1), x.amax(-1)
        min_neg = torch.min(lo, torch.zeros_like(lo))
        max_pos = torch.max(hi, torch.zeros_like(hi))
        scale = (max_pos - min_neg) / float(quant_max - quant_min)
        scale = torch.clamp(scale, min=eps)
        zero_point = quant_min - torch.round(min_neg / scale)
        zero_point = torch.clamp(zero_point, quant_min, quant_max)
        scale = scale.to(dtype=config.scale_precision or x.dtype)
        zero_point = zero_point.to(dtype=config.zero_point_precision or torch.int32)
        used = _zero_groups_to_one(scale, zero_point, lo, hi, quant_min, quant_max)
    fq.scale, fq.zero_point = scale, zero_point
    return _apply(x, used, zero_point, quant_min, quant_max)


def _fast_kind(config, x: torch.Tensor) -> str | None:
    """``"group"``, ``"token"`` or None (torchao's own forward) for this config and input."""
    from torchao.quantization.granularity import PerAxis, PerGroup, PerToken
    from torchao.quantization.quant_primitives import MappingType, ZeroPointDomain

    if (
        not config.is_dynamic
        or config.range_learning
        or config.zero_point_domain != ZeroPointDomain.INT
        or x.dtype != torch.float32
        or not x.is_contiguous()
    ):
        return None
    if isinstance(config.granularity, PerToken) and config.mapping_type == MappingType.ASYMMETRIC:
        return "token"
    granularity = config.granularity
    per_rows = isinstance(granularity, PerGroup) or (isinstance(granularity, PerAxis) and granularity.axis == 0)
    symmetric = (MappingType.SYMMETRIC, MappingType.SYMMETRIC_NO_CLIPPING_ERR)
    if per_rows and config.mapping_type in symmetric and x.dim() == 2:
        group = x.shape[-1] if isinstance(granularity, PerAxis) else granularity.group_size
        if group > 1 and x.shape[-1] % group == 0:
            return "group"
    return None


def _no_clipping(config) -> bool:
    from torchao.quantization.quant_primitives import MappingType

    return getattr(config, "mapping_type", None) == MappingType.SYMMETRIC_NO_CLIPPING_ERR


def route_no_clipping() -> None:
    """Make every torchao ``IntxFakeQuantizer`` whose config has ``SYMMETRIC_NO_CLIPPING_ERR`` scales (set by
    ``fixes/xnnpack_bf16_scales.no_clipping_fake_quantize``; torchao 0.18's config refuses them and its forward would
    compute them as asymmetric) fake-quantize with ``_per_group``, whether or not ``install`` swapped it; any input
    ``_per_group`` cannot take is refused. Idempotent. Test that tells when to retire it:
    tests/test_upstream_qat_speed.py::test_upstream_torchao_still_refuses_no_clipping_fake_quantization."""
    from torchao.quantization.qat import IntxFakeQuantizer

    if getattr(IntxFakeQuantizer.forward, "_qharness_no_clipping", False):
        return
    original = IntxFakeQuantizer.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled and _no_clipping(self.config):
            if _fast_kind(self.config, x) != "group":
                raise RuntimeError(
                    f"symmetric_no_clipping_err fake quantization of a {x.dtype} {tuple(x.shape)} tensor: only "
                    "contiguous float32 2-D weights whose width the group divides (torchao's own forward would "
                    "compute it as asymmetric)"
                )
            return _per_group(self, x)
        return original(self, x)

    forward._qharness_no_clipping = True
    IntxFakeQuantizer.forward = forward


_FAST: dict[type, type] = {}


def _fast_class(base: type) -> type:
    if base not in _FAST:

        class FastIntxFakeQuantizer(base):
            """torchao's ``IntxFakeQuantizer``, its dynamic int fake quantization in fewer passes (this module's
            docstring); the same values and gradients."""

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                kind = _fast_kind(self.config, x) if self.enabled else None
                if kind == "group":
                    return _per_group(self, x)
                if kind == "token":
                    return _per_token(self, x)
                return super().forward(x)

        _FAST[base] = FastIntxFakeQuantizer
    return _FAST[base]


_ROWWISE = None


def _rowwise_class():
    global _ROWWISE
    if _ROWWISE is None:
        from torchao.quantization.granularity import PerAxis, PerGroup
        from torchao.quantization.qat.embedding import FakeQuantizedEmbedding

        class RowwiseFakeQuantizedEmbedding(FakeQuantizedEmbedding):
            """torchao's ``FakeQuantizedEmbedding`` that fake-quantizes only the rows a batch looks up (this module's
            docstring); the same values and gradients."""

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                fq = self.weight_fake_quantizer
                config = getattr(fq, "config", None)
                granularity = getattr(config, "granularity", None)
                if (
                    fq is None
                    or not getattr(fq, "enabled", False)
                    or getattr(config, "range_learning", True)
                    or not getattr(config, "is_dynamic", False)
                    or not (
                        isinstance(granularity, PerGroup)
                        or (isinstance(granularity, PerAxis) and granularity.axis == 0)
                    )
                    or self.max_norm is not None
                    or self.scale_grad_by_freq
                    or self.sparse
                ):
                    return super().forward(x)
                rows, index = torch.unique(x, return_inverse=True)
                padding = None
                if self.padding_idx is not None:
                    at = int(torch.searchsorted(rows, self.padding_idx))
                    padding = at if at < rows.numel() and int(rows[at]) == self.padding_idx else None
                table = fq(self.weight.index_select(0, rows))
                return F.embedding(index, table, padding, None, self.norm_type, False, False)

        _ROWWISE = RowwiseFakeQuantizedEmbedding
    return _ROWWISE


def install(model: torch.nn.Module) -> int:
    """Swap ``model``'s torchao fake quantizers (``IntxFakeQuantizer``) for ``FastIntxFakeQuantizer`` and its
    ``FakeQuantizedEmbedding`` tables for ``RowwiseFakeQuantizedEmbedding`` (in place: same parameters, state dict and
    configs); returns how many modules were swapped (0 under ``QHARNESS_UPSTREAM_QAT=1``). Call it after
    ``QATConfig(step="prepare")`` (``SourceQuantizer.prepare_qat``), on eager modules that train as they are (not
    ones to be exported: ``torch.export`` would trace the functions' forward alone)."""
    if upstream_qat():
        return 0
    from torchao.quantization.qat import IntxFakeQuantizer
    from torchao.quantization.qat.embedding import FakeQuantizedEmbedding

    from qharness.upstream.fixes import torchao_zero_groups

    torchao_zero_groups.install()  # the fast path computes what torchao computes with this fix
    n = 0
    for m in model.modules():
        if type(m) is IntxFakeQuantizer:
            m.__class__ = _fast_class(IntxFakeQuantizer)
            n += 1
        elif type(m) is FakeQuantizedEmbedding:
            m.__class__ = _rowwise_class()
            n += 1
    return n
