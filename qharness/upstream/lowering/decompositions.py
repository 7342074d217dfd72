"""Speed-up: skip ``run_decompositions`` re-traces of programs that hold no op left to decompose."""

from __future__ import annotations

import torch

from qharness.upstream.lowering.patching import called_ops, patched


def patch():
    """``to_edge_transform_and_lower`` runs ``run_decompositions`` twice per partitioner (ExecuTorch's
    EDGE_DO_NOT_DECOMP path), plus once to functionalize, each a full re-trace of the program even when
    nothing in the graph is left to decompose. A program that already came out of ``run_decompositions``
    (functional ATen) and uses no op of the table is returned as is; upstream does the same check on its
    other path (``contains_any_call_fn_target_op`` in ``_gen_edge_manager_for_partitioners``)."""
    import weakref

    from torch.export import ExportedProgram

    upstream = ExportedProgram.run_decompositions
    decomposed = weakref.WeakSet()

    def run_decompositions(self, decomp_table=None, decompose_custom_triton_ops=False):
        if self in decomposed and decomp_table is not None and not decompose_custom_triton_ops:
            # sym_size.int is in the table (a CompositeImplicitAutograd op) but traces back to itself
            if not (called_ops(self.graph_module) & (set(dict(decomp_table)) - {torch.ops.aten.sym_size.int})):
                return self
        out = upstream(self, decomp_table, decompose_custom_triton_ops)
        decomposed.add(out)
        return out

    return patched(ExportedProgram, "run_decompositions", run_decompositions)
