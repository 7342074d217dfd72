"""A trained graph's weights in the HF model: its parameters keyed by HF names, copied into an HF model; the
check that a state dict holds no NaN/inf; a state moved to another device whole (``state_on``)."""

from __future__ import annotations

import torch

from qharness.errors import UserError


def state_on(state: dict, device) -> dict:
    """``state`` (a ``state_dict()``) detached onto ``device``, with its module versions (``_metadata``) kept: loaded
    without them, torchao's observers take the state for version 1 and reset their ``eps`` buffers (XNNPACK's 2**-12
    becomes float32's eps).

    Example::

        graph.load_state_dict(state_on(trained.state_dict(), "cpu"))
    """
    from collections import OrderedDict

    out = OrderedDict((k, v.detach().to(device)) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


def plain_tensors_to(module: torch.nn.Module, device) -> int:
    """Move the tensors ``module``'s submodules hold as plain attributes (neither parameters nor buffers) to
    ``device``, which ``module.to(device)`` leaves where they were; returns how many moved. torchao's range-learning
    fake quantizers are such modules: a symmetric one keeps its zero point as a plain tensor beside its scale (a
    parameter), so a graph trained on a GPU and moved to CPU by Lightning held a CUDA zero point ("Expected all
    tensors to be on the same device", seen on an H200).

    Example::

        graph.cpu(); plain_tensors_to(graph, "cpu")
    """
    moved = 0
    device = torch.device(device)
    for m in module.modules():
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.device != device:
                setattr(m, name, value.to(device))
                moved += 1
    return moved


def check_finite_state(state: dict, where: str) -> None:
    """Refuse a state dict with a NaN anywhere, or an inf outside an observer's running min/max (which start at
    +-inf): a diverged run's weights would train, export or resume into NaN (``where`` names the file)."""
    for name, t in state.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            continue
        ok = ~torch.isnan(t) if name.endswith(("min_val", "max_val")) else torch.isfinite(t)
        if not bool(ok.all()):
            raise UserError(
                f"{where} holds NaN/inf values in {name} ({(~ok).sum().item()} of {t.numel()}): it was saved after "
                "training diverged",
                fix="use an earlier checkpoint (or train again with a lower model.lr)",
            )


def hf_weights(named_parameters, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """A trained graph's ``model.*`` parameters (``(name, tensor)`` pairs, names as in the graph, ``skip`` left
    out) keyed by the HF model's parameter names, e.g. ``model.model.layers.0.mlp.up_proj.weight`` ->
    ``model.layers.0.mlp.up_proj.weight`` (layer-wise graphs' names mapped back with ``layerwise.hf_name``)."""
    from qharness.training.layerwise import hf_name

    return {
        hf_name(k)[len("model.") :]: v.detach() for k, v in named_parameters if k.startswith("model.") and k not in skip
    }


def load_weights_into(weights: dict[str, torch.Tensor], hf_model) -> None:
    """Copy ``weights`` (keyed by the HF model's parameter names) into ``hf_model``: every parameter must be given.

    Tied parameters (one tensor under several names, e.g. embeddings and lm_head) may appear under any one of their
    names; where training untied them (their values differ), they are untied in ``hf_model`` too.
    """
    from qharness.sources.models import parameter_names, put_weights

    groups = parameter_names(hf_model)
    missing = [names for names in groups if not any(n in weights for n in names)]
    extra = set(weights) - {n for names in groups for n in names}
    if missing or extra:
        raise RuntimeError(f"trained graph and model disagree: missing {missing[:5]}, extra {sorted(extra)[:5]}")
    untied = {}
    with torch.no_grad():
        for names in groups:
            given = [n for n in names if n in weights]
            if any(not torch.equal(weights[n], weights[given[0]]) for n in given[1:]):
                untied.update({n: weights[n] for n in given})  # trained apart (e.g. lm_head with GPTQ's warm start)
                continue
            hf_model.get_parameter(names[0]).copy_(weights[given[0]])
    if untied:
        put_weights(hf_model, untied)


def graph_weight_qparams(graph: torch.fx.GraphModule) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """``{weight name: (scale, zero_point)}`` that each weight fake-quant of a trained PT2E QAT graph computes with now
    (its ``scale``/``zero_point`` buffers: min-max of the weights its observer last saw, i.e. before the optimizer's
    last step, or where ``freeze_observers_after_n_steps`` froze it), for deployment to quantize with exactly
    (``use_learned_qparams``); a LoRA layer's merged weight is named by its base weight. None when a weight
    fake-quant has observed nothing yet (it holds no scale; deployment then computes min-max of the weights).

    Deployment computing min-max of the final weights instead is not the same model: at 4 bits ([-8, 7], scale
    ``amax / 7.5``) each channel's negative extreme sits on the rounding tie -7.5, which any scale difference sends to
    -8 or -7 (issue 52: SmolLM2-135M's converted model scored perplexity 21.3, its fake-quant graph 17.2).
    """
    from qharness.recipes.learned_scales import LearnedScaleFakeQuantize
    from qharness.training.lora import is_adapter
    from qharness.training.prepare import _has_observed
    from qharness.upstream import imports

    _pt2e = imports.pt2e()

    modules = dict(graph.named_modules())
    params = {n for n, _ in graph.named_parameters(remove_duplicate=False)}
    weights_only: dict[torch.fx.Node, set[str]] = {}  # node computed from constants alone -> the base weights it reads
    out = {}
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            weights_only[node] = {node.target} if node.target in params and not is_adapter(node.target) else set()
            continue
        inputs = node.all_input_nodes
        if node.op not in ("call_function", "call_module") or not inputs or not all(i in weights_only for i in inputs):
            continue
        weights_only[node] = set().union(*(weights_only[i] for i in inputs))
        fq = modules.get(node.target) if node.op == "call_module" else None
        if not isinstance(fq, _pt2e.FakeQuantizeBase):
            continue
        if len(weights_only[inputs[0]]) != 1:  # one weight (a LoRA merge: its base weight and adapters)
            raise RuntimeError(
                f"weight fake-quant {node.target} quantizes {sorted(weights_only[inputs[0]])}, not one weight"
            )
        (target,) = weights_only[inputs[0]]
        if isinstance(fq, LearnedScaleFakeQuantize):
            scale, zero_point = fq.calculate_qparams()
        elif not _has_observed(fq):
            return None
        else:
            scale, zero_point = fq.scale, fq.zero_point.long()  # int64, as a min-max observer gives it
        out[target] = (scale.detach().cpu().clone(), zero_point.detach().cpu().clone())
    return out
