"""Deployment stages: static-KV-cache export -> quantize (convert_pt2e) -> lower -> ``.pte``.

The ``.pte``'s ``forward(tokens[1, n], input_pos[1]) -> logits[1, n, vocab]`` takes ``n`` new tokens
starting at cache position ``input_pos`` (prefill: many tokens at 0; decode: one token at a time). That
is the signature ExecuTorch's LLM runner calls (``TextDecoderRunner::step`` passes a one-element
``input_pos`` when the method's second input has one element), and ``runner_metadata`` gives the
constant methods it reads.

Example::

    ep = export_static_cache(model, max_seq_len=256)
    deployed = quantize_for_deploy(ep.module(), recipe, calibration=[train_blocks[:1]])
    meta = runner_metadata(max_seq_len=256, vocab_size=2048, bos_id=0, eos_ids=[0])
    pte_bytes = lower_to_pte(deployed, recipe, max_seq_len=256, metadata=meta)
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


def runner_metadata(max_seq_len: int, vocab_size: int, bos_id: int | None, eos_ids: list[int]) -> dict:
    """Constant methods for ExecuTorch's LLM runner (``extension/llm/runner/llm_runner_helper.cpp``).

    The runner requires ``get_max_seq_len`` (its prefill chunk size) and reads ``get_max_context_len``
    (KV-cache positions), ``use_kv_cache``, ``enable_dynamic_shape`` (prefill in one call, not token
    by token), ``use_sdpa_with_kv_cache`` and ``get_eos_ids``. It takes BOS and vocab size from the
    tokenizer; ``get_bos_id`` / ``get_vocab_size`` are for other readers. Both lengths are the cache
    size: with ``get_max_seq_len`` below ``get_max_context_len`` the runner assumes a sliding-window
    cache and no longer bounds generation by the cache position.
    """
    meta = {
        "get_max_seq_len": max_seq_len,
        "get_max_context_len": max_seq_len,
        "get_vocab_size": vocab_size,
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": False,
        "enable_dynamic_shape": True,
    }
    if bos_id is not None:
        meta["get_bos_id"] = bos_id
    if eos_ids:
        meta["get_eos_ids"] = sorted(set(eos_ids))
    return meta


def lower_to_pte(graph: torch.fx.GraphModule, recipe, max_seq_len: int, metadata: dict | None = None) -> bytes:
    """Re-export, decompose to core ATen, lower with the recipe's partitioners, serialize.

    ``metadata`` becomes constant methods of the program (``runner_metadata``).
    """
    for p in graph.parameters():  # to_executorch fails on in-place ops over leaves that require grad
        p.requires_grad_(False)
    ep = torch.export.export(graph, _example(max_seq_len), dynamic_shapes=_dynamic_shapes(max_seq_len), strict=True)
    ep = ep.run_decompositions({})
    edge = compat.to_edge_transform_and_lower(ep, partitioner=recipe.make_partitioners(), constant_methods=metadata)
    return edge.to_executorch().buffer
