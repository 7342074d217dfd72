"""torchao source-level quantization (``quantize_`` on modules before export), with typed settings.

Example (a recipe YAML)::

    quantizer: {name: torchao_8da4w, group_size: 32, weight_bits: 4, embedding_bits: 4, embedding_group_size: 32,
                rounding: nearest, learn_scales: false}

Per-layer choices (a recipe's ``layers:``, ``recipes/layers.py``) are these settings per module: XNNPACK lowers
``8da4w-g<N>`` (int4 group-wise), ``8da4w-pc`` and ``8da8w-pc`` (int4 / int8 per channel, ``group_size: null``),
each with int8 dynamic per-token activations, and ``fp``.
"""

from __future__ import annotations

from dataclasses import dataclass

from qharness.errors import UserError
from qharness.recipes import embedding
from qharness.recipes.registration import SourceConfig, SourceQuantizer, register_quantizer

CHOOSE_QPARAMS = ("affine", "hqq_scale_only")
WEIGHT_MAPPINGS = embedding.SCALE_MAPPINGS  # the linears' scale rules are the tables' ones
ROUNDING = ("nearest", "gptq", "weighted")
WEIGHT_BITS = (2, 3, 4, 8)  # linear weights; 2 and 3 are stored as int4 on XNNPACK


@dataclass(frozen=True)
class Torchao8da4wSettings:
    """``quantizer: {name: torchao_8da4w, ...}``: int8 dynamic per-token activations + intN grouped weights on every
    ``nn.Linear`` whose input size the group divides, optionally weight-only embedding quantization.

    group_size: weights per scale (a power of two, 16 or more); null: one scale per output channel.
    weight_bits: 2, 3, 4 or 8 (8: per channel only, ``group_size: null``; XNNPACK lowers no int8 group-wise weights).
        2 and 3: QAT and the ``.pte`` use values of that many bits, which XNNPACK (it lowers 4- and 8-bit weights
        only) stores as int4: the accuracy of 2/3-bit weights at the size and speed of 4-bit ones
        (``upstream/fixes/xnnpack_subbyte.py``); a backend with 2/3-bit kernels would store them smaller.
    embedding_bits: null (embeddings stay FP), 4 or 8: the embedding tables quantized weight-only
        (``recipes/embedding.py``: QAT trains them fake-quantized, the ``.pte`` looks them up with ExecuTorch's
        quantized-embedding kernels).
    embedding_group_size: the embedding's weights per scale (a power of two); null: one scale per row.
    embedding_mapping: how the embedding's scales are chosen, as ``weight_mapping`` below (default ``symmetric``). A
        tied table (one weight for the input embedding and ``lm_head``) whose lookup is 8-bit per row
        (``embedding_bits: 8, embedding_group_size: null``) with the ``lm_head``'s rule (an 8-bit per-channel
        ``layers:`` rule, ``embedding_mapping`` equal to ``weight_mapping``) holds the same int8 values in both
        copies: the program stores them once, in a data file beside the ``.pte`` (``deploy/shared_table.py``).
    untied_embedding_bits: null (every table at ``embedding_bits``), 4 or 8: a table the output projection does not
        share (an untied model's input embedding) at these bits instead, with ``untied_embedding_group_size`` weights
        per scale and ``embedding_mapping``'s rule. A table stored once at 8 bits because it is the head's gains
        nothing at 8 bits where it is not (``xnnpack_8da4w_tied8`` keeps an untied table at 4 bits, as llama.cpp's
        Q4_0 keeps ``token_embd``).
    untied_embedding_group_size: the untied table's weights per scale (a power of two); null: one scale per row.
    choose_qparams: ``affine`` (min-max scales, what QAT's fake quantization trains against) or ``hqq_scale_only``
        (HQQ-optimised scales, export_llm's default for 8da4w PTQ; PTQ-only recipes).
    rounding: ``nearest`` (each weight to its nearest level), ``gptq``: the linear weights are rounded by GPTQ on the
        calibration blocks (``recipes/gptq.py``); PTQ deploys GPTQ's weights and scales; QAT (with ``learn_scales``
        only) starts from GPTQ's weights and scales. Or ``weighted`` (PTQ): each group-wise linear's scales chosen for
        the activations they meet on the calibration blocks (``recipes/scale_search.py``, llama.cpp's importance
        matrix). ``choose_qparams: affine`` only.
    zero_points: fnmatch globs of module names (e.g. ``["*.down_proj"]``) whose 4-bit groups take a zero point each,
        as llama.cpp's Q4_1 and Q4_K blocks do: asymmetric groups on XNNPACK's symmetric kernel plus an 8-bit GEMM of
        the group means (``recipes/zero_points.py``), 0.25 bit per weight more. Group-wise layers only.
    smoothing: null, or SmoothQuant's migration strength α in (0, 1] (0.5 its default): each gated MLP's
        ``down_proj`` input is divided by power-of-two factors, one per weight group, taken into ``up_proj``'s rows
        and ``down_proj``'s columns (``recipes/smoothing.py``): the weights' codes are unchanged (their scales scaled
        exactly), the int8 activations lose less. Group-wise layers only.
        ``rounding: weighted``, ``zero_points`` and ``smoothing`` choose the deployed weights on the calibration blocks
        (PTQ); with ``learn_scales: true`` QAT starts from those weights, zero-point layers and scales instead, and
        trains them (``recipes/rounding.py``: ``qat_start``).
    weight_mapping: how a weight group's min-max scale is chosen. ``symmetric`` (torchao's default):
        ``max|w| / ((qmax - qmin) / 2)`` (4-bit: / 7.5; the largest positive weight is clipped to 7 levels).
        ``symmetric_no_clipping_err``: ``max(min(w) / qmin, max(w) / qmax)``: nothing is clipped, and the side that
        sets the scale lands exactly on its end code (4-bit: a negative extreme on -8, as llama.cpp's Q4_0 puts it). On
        SmolLM2-135M's body (4-bit groups of 32, weights only) perplexity +28% against +35% for ``symmetric``.
        The same rule in QAT's fake quantizers, GPTQ's scales and the ``.pte``; not with ``learn_scales`` (its scales
        start from ``symmetric``) or ``choose_qparams: hqq_scale_only``.
    learn_scales: QAT trains each linear weight group's scale (torchao's range learning, LSQ-style: a parameter,
        min-max at the start, no weight decay) and the ``.pte`` quantizes the linear weights with the trained scales
        (else min-max of the final weights). QAT only, with ``choose_qparams: affine``; quantized embeddings keep
        min-max scales. With a setting that chooses the weights (above), the scales it chose are learned and the
        layers it does not round (per-channel ones, e.g. an 8-bit ``lm_head``) keep min-max scales.
    split_head_input: the output projection (``lm_head``) rounds its input as two int8 rows of one GEMM, the value on
        its token's int8 grid and what that rounding left (``recipes/split_input.py``): about 16 bits for the head's
        input, the weight read once; QAT trains against the same sum. The head must be quantized.
    """

    group_size: int | None = 32
    weight_bits: int = 4
    embedding_bits: int | None = None
    embedding_group_size: int | None = 32
    embedding_mapping: str = "symmetric"
    untied_embedding_bits: int | None = None
    untied_embedding_group_size: int | None = 32
    choose_qparams: str = "affine"
    rounding: str = "nearest"
    learn_scales: bool = False
    weight_mapping: str = "symmetric"
    zero_points: list | None = None
    smoothing: float | None = None
    split_head_input: bool = False

    @property
    def chooses_weights(self) -> str | None:
        """The first setting by which PTQ chooses the deployed weights itself (``recipes/rounding.py``), or None."""
        if self.rounding == "weighted":
            return "rounding: weighted"
        return "zero_points" if self.zero_points else "smoothing" if self.smoothing is not None else None

    def __post_init__(self):
        if self.group_size is not None and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            raise UserError(
                f"torchao_8da4w quantizer: group_size={self.group_size} must be a power of two >= 16",
                fix="use 32 (or 64, 128, 256), or null for one scale per output channel",
            )
        if self.weight_bits not in WEIGHT_BITS:
            raise UserError(
                f"torchao_8da4w quantizer: weight_bits={self.weight_bits} is not supported",
                fix=f"use one of {', '.join(map(str, WEIGHT_BITS))}",
            )
        embedding.check_fields(
            "torchao_8da4w quantizer", self.embedding_bits, self.embedding_group_size, self.embedding_mapping
        )
        embedding.check_fields(
            "torchao_8da4w quantizer",
            self.untied_embedding_bits,
            self.untied_embedding_group_size,
            field="untied_embedding",
        )
        if self.weight_bits == 8 and self.group_size is not None:
            raise UserError(
                f"torchao_8da4w quantizer: weight_bits=8 with group_size={self.group_size}: XNNPACK lowers int8 "
                "weights per channel only",
                fix="set group_size: null (per channel) with weight_bits: 8, or weight_bits: 4",
            )
        if self.choose_qparams not in CHOOSE_QPARAMS:
            raise UserError(
                f"torchao_8da4w quantizer: choose_qparams {self.choose_qparams!r} is unknown",
                fix=f"use {' or '.join(CHOOSE_QPARAMS)}",
            )
        if self.rounding not in ROUNDING:
            raise UserError(
                f"torchao_8da4w quantizer: rounding {self.rounding!r} is unknown", fix=f"use {' or '.join(ROUNDING)}"
            )
        if self.rounding == "gptq" and self.choose_qparams != "affine":
            raise UserError(
                f"torchao_8da4w quantizer: rounding gptq sets its own scales, choose_qparams {self.choose_qparams!r} "
                "computes others",
                fix="leave choose_qparams at affine with rounding: gptq",
            )
        if self.zero_points is not None and (
            not self.zero_points or not all(isinstance(p, str) and p for p in self.zero_points)
        ):
            raise UserError(
                f"torchao_8da4w quantizer: zero_points={self.zero_points!r} must be a non-empty list of module-name globs",
                fix='e.g. zero_points: ["*.down_proj", "*.up_proj"], or leave it out',
            )
        if self.smoothing is not None and (
            isinstance(self.smoothing, bool)
            or not isinstance(self.smoothing, (int, float))
            or not 0 < self.smoothing <= 1
        ):
            raise UserError(
                f"torchao_8da4w quantizer: smoothing={self.smoothing!r} must be a migration strength in (0, 1]",
                fix="use smoothing: 0.5 (SmoothQuant's default), or leave it out",
            )
        if self.chooses_weights and (self.choose_qparams != "affine" or self.rounding == "gptq"):
            other = "rounding: gptq" if self.rounding == "gptq" else f"choose_qparams: {self.choose_qparams}"
            what = self.chooses_weights
            raise UserError(
                f"torchao_8da4w quantizer: {what} with {other}: both choose the weights' scales",
                fix=f"drop {what}, or {other}",
            )
        if self.weight_mapping not in WEIGHT_MAPPINGS:
            raise UserError(
                f"torchao_8da4w quantizer: weight_mapping {self.weight_mapping!r} is unknown",
                fix=f"use {' or '.join(WEIGHT_MAPPINGS)}",
            )
        learned_from_min_max = self.learn_scales and not self.chooses_weights  # else they start from rounding's
        if self.weight_mapping != "symmetric" and (learned_from_min_max or self.choose_qparams != "affine"):
            other = "learn_scales: true" if learned_from_min_max else f"choose_qparams: {self.choose_qparams}"
            raise UserError(
                f"torchao_8da4w quantizer: weight_mapping {self.weight_mapping} with {other}: those scales start "
                "from (or are) another rule",
                fix="set weight_mapping: symmetric in this recipe",
            )
        if self.learn_scales and self.choose_qparams != "affine":
            raise UserError(
                f"torchao_8da4w quantizer: learn_scales trains the scales, choose_qparams {self.choose_qparams!r} "
                "computes them",
                fix="leave choose_qparams at affine with learn_scales: true",
            )


