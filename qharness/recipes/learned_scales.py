"""Learned weight scales (LSQ) for QAT, carried into the deployed program exactly.

A recipe with ``learn_scales: true`` trains each weight's quantization scale as a parameter
(``LearnedScaleFakeQuantize``: torchao's ``LearnableFakeQuantize``, initialised by min-max on the weight it
quantizes, then trained by backpropagation; the zero point of a symmetric scheme stays 0). Deployment builds a
fresh graph (the static-KV-cache export), whose weight observers would compute min-max scales from the final
weights; ``use_learned_qparams`` swaps them for ``LearnedQParams`` holding the trained scales, so
``convert_pt2e`` quantizes the weights with exactly those.

Example::

    prepared = prepare_qat_pt2e(graph, quantizer)     # quantizer from a learn_scales recipe
    init_learned_scales(prepared)                     # min-max start, scales become parameters
    ...train...
    qparams = learned_qparams(prepared, prefix="model.")   # {"model.layers.0.self_attn.q_proj.weight": (scale, zp)}
    deploy_prepared = prepare_pt2e(cache_graph, deploy_quantizer)
    use_learned_qparams(deploy_prepared, hf_model, qparams)  # before convert_pt2e

Source-level (torchao) recipes use torchao's range learning instead: ``range_learning_qat_config`` makes each linear's
weight fake quantizer static with a trainable scale, ``init_source_scales`` sets it to min-max of the weight (a
parameter from then on), ``learned_qparams`` reads the trained scales by HF weight name, and deployment
(``SourceQuantizer.convert``) hands them to ``QATConfig(base_config, step="convert")`` through
``use_source_scales``, which quantizes each weight with its fake quantizer's scale (``custom_scale``)::

    SourceQuantizer(...).prepare_qat(model); init_source_scales(model)   # scales: min-max, trainable
    ...train...
    qparams = learned_qparams(LogitsOnly(model), prefix="model.")
    quantizer.convert(fresh_fp_model_with_trained_weights, qparams)
"""

from __future__ import annotations

import torch

from qharness.upstream import imports

_pt2e = imports.pt2e()


class LearnedScaleFakeQuantize(_pt2e.LearnableFakeQuantize):
    """LSQ fake quantization of a weight: the scale is an ``nn.Parameter`` (min-max on the first call, then
    trained); for symmetric schemes the zero point is a fixed 0 (no gradient, no optimizer state).

    Its observer runs only to initialise the scale: ``enable_observer`` (which the training loop calls on static
    observers) is ignored once the scale exists, so the learned value is never overwritten by min-max.
    """

    def enable_range_learning(self) -> None:
        super().enable_range_learning()
        if self.zero_point is not None and self.qscheme in (torch.per_channel_symmetric, torch.per_tensor_symmetric):
            self.zero_point.requires_grad = False

    def enable_observer(self, enabled: bool = True) -> None:
        if enabled and self._initialized:
            return  # learning: the observer only ever initialises
        super().enable_observer(enabled)


def learned_weight_fake_quant(config):
    """A PT2E ``QuantizationConfig`` whose weight fake-quant is ``LearnedScaleFakeQuantize`` (same dtype, range and
    scheme; min-max start with the config's eps)."""
    import dataclasses

    w = config.weight
    per_channel = w.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine)
    observer = _pt2e.PerChannelMinMaxObserver if per_channel else _pt2e.MinMaxObserver
    ctr = LearnedScaleFakeQuantize.with_args(observer=observer, eps=2**-12)
    return dataclasses.replace(config, weight=dataclasses.replace(w, observer_or_fake_quant_ctr=ctr))


def _weight_calls(graph: torch.fx.GraphModule):
    """``(fake-quant module, name of the weight it quantizes)`` for every learned-scale fake-quant in ``graph``."""
    modules = dict(graph.named_modules())
    for node in graph.graph.nodes:
        if node.op == "call_module" and isinstance(modules[node.target], LearnedScaleFakeQuantize):
            arg = node.args[0]
            if arg.op != "get_attr":
                raise RuntimeError(f"learned-scale fake-quant {node.target} quantizes {arg}, not a weight")
            yield modules[node.target], arg.target


def init_learned_scales(graph: torch.fx.GraphModule) -> int:
    """Set every learned scale of a prepared QAT graph to min-max of its weight (now) and make it trainable;
    returns how many. Run it before the optimizer is built (the scales must be parameters by then)."""
    n = 0
    with torch.no_grad():
        for fq, target in _weight_calls(graph):
            observer = fq.activation_post_process
            observer.reset_min_max_vals()
            observer(graph.get_parameter(target))
            fq._initialize_or_update_qparams(*observer.calculate_qparams())  # in place once they exist
            fq.enable_range_learning()  # observer off, scale trainable
            n += 1
    return n


