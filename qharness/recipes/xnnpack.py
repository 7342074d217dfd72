"""XNNPACK's PT2E quantizer (graph level) and partitioners, with typed settings.

Example (a recipe YAML)::

    quantizer: {name: xnnpack, per_channel: true, dynamic: true, weight_bits: 4, embedding_bits: 4}
    partitioners: [xnnpack_dynamic_quant, xnnpack]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qharness.errors import UserError
from qharness.recipes import embedding
from qharness.recipes.registration import register_partitioner, register_quantizer

# Weight ranges XNNPACK lowers natively: int8 symmetric [-127, 127] (its quantizer's default) and
# int4 [-8, 7], the only range its partitioner maps to 4-bit weights (qc4w); [-7, 7] stays int8.
WEIGHT_RANGES = {8: (-127, 127), 4: (-8, 7)}
ACTIVATION_OBSERVERS = ("histogram", "minmax", "moving_average")


@dataclass(frozen=True)
class XnnpackSettings:
    """``quantizer: {name: xnnpack, ...}``.

    per_channel: one scale per output channel (else one per tensor).
    dynamic: int8 activations quantized per call (else static ranges calibrated on data, PTQ only).
    weight_bits: 8 or 4.
    activation_observer: static activations only: histogram (XNNPACK's default), minmax or moving_average.
    learn_scales: QAT trains each weight's scale (LSQ: a parameter, min-max at the start, no weight decay) and the
        ``.pte`` quantizes the weights with the trained scales (else QAT follows min-max of the current weights).
    embedding_bits: null (embeddings stay FP), 4 or 8: the embedding tables quantized weight-only at source level
        before export (``recipes/embedding.py``: PT2E quantizes linears only); QAT trains them fake-quantized.
    embedding_group_size: the embedding's weights per scale (a power of two); null: one scale per row.
    """

    per_channel: bool = True
    dynamic: bool = True
    weight_bits: int = 8
    activation_observer: str | None = None
    learn_scales: bool = False
    embedding_bits: int | None = None
    embedding_group_size: int | None = 32

    def __post_init__(self):
        embedding.check_fields("xnnpack quantizer", self.embedding_bits, self.embedding_group_size)
        if self.weight_bits not in WEIGHT_RANGES:
            raise UserError(f"xnnpack quantizer: weight_bits={self.weight_bits} is not supported", fix="use 4 or 8")
        if self.activation_observer is not None:
            if self.dynamic:
                raise UserError(
                    "xnnpack quantizer: activation_observer applies to static activations only (dynamic: false)"
                )
            if self.activation_observer not in ACTIVATION_OBSERVERS:
                raise UserError(
                    f"xnnpack quantizer: unknown activation_observer {self.activation_observer!r}",
                    fix=f"use one of {', '.join(ACTIVATION_OBSERVERS)}",
                )


@register_quantizer("xnnpack", XnnpackSettings, kind="pt2e", backend="xnnpack")
def xnnpack_quantizer(settings: XnnpackSettings, is_qat: bool):
    from qharness.upstream import imports
    from qharness.upstream.fixes import xnnpack_scalars

    qmin, qmax = WEIGHT_RANGES[settings.weight_bits]
    config = imports.xnnpack_symmetric_config(
        is_per_channel=settings.per_channel,
        is_dynamic=settings.dynamic,
        is_qat=is_qat,
        weight_qmin=qmin,
        weight_qmax=qmax,
    )
    if is_qat and settings.dynamic:
        config = per_token_activation_fake_quant(config)
    if is_qat and settings.learn_scales:
        from qharness.recipes.learned_scales import learned_weight_fake_quant

        config = learned_weight_fake_quant(config)
    elif is_qat:
        config = deploy_matched_weight_fake_quant(config)
    elif not settings.dynamic:
        config = with_activation_observer(config, settings.activation_observer or "histogram")
    return xnnpack_scalars.xnnpack_quantizer_cls()().set_global(config)


def deploy_matched_weight_fake_quant(config):
    """Make QAT weight fake-quant compute the scale ``convert_pt2e`` will use at deploy time.

    The stock QAT config uses ``FusedMovingAvgObsFakeQuantize`` whose moving-average range (and fused
    kernel) gives scales that differ from the min-max observer used when converting, so the trained
    model and the ``.pte`` disagree. A plain ``FakeQuantize`` with a min-max observer that tracks the
    current weights (``averaging_constant=1``) gives exactly the deploy-time ``amax / qmax``.
    """
    import torch

    from qharness.upstream import imports

    ns = imports.pt2e()
    w = config.weight
    per_channel = w.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine)
    observer = ns.MovingAveragePerChannelMinMaxObserver if per_channel else ns.MovingAverageMinMaxObserver
    ctr = ns.FakeQuantize.with_args(observer=observer.with_args(averaging_constant=1.0), eps=2**-12)
    return dataclasses.replace(config, weight=dataclasses.replace(w, observer_or_fake_quant_ctr=ctr))


def per_token_activation_fake_quant(config):
    """QAT's dynamic activations fake-quantized per token: XNNPACK quantizes a "per-tensor" dynamic activation one
    scale per row (``upstream/fixes/xnnpack_per_token.py``), and the deployed graph is rewritten to match, so QAT
    trains against the same numerics."""
    ctr = _per_token_fake_quantize().with_args(**config.input_activation.observer_or_fake_quant_ctr.p.keywords)
    return dataclasses.replace(
        config, input_activation=dataclasses.replace(config.input_activation, observer_or_fake_quant_ctr=ctr)
    )


_PER_TOKEN = None


def _per_token_fake_quantize():
    """PT2E's ``FakeQuantize`` (switches, buffers, state-dict layout) whose forward quantizes each row (token) with its
    own dynamic range, as XNNPACK's kernels do, passing gradients straight through."""
    global _PER_TOKEN
    if _PER_TOKEN is None:
        from qharness.upstream import imports
        from qharness.upstream.fixes import xnnpack_per_token

        class PerTokenFakeQuantize(imports.pt2e().FakeQuantize):
            def forward(self, X):
                return xnnpack_per_token.fake_quantize_per_token(X) if self.fake_quant_enabled[0] == 1 else X

        _PER_TOKEN = PerTokenFakeQuantize
    return _PER_TOKEN


def with_activation_observer(config, name: str):
    """Static PTQ activations observed with ``histogram`` (XNNPACK's default), ``minmax`` or ``moving_average``."""
    from qharness.upstream import imports

    ns = imports.pt2e()
    observers = {
        "histogram": ns.HistogramObserver,
        "minmax": ns.MinMaxObserver,
        "moving_average": ns.MovingAverageMinMaxObserver,
    }
    ctr = observers[name].with_args(eps=2**-12)
    act = dataclasses.replace(config.input_activation, observer_or_fake_quant_ctr=ctr)
    return dataclasses.replace(config, input_activation=act, output_activation=act)


@register_partitioner("xnnpack", backend="xnnpack")
def xnnpack_partitioner():
    from qharness.upstream import imports

    return imports.xnnpack_partitioner(dynamic_quant=False)


@register_partitioner("xnnpack_dynamic_quant", backend="xnnpack")
def xnnpack_dynamic_quant_partitioner():
    from qharness.upstream import imports

    return imports.xnnpack_partitioner(dynamic_quant=True)