@register_quantizer("torchao_8da4w", Torchao8da4wSettings, kind="source", backend="xnnpack")
def torchao_8da4w(settings: Torchao8da4wSettings, is_qat: bool) -> SourceQuantizer:
    import torch
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

    if is_qat and settings.choose_qparams != "affine":
        raise UserError(
            f"torchao_8da4w quantizer: choose_qparams {settings.choose_qparams!r} has no QAT fake quantization "
            "(it trains affine scales)",
            fix="use it in PTQ-only recipes (modes: [ptq]), or choose_qparams: affine",
        )
    what = settings.chooses_weights
    if is_qat and what and not settings.learn_scales:
        raise UserError(
            f"torchao_8da4w quantizer: {what} chooses the weights' scales once, before deployment (PTQ); QAT's fake "
            "quantization without learned scales trains min-max scales",
            fix="use it in PTQ-only recipes (modes: [ptq]), or add learn_scales: true (QAT starts from its choice)",
        )
    from qharness.recipes.zero_points import ZeroPointOffsets
    from qharness.upstream.fixes import xnnpack_bf16_scales

    bits = {2: torch.int2, 3: torch.int3, 4: torch.int4, 8: torch.int8}
    group = settings.group_size
    granularity = PerAxis(0) if group is None else PerGroup(group)
    zero_points = tuple(settings.zero_points or ()) if group is not None else ()
    configs = []
    if zero_points:  # the offsets of the zero-point layers: int8 per channel (first, so that no 4-bit step takes them)
        configs.append(
            SourceConfig(
                Int8DynamicActivationIntxWeightConfig(
                    weight_dtype=torch.int8, weight_granularity=PerAxis(0), intx_choose_qparams_algorithm="affine"
                ),
                lambda m, fqn: isinstance(m, ZeroPointOffsets),
                "the zero-point layers' offsets",
                required=False,
                scheme=scheme_name(8, None, dynamic_activations=True),
            )
        )
    linear = lambda m: isinstance(m, torch.nn.Linear) and not isinstance(m, ZeroPointOffsets)  # noqa: E731
    configs.append(
        SourceConfig(
            Int8DynamicActivationIntxWeightConfig(
                weight_dtype=bits[settings.weight_bits],
                weight_granularity=granularity,
                intx_choose_qparams_algorithm=settings.choose_qparams,
                weight_mapping_type=MappingType[settings.weight_mapping.upper()],
                # what XNNPACK computes groups and per-channel 4-bit weights with
                weight_scale_dtype=xnnpack_bf16_scales.scale_dtype(granularity, bits[settings.weight_bits]),
            ),
            (lambda m, fqn: linear(m)) if group is None else (lambda m, fqn: linear(m) and m.in_features % group == 0),
            "nn.Linear layers" if group is None else f"nn.Linear layers whose in_features group_size={group} divides",
            # with a setting that chooses the weights, the scales it chose (group-wise layers) are the learned ones
            learn_scales=settings.learn_scales and (group is not None or settings.chooses_weights is None),
            gptq=settings.rounding == "gptq",
            rounded=group is not None and settings.chooses_weights is not None,
            zero_points=zero_points,
            check_model=(lambda model: check_zero_points(model, zero_points)) if zero_points else None,
            scheme=scheme_name(settings.weight_bits, group, dynamic_activations=True),
        )
    )
    where = "torchao_8da4w quantizer"
    quant = embedding.embedding_quant(
        where, settings.embedding_bits, settings.embedding_group_size, settings.embedding_mapping
    )
    untied = embedding.embedding_quant(
        where,
        settings.untied_embedding_bits,
        settings.untied_embedding_group_size,
        settings.embedding_mapping,
        field="untied_embedding",
    )
    if untied is None:  # min-max scales, learned or not
        configs += [embedding.source_config(quant)] if quant is not None else []
    else:  # a table the head shares at embedding_bits, any other at untied_embedding_bits
        configs += [embedding.source_config(quant, tied=True)] if quant is not None else []
        configs.append(embedding.source_config(untied, tied=False, field="untied_embedding"))
    return SourceQuantizer(configs, split_head_input=settings.split_head_input)