def learned_qparams(graph: torch.nn.Module, prefix: str = "") -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{weight name without prefix: (scale, zero_point)}`` of a trained graph, as ``convert_pt2e`` would take them
    (or, for eager modules with torchao fake quantizers, as ``QATConfig(step="convert")`` would)."""
    out = {}
    weights = _weight_calls(graph) if isinstance(graph, torch.fx.GraphModule) else _source_weight_calls(graph)
    for fq, target in weights:
        if not target.startswith(prefix):
            raise RuntimeError(f"weight {target} lacks the prefix {prefix!r}")
        if hasattr(fq, "calculate_qparams"):  # PT2E
            scale, zero_point = fq.calculate_qparams()
        else:  # torchao: what its next forward uses (group-wise: the bf16 value it computes with)
            from qharness.upstream.fixes import xnnpack_bf16_scales

            _keep_positive(fq)
            scale = xnnpack_bf16_scales.kernel_scale(fq.scale, fq.config.granularity, fq.config.dtype)
            zero_point = fq.zero_point
        out[target[len(prefix) :]] = (scale.detach().cpu().clone(), zero_point.detach().cpu().clone())
    return out


def _attr(module, target: str):
    for name in target.split("."):
        module = getattr(module, name)
    return module


class LearnedQParams(_pt2e.ObserverBase):
    """A weight observer of a deploy graph that returns trained ``(scale, zero_point)`` instead of computing them;
    dtype, scheme, channel axis and range are the replaced observer's."""

    def __init__(self, scale: torch.Tensor, zero_point: torch.Tensor, like):
        super().__init__(dtype=like.dtype)
        self.qscheme, self.quant_min, self.quant_max = like.qscheme, like.quant_min, like.quant_max
        self.ch_axis = getattr(like, "ch_axis", -1)
        self.register_buffer("scale", scale.clone())
        self.register_buffer("zero_point", zero_point.clone())

    def forward(self, x):
        return x

    def calculate_qparams(self):
        return self.scale, self.zero_point


def use_learned_qparams(
    prepared: torch.fx.GraphModule, model: torch.nn.Module, qparams: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> int:
    """Swap the weight observers of a prepared deploy graph for the trained ``qparams`` (keyed by ``model``'s
    parameter names; the graph's weights are ``model``'s tensors, so tied names resolve); returns how many.

    Every weight observer must get a trained scale and every trained scale must be used: a mismatch means the
    training and deploy graphs quantize different weights, and the ``.pte`` would not be the trained model.
    """
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p.data_ptr(), []).append(name)
    modules = dict(prepared.named_modules())
    used, missing = set(), []
    for node in prepared.graph.nodes:
        obs = modules.get(node.target) if node.op == "call_module" else None
        if not isinstance(obs, _pt2e.ObserverBase) or node.args[0].op != "get_attr":
            continue
        tensor = _attr(prepared, node.args[0].target)
        key = next((n for n in names.get(tensor.data_ptr(), []) if n in qparams), None)
        if key is None:
            missing.append(node.args[0].target)
            continue
        scale, zero_point = qparams[key]
        expected = (tensor.shape[obs.ch_axis],) if scale.numel() > 1 else scale.shape
        if scale.shape != expected:
            raise RuntimeError(f"learned scale of {key} has shape {tuple(scale.shape)}, the weight needs {expected}")
        setattr(prepared, node.target, LearnedQParams(scale, zero_point, like=obs))
        used.add(key)
    unused = sorted(set(qparams) - used)
    if missing or unused:
        raise RuntimeError(f"learned scales do not match the deploy graph: no scale for {missing}, unused {unused}")
    return len(used)


