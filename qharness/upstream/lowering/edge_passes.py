"""Speed-up: skip ATen-to-Edge passes whose ops the program does not have."""

from __future__ import annotations

import contextlib

import torch

from qharness.upstream.lowering.patching import called_ops, patched


def patch():
    """``to_edge``'s ATen-to-Edge passes re-trace the whole program each; two of them only rewrite ops
    the program may not have: ``NormalizeTransposePass`` (``aten.t``) and
    ``ReplaceBrokenOpsWithFunctionalOpsPass`` (view ops, which ``ReplaceViewOpsWithViewCopyOpsPass``
    has already replaced). Without those ops they are skipped (exir/passes/normalize_transpose_pass.py,
    replace_broken_ops_with_function_ops_pass.py)."""
    from executorch.exir.pass_base import PassResult
    from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
    from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import ReplaceBrokenOpsWithFunctionalOpsPass

    def only_if(cls, applies):
        upstream = cls.call

        def call(self, graph_module):
            if not applies(called_ops(graph_module)):
                return PassResult(graph_module, False)
            return upstream(self, graph_module)

        return patched(cls, "call", call)

    stack = contextlib.ExitStack()
    stack.enter_context(only_if(NormalizeTransposePass, lambda ops: torch.ops.aten.t.default in ops))
    stack.enter_context(
        only_if(ReplaceBrokenOpsWithFunctionalOpsPass, lambda ops: any(getattr(op, "is_view", False) for op in ops))
    )
    return stack