def check_zero_points(model, patterns: tuple[str, ...]) -> None:
    """A ``UserError`` unless ``patterns`` match a linear of ``model`` (or a layer that already has zero points)."""
    import torch

    from qharness.recipes.zero_points import ZeroPointLinear, ZeroPointOffsets, chosen

    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, ZeroPointLinear) or (isinstance(m, torch.nn.Linear) and not isinstance(m, ZeroPointOffsets))
    ]
    if not chosen(names, patterns):
        example = ", ".join(n for n in names[:3])
        raise UserError(
            f"torchao_8da4w quantizer: zero_points {list(patterns)} match no linear of {type(model).__name__}",
            fix=f"give globs of its linears' names (e.g. {example})",
        )


def scheme_name(weight_bits: int, group_size: int | None, dynamic_activations: bool) -> str:
    """How ``summary.json`` and ``qharness sensitivity`` name a layer's quantization: ``8da4w-g32`` (int8 dynamic
    activations, int4 weights in groups of 32), ``8da8w-pc`` (int8 weights, one scale per output channel), ``w4-g32``
    (weight-only, embeddings)."""
    weights = f"8da{weight_bits}w" if dynamic_activations else f"w{weight_bits}"
    return f"{weights}-{'pc' if group_size is None else f'g{group_size}'}"
