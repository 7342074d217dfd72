"""The weights a PTQ recipe deploys when it chooses them itself (``rounding: weighted``, ``zero_points``).

``round_weights`` goes once over the FP model's linears that such a step quantizes: a zero-point layer is split into
its symmetric 4-bit part and its offsets (``recipes/zero_points.py``), any other is rounded with the scales
``rounding: weighted`` searched (``recipes/scale_search.py``) or else with its min-max scales. What comes out is
what the flow already carries for GPTQ: weights and scales keyed by weight name (``SourceQuantizer.convert(model,
qparams)`` quantizes each weight with its given scale, and the parity gate checks every scale reached the program),
plus the zero-point layers, attached to each deploy copy of the model by ``Rounded.load``.

Example::

    rounded = round_weights(model, recipe.make_quantizer(is_qat=False), calibration_blocks)
    deploy_model = copy.deepcopy(model); rounded.load(deploy_model)   # zero-point layers attached, weights rounded
    quantizer.convert(deploy_model, rounded.qparams)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from qharness.errors import UserError
from qharness.progress import stage
from qharness.recipes import scale_search, zero_points
from qharness.recipes import smoothing as smoothing_
from qharness.recipes.gptq import grid, symmetric_scale
from qharness.recipes.registration import SourceQuantizer
from qharness.sources.models import put_weights

log = logging.getLogger(__name__)


@dataclass
class Rounded:
    """``weights`` (``{weight name: rounded weight}``), ``qparams`` (``{weight name: (scale, zero_point)}``, for every
    weight the step quantizes with given scales) and ``parts`` (``{module name: (main weight, offsets)}``: the
    zero-point layers)."""

    weights: dict[str, torch.Tensor]
    qparams: dict[str, tuple[torch.Tensor, torch.Tensor]]
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def load(self, model: torch.nn.Module) -> None:
        """Put the rounded weights into ``model`` (a copy of the FP model) and attach its zero-point layers (a tied
        weight among them untied first, as ``put_weights`` unties, so that nothing ties it again)."""
        put_weights(model, {**self.weights, **{f"{n}.weight": main for n, (main, _) in self.parts.items()}})
        zero_points.attach(model, self.parts)


def rounded_layers(model: torch.nn.Module, quantizer) -> dict[str, tuple[torch.nn.Linear, object]]:
    """``{name: (linear, step)}`` of the linears a ``rounded`` step of ``quantizer`` quantizes."""
    return {
        name: (m, step) for name, m, step in quantizer.owners(model) if step.rounded and isinstance(m, torch.nn.Linear)
    }


def rounds_itself(quantizer) -> bool:
    """Whether ``quantizer`` (a ``SourceQuantizer``, or another kind) has a step that ``round_weights`` serves."""
    return isinstance(quantizer, SourceQuantizer) and any(s.rounded for s in quantizer.configs)


def round_weights(
    model: torch.nn.Module, quantizer, blocks: torch.Tensor, weighted: bool, smoothing: float | None = None
) -> Rounded:
    """The rounded weights of ``model`` (an FP HF causal LM, left unchanged) for ``quantizer``'s rounded steps;
    ``weighted``: the symmetric layers' scales searched for their inputs on ``blocks`` (one pass of the model);
    ``smoothing``: the gated MLPs' ``down_proj`` inputs smoothed with that migration strength first
    (``recipes/smoothing.py``: their ``up_proj`` and ``down_proj`` are rounded smoothed); a model whose gated MLPs
    the recipe's ``layers:`` rules all keep out of the rounded layers (e.g. at 8 bits, autotune's plan) smooths none."""
    from torchao.quantization.quant_primitives import MappingType

    layers = rounded_layers(model, quantizer)
    zero = {n for n, (_, step) in layers.items() if zero_points.chosen([n], step.zero_points)}
    source = {name: m.weight for name, (m, _) in layers.items()}  # what each layer rounds: its weight, or smoothed
    mlps, group = [], None
    if smoothing is not None:
        mlps = smoothing_.gated_mlps(model, set(layers))
        if not mlps:  # a model with gated MLPs whose layers: rules keep them all at other schemes smooths none
            linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
            if not smoothing_.gated_mlps(model, linears):
                raise UserError(
                    f"quantizer smoothing: {type(model).__name__} has no gated MLP (gate_proj, up_proj, down_proj) "
                    "whose up and down projections the recipe rounds",
                    fix="drop smoothing from the recipe for this model",
                )
            log.info("smoothing: no gated MLP is rounded (the recipe's layers: rules keep them all at other schemes)")
        groups = {grid(layers[f"{m}.down_proj"][1].config, layers[f"{m}.down_proj"][0].in_features)[2] for m in mlps}
        if len(groups) > 1:
            raise UserError(
                f"quantizer smoothing: the down projections are rounded in groups of {sorted(groups)}; smoothing takes "
                "one group size",
                fix="give every down_proj the same group_size, or drop smoothing",
            )
        group = groups.pop() if groups else None
    names = [n for n in layers if n not in zero] if weighted else []
    seen = list(dict.fromkeys([*names, *(f"{m}.down_proj" for m in mlps)]))  # one pass serves both
    stats = {}
    if seen:
        what = ([f"input power of {len(names)} layers"] if names else []) + (  # weighted scales, smoothing
            [f"smoothing the inputs of {len(mlps)} down projections"] if mlps else []
        )
        with stage(f"{'; '.join(what)} on {len(blocks)} calibration blocks"):
            stats = scale_search.input_statistics(model, seen, blocks)
    factors = {m: smoothing_.factors(stats[f"{m}.down_proj"][1], smoothing, group) for m in mlps}
    for mlp, s in factors.items():
        source[f"{mlp}.up_proj"], source[f"{mlp}.down_proj"] = smoothing_.smoothed(
            source[f"{mlp}.up_proj"], source[f"{mlp}.down_proj"], s
        )
    power = {name: stats[name][0] for name in names}
    for mlp, s in factors.items():  # a smoothed down_proj meets its inputs over s
        if f"{mlp}.down_proj" in power:
            power[f"{mlp}.down_proj"] = power[f"{mlp}.down_proj"] / s**2
    weights, qparams, parts = {}, {}, {}
    with stage(f"rounding {len(layers)} layers ({len(zero)} with zero points)"):
        for name, (m, step) in layers.items():
            qmin, qmax, group = grid(step.config, m.in_features)
            scale_dtype = getattr(step.config, "weight_scale_dtype", None)
            weight = source[name]
            if name in zero:
                main, scales, offsets = zero_points.split(
                    weight, group, bits=(qmax - qmin + 1).bit_length() - 1, scale_dtype=scale_dtype
                )
                parts[name] = (main, offsets)
                qparams[f"{name}.main.weight"] = (scales, torch.zeros_like(scales))
                continue
            if name in power:
                scales = scale_search.search_scales(weight, power[name], qmin, qmax, group, scale_dtype)
            else:
                no_clipping = getattr(step.config, "weight_mapping_type", None) == MappingType.SYMMETRIC_NO_CLIPPING_ERR
                w = weight.detach().float().reshape(-1, group)
                scales = symmetric_scale(w, qmin, qmax, no_clipping).reshape(m.out_features, -1)
                if scale_dtype is not None:
                    scales = scales.to(scale_dtype).float()
            weights[f"{name}.weight"] = scale_search.round_to(weight, scales, qmin, qmax, group)
            qparams[f"{name}.weight"] = (scales, torch.zeros_like(scales))
    return Rounded(weights, qparams, parts)


def qat_start(
    model: torch.nn.Module, recipe, blocks: torch.Tensor | None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """QAT of a recipe that learns the scales its PTQ would choose (``recipe.starts_from_rounding``): ``model`` (the FP
    model, changed in place) takes the weights and zero-point layers ``round_weights`` chooses on ``blocks``, and the
    scales are returned for the learned ones to start from (``learned_scales.start_source_scales``). ``blocks`` None:
    the layers' structure only (min-max split, nothing searched), for a trained state that is loaded next (a
    checkpoint, or the trained weights put into a fresh FP model for deployment)."""
    quantizer = recipe.make_quantizer(is_qat=False)
    if blocks is None:
        rounded = round_weights(model, quantizer, blocks, weighted=False)
    else:
        settings = recipe.settings
        rounded = round_weights(model, quantizer, blocks, settings.rounding == "weighted", settings.smoothing)
    rounded.load(model)
    return rounded.qparams
