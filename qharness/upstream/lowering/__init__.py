"""Lowering speed-ups: patches of upstream internals that skip redundant work, one module per patch.

Lowering a 2-layer HF Llama took 25-150 s here, a 30-layer one 10+ minutes. Profiles (cProfile, py-spy) put
the time in upstream work that changes nothing; each module names its upstream cause. With all of them the
``.pte`` is byte for byte the same: tests/test_upstream_lowering.py lowers a toy program both ways in the
default suite. ``QHARNESS_UPSTREAM_LOWERING=1`` turns them all off.

Retire a patch: delete its module and drop it from ``PATCHES``; the byte-identity test still guards the rest.

Example::

    with fast_lowering():
        pte = to_edge_transform_and_lower(ep, partitioner=[...]).to_executorch().buffer
"""

from __future__ import annotations

import contextlib
import os

import torch

from qharness.upstream.lowering import (
    decompositions,
    delegates,
    edge_passes,
    fake_cache,
    partition_cutting,
    partition_merging,
    provenance,
    xnnpack_packing,
    xnnpack_passes,
)
from qharness.upstream.lowering.progress_hooks import delegation_progress  # progress, not a speed-up

__all__ = ["PATCHES", "decompose_for_lowering", "delegation_progress", "export_for_lowering", "fast_lowering"]

PATCHES = (
    provenance,
    decompositions,
    xnnpack_passes,
    edge_passes,
    partition_cutting,
    partition_merging,
    delegates,
    fake_cache,
    xnnpack_packing,
)


def export_for_lowering(module: torch.nn.Module, args: tuple, dynamic_shapes) -> torch.export.ExportedProgram:
    """Re-export a deployable graph module (``torch.export.export``) for lowering.

    Strict export traces with Dynamo, which clones every parameter and buffer into its real-value cache
    (``cache_real_value_when_export`` in torch/_dynamo/variables/builder.py): a transient copy of all
    weights, and the slower trace. The module here is already an exported graph, so non-strict export
    traces the same program (the ``.pte`` is byte for byte the same); QHARNESS_UPSTREAM_LOWERING=1 keeps
    strict export. Call it inside ``fast_lowering``: ``fake_cache`` halves the trace of an 8da4w program.
    """
    with torch.no_grad():
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=upstream_lowering())


def decompose_for_lowering(ep, partitioners: list):
    """``ep.run_decompositions({})``: functional ATen for ``to_edge_transform_and_lower``.

    Under ``fast_lowering`` the first partitioner's decomposition table is applied in the same re-trace
    (what ``to_edge_transform_and_lower`` does next, in a re-trace of its own that
    ``decompositions.patch`` then skips). Not for partitioners that transform the program before
    decomposing (``transform_for_pre_decomposition``, e.g. Arm).
    """
    from executorch.exir.backend.partitioner import Partitioner
    from executorch.exir.tracer import _default_decomposition_table

    upstream_pre = Partitioner.transform_for_pre_decomposition
    if (
        upstream_lowering()
        or not partitioners
        or any(type(p).transform_for_pre_decomposition is not upstream_pre for p in partitioners)
    ):
        return ep.run_decompositions({})
    table = _default_decomposition_table()
    for op in partitioners[0].ops_to_not_decompose(ep)[0]:
        table.pop(op, None)
    return ep.run_decompositions(table)


def upstream_lowering() -> bool:
    return os.environ.get("QHARNESS_UPSTREAM_LOWERING") == "1"


@contextlib.contextmanager
def fast_lowering(patches=PATCHES):
    """Within this context, lowering skips the upstream costs above (same .pte, a fraction of the time).

    Example::

        with fast_lowering():
            pte = to_edge_transform_and_lower(ep, partitioner=[...]).to_executorch().buffer
    """
    if upstream_lowering():
        yield
        return
    with contextlib.ExitStack() as stack:
        for module in patches:
            stack.enter_context(module.patch())
        yield
