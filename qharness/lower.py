"""Deployment stages: static-KV-cache export -> quantize (convert_pt2e) -> lower -> ``.pte``.

The ``.pte``'s ``forward(tokens[1, n], input_pos[1]) -> logits[1, n, vocab]`` takes ``n`` new tokens
starting at cache position ``input_pos`` (prefill: many tokens at 0; decode: one token at a time).

Example::

    ep = export_static_cache(model, max_seq_len=256)
    deployed = quantize_for_deploy(ep.module(), recipe, calibration=[train_blocks[:1]])
    pte_bytes = lower_to_pte(deployed, recipe, max_seq_len=256)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch.export import Dim

from qharness import compat

log = logging.getLogger(__name__)


def _example(max_seq_len: int):
    n = min(8, max_seq_len - 1)
    return (torch.zeros(1, n, dtype=torch.long), torch.tensor([0], dtype=torch.long))


def _dynamic_shapes(max_seq_len: int):
    return ({1: Dim("seq_len", min=1, max=max_seq_len - 1)}, None)


def export_static_cache(model, max_seq_len: int) -> torch.export.ExportedProgram:
    """Export ``(tokens, input_pos) -> logits`` with a static KV cache of ``max_seq_len`` positions."""
    wrapper = compat.hf_static_cache_exportable(model, batch_size=1, max_cache_len=max_seq_len)
    tokens, pos = _example(max_seq_len)
    return torch.export.export(
        wrapper,
        args=(),
        kwargs={"input_ids": tokens, "cache_position": pos},
        dynamic_shapes={"input_ids": _dynamic_shapes(max_seq_len)[0], "cache_position": None},
        strict=True,
    )


def quantize_for_deploy(graph: torch.fx.GraphModule, recipe, calibration: Iterable[torch.Tensor]) -> torch.fx.GraphModule:
    """``prepare_pt2e`` with the recipe's (non-QAT) quantizer, run calibration prefills, ``convert_pt2e``.

    ``calibration`` holds ``[1, n]`` token blocks, each prefilled at position 0. Returns the
    graph unchanged for recipes without quantization.
    """
    quantizer = recipe.make_quantizer(is_qat=False)
    if quantizer is None:
        return graph
    pt2e = compat.pt2e()
    prepared = pt2e.prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for block in calibration:
            prepared(block, torch.tensor([0], dtype=torch.long))
    return pt2e.convert_pt2e(prepared)


def lower_to_pte(graph: torch.fx.GraphModule, recipe, max_seq_len: int) -> bytes:
    """Re-export, decompose to core ATen, lower with the recipe's partitioners, serialize."""
    for p in graph.parameters():  # to_executorch fails on in-place ops over leaves that require grad
        p.requires_grad_(False)
    ep = torch.export.export(graph, _example(max_seq_len), dynamic_shapes=_dynamic_shapes(max_seq_len), strict=True)
    ep = ep.run_decompositions({})
    edge = compat.to_edge_transform_and_lower(ep, partitioner=recipe.make_partitioners())
    return edge.to_executorch().buffer