def quantization_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of ``model``'s parameters that belong to fake quantizers (learned scales and zero points), not to the
    model: they train without weight decay and are not loaded into an FP model."""
    kinds = (_pt2e.FakeQuantizeBase, imports.torchao_qat().FakeQuantizerBase)
    return {
        f"{name}.{p}" if name else p
        for name, m in model.named_modules()
        if isinstance(m, kinds)
        for p, _ in m.named_parameters(recurse=False)
    }


# --- torchao source-level recipes (QATConfig on eager modules) --------------------------------------------------


def range_learning_qat_config(base_config):
    """``QATConfig(step="prepare")`` with the fake-quant configs torchao infers for ``base_config``, its weight
    quantizer made static with ``range_learning`` (one scale per weight group; trainable once ``init_source_scales``
    set it)."""
    from qharness.upstream.fixes import xnnpack_bf16_scales

    activation, weight = xnnpack_bf16_scales.fake_quantize_configs(base_config, range_learning=True)
    return imports.torchao_qat().QATConfig(activation_config=activation, weight_config=weight, step="prepare")


def _source_weight_calls(model: torch.nn.Module):
    """``(range-learning weight fake quantizer, name of the weight it quantizes)`` for every one in ``model``."""
    qat = imports.torchao_qat()
    for name, m in model.named_modules():
        fq = getattr(m, "weight_fake_quantizer", None)
        if isinstance(fq, qat.IntxFakeQuantizer) and fq.config.range_learning:
            yield fq, f"{name}.weight" if name else "weight"


def _group_scale_shape(fq, weight: torch.Tensor) -> tuple[int, int]:
    group = getattr(fq.config.granularity, "group_size", weight.shape[-1])
    return (weight.shape[0], weight.shape[-1] // group)


def _keep_positive(fq, args=None) -> None:
    """Clamp a learned torchao scale to torchao's range-learning floor (``_scale_eps``, 1e-9) in place: an optimizer
    step can push a scale to zero or below (e.g. of an all-zero weight group), which no backend takes. Runs before
    every forward (as ``LearnableFakeQuantize`` does) and before the scales are read for deployment."""
    with torch.no_grad():
        fq.scale.clamp_(min=fq._scale_eps)


def init_source_scales(model: torch.nn.Module) -> int:
    """Set every range-learning weight scale of torchao fake-quantized ``model`` to min-max of its weight (now) and
    make it a trainable parameter (torchao's ``initialize_fake_quantizers``, one weight at a time, no forward pass),
    kept positive (``_keep_positive``); returns how many. Run it once, on freshly prepared modules, before the
    optimizer is built."""
    n = 0
    with torch.no_grad():
        for fq, target in _source_weight_calls(model):
            fq._initialized = True
            fq(model.get_parameter(target))  # min-max scale, then a Parameter (symmetric: zero point 0, fixed)
            fq.register_forward_pre_hook(_keep_positive)
            n += 1
    from qharness.upstream.fixes import xnnpack_bf16_scales

    xnnpack_bf16_scales.learned_kernel_scales(model)  # group-wise scales compute as the kernels' bf16
    return n


def start_source_scales(model: torch.nn.Module, qparams: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Start the trainable scales of ``model``'s range-learning fake quantizers (after ``init_source_scales``) at
    ``qparams`` (keyed by weight name) where given: GPTQ's scales as QAT's warm start (``recipes/gptq.py``); the
    others keep min-max. Returns how many were set."""
    n = 0
    with torch.no_grad():
        for fq, target in _source_weight_calls(model):
            if target in qparams:
                scale = qparams[target][0]
                if tuple(scale.shape) != tuple(fq.scale.shape):
                    raise RuntimeError(
                        f"scale of {target} has shape {tuple(scale.shape)}, its quantizer {tuple(fq.scale.shape)}"
                    )
                fq.scale.copy_(scale.to(fq.scale))
                n += 1
    return n


def use_source_scales(model: torch.nn.Module, qparams: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Give every range-learning weight fake quantizer of ``model`` (a fresh deploy model, prepared) its trained
    ``(scale, zero_point)`` from ``qparams`` (keyed by weight name); returns how many. Every fake quantizer must get
    one and every trained scale must be used (else the ``.pte`` would not be the trained model)."""
    used, missing = set(), []
    for fq, target in _source_weight_calls(model):
        if target not in qparams:
            missing.append(target)
            continue
        scale, zero_point = qparams[target]
        expected = _group_scale_shape(fq, model.get_parameter(target))
        if tuple(scale.shape) != expected:
            raise RuntimeError(f"learned scale of {target} has shape {tuple(scale.shape)}, the weight needs {expected}")
        # custom_scale at convert; the zero point in the fake quantizer's own dtype (int32 by default), as a trained one
        # has it: GPTQ's float zeros otherwise reach the program as float zero-point tensors, another structure
        zp_dtype = getattr(getattr(fq, "config", None), "zero_point_precision", zero_point.dtype)
        fq.scale, fq.zero_point = scale.detach().clone(), zero_point.detach().to(zp_dtype).clone()
        fq._initialized = True
        used.add(target)
    unused = sorted(set(qparams) - used)
    if missing or unused:
        raise RuntimeError(f"learned scales do not match the deploy model: no scale for {missing}, unused {unused}")
    return len(used)
