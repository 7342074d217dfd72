"""The all-logits twin of a fast-path deploy graph: the same graph (and weights) without its last-token slice."""

from __future__ import annotations

import copy

import torch

from qharness.deploy.deployed import export_path


def _last_token_slices(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``hidden_states[:, -1:, :]`` of HF's ``logits_to_keep=1``: ``aten.slice(h, 1, -1, <end>)`` nodes."""
    return [
        n
        for n in graph.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.aten.slice.Tensor and tuple(n.args[1:3]) == (1, -1)
    ]


def all_logits_twin(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The twin of a fast-path deploy graph (exported, maybe quantized and folded) that returns the logits of
    every position: the same graph without its last-token slice, over the same attributes (weights,
    quantization parameters and KV-cache buffers are shared, not copied). Scoring a block then takes one
    call instead of one per token. A graph of the generic export returns every position already and comes
    back as it is.

    Example::

        scorer = all_logits_twin(deployed)   # scorer(block[None], torch.tensor([0]))[0]: logits[n, vocab]
    """
    if export_path(graph) != "fast":
        return graph
    slices = _last_token_slices(graph)
    if len(slices) != 1:
        raise RuntimeError(f"expected one last-token slice in the fast-path graph, found {len(slices)}")
    new_graph = torch.fx.Graph()
    new_graph._codegen = copy.deepcopy(graph.graph._codegen)  # keeps the (tokens, input_pos) calling convention
    remap: dict[torch.fx.Node, torch.fx.Node] = {}
    output = new_graph.graph_copy(graph.graph, remap)
    new_graph.output(output)
    cut = remap[slices[0]]
    cut.replace_all_uses_with(remap[slices[0].args[0]])
    new_graph.erase_node(cut)
    twin = torch.fx.GraphModule(graph, new_graph)
    twin.meta.update(graph.meta)
    return twin
