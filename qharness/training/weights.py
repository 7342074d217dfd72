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
