"""Per-decoder-layer training graphs: the units that FSDP shards and activation checkpointing recomputes.

The whole-model export (``prepare.export_for_training``) is one flat graph: no module boundary is left to shard or
to recompute. ``layerwise`` keeps the HF model's outer loop eager (embedding, rotary tables, mask, final norm) and
replaces each decoder layer (and the output head, tied or not) by its own exported, recipe-prepared graph, called with the
tensors the layer was exported with. Deployment is unchanged: it takes the trained weights by their HF names
(``hf_name``) into a fresh model, as for the whole-model graph.

Example::

    root = LogitsOnly(export_layerwise(hf_model, batch_size=2, seq_len=64, quantize=prepare))
    root(input_ids)                                   # the logits the whole-model graph computes
    [name for name, _ in units(root)]                 # ["model.model.layers.0", ..., "model.lm_head"]
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from qharness.errors import UserError

INNER = "qgraph.layer"  # the attribute path a LayerGraph adds before the layer's own parameter names


def hf_name(name: str) -> str:
    """A parameter name of a layerwise root as the same parameter's name in the plain model.

    Example::

        hf_name("model.model.layers.0.qgraph.layer.mlp.up_proj.weight")   # "model.model.layers.0.mlp.up_proj.weight"
    """
    return name.replace(f".{INNER}.", ".")


class _Call(torch.nn.Module):
    """``layer(*args, **kwargs)`` with the tensor leaves as positional inputs and the rest fixed (what is exported)."""

    def __init__(self, layer: torch.nn.Module, spec, constants: list):
        super().__init__()
        self.layer = layer
        self.spec, self.constants = spec, constants

    def forward(self, *tensors):
        it = iter(tensors)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.layer(*args, **kwargs)


_TENSOR = object()  # marks a tensor leaf among a call's constants


class LayerGraph(torch.nn.Module):
    """One decoder layer (or the output head) as an exported graph: called like the layer it replaced.

    The call must have the structure and non-tensor values it was exported with (a different one is a clear error).
    ``checkpoint``: recompute the layer in backward instead of keeping its activations (activation checkpointing).
    """

    def __init__(self, graph: torch.fx.GraphModule, spec, constants: list, checkpoint: bool = False):
        super().__init__()
        self.qgraph = graph
        self.spec, self.constants, self.checkpoint = spec, constants, checkpoint

    def forward(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.spec or any(
            c is not _TENSOR and (isinstance(v, torch.Tensor) or v != c) for v, c in zip(leaves, self.constants)
        ):
            raise RuntimeError(f"a layerwise graph was called unlike it was exported: {spec} vs {self.spec}")
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.qgraph, *tensors, use_reentrant=False)
        return self.qgraph(*tensors)


def decoder_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of the model's decoder layers: the classes HF lists in ``_no_split_modules``."""
    kinds = set(getattr(model, "_no_split_modules", None) or [])
    found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in kinds]
    if not found:
        raise UserError(
            f"{type(model).__name__} names no decoder layer class (_no_split_modules is {sorted(kinds)})",
            fix="train this model without model.layerwise (and with DDP instead of FSDP)",
        )
    return found


def _capture(model, modules: dict[str, torch.nn.Module], example: torch.Tensor) -> dict[str, tuple]:
    """The ``(args, kwargs)`` each of ``modules`` is called with in one forward of ``model`` on ``example``."""
    seen, hooks = {}, []
    for name, m in modules.items():

        def hook(_, args, kwargs, name=name):
            seen.setdefault(name, (args, kwargs))

        hooks.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=example, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _export_one(module, args, kwargs, quantize) -> LayerGraph:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    constants = [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]
    tensors = tuple(v for v in leaves if isinstance(v, torch.Tensor))
    graph = torch.export.export(_Call(module, spec, constants), tensors).module()
    return LayerGraph(quantize(graph), spec, constants)


def export_layerwise(model, batch_size: int, seq_len: int, quantize) -> torch.nn.Module:
    """``model`` (changed in place) with each decoder layer and the output head exported on their own, each graph
    passed through ``quantize(graph) -> graph`` (the recipe's ``prepare_qat_pt2e``/``prepare_pt2e``, or identity).
    Shapes are static, ``[batch_size, seq_len]``, on the model's device."""
    targets = dict(decoder_layers(model))
    head = model.get_output_embeddings()
    if head is not None:  # quantized like any linear layer (a tied head keeps sharing the embedding's weight)
        targets[next(n for n, m in model.named_modules() if m is head)] = head
    device = next(model.parameters()).device
    calls = _capture(model, targets, torch.zeros(batch_size, seq_len, dtype=torch.long, device=device))
    model.eval()
    for name, module in targets.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        args, kwargs = calls[name]
        owner.register_module(attr, _export_one(module, args, kwargs, quantize))
    return model


def layer_graphs(root: torch.nn.Module) -> list[tuple[str, LayerGraph]]:
    """``(name, LayerGraph)`` of a layerwise root, in model order."""
    return [(n, m) for n, m in root.named_modules() if isinstance(m, LayerGraph)]


def graph_modules(root: torch.nn.Module) -> list[tuple[str, torch.fx.GraphModule]]:
    """The exported graphs of a training root, each with its name's prefix: ``[("", root)]`` for a whole-model graph,
    one per layer for a layerwise root, none for eager (torchao source-level) modules."""
    if isinstance(root, torch.fx.GraphModule):
        return [("", root)]
    return [(f"{n}.qgraph", m.qgraph) for n, m in layer_graphs(root)]


def units(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules to shard (and checkpoint) one by one: the layer graphs of a layerwise root, or the decoder layers
    of eager modules (torchao source-level QAT)."""
    found = layer_graphs(root)
    if found:
        return found
    return [(f"model.{n}", m) for n, m in decoder_layers(root.model)]


def set_checkpointing(root: torch.nn.Module, enabled: bool) -> int:
    """Activation checkpointing per unit (recompute each decoder layer in backward); returns how many units."""
    found = units(root)
    for _, m in found:
        if isinstance(m, LayerGraph):
            m.checkpoint = enabled
        elif enabled:  # an eager decoder layer: its forward runs under checkpoint (an instance attribute)
            m.forward = _checkpointed(type(m).forward.__get__(m))
        else:
            m.__dict__.pop("forward", None)  # the class's forward again
    return len(found)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run
