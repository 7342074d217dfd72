"""Speed-up: build each delegate's module once per lowering instead of on every fake-tensor re-trace."""

from __future__ import annotations

from qharness.upstream.lowering.patching import patched


def patch():
    """Every re-trace of a lowered program (``to_executorch``'s passes) runs each delegate call on fake
    tensors through ``call_delegate_cpu``, which rebuilds the delegate's module each time
    (``ExportedProgram.module()``: unlifting, a graph copy, a recompile). The module is built once per
    delegate here; delegates that mutate buffers keep upstream's fresh module per call."""
    import importlib
    import weakref

    from torch.fx import immutable_collections
    from torch.utils import _pytree as pytree

    ecd = importlib.import_module("torch._higher_order_ops.executorch_call_delegate")  # the package shadows it
    upstream = ecd.call_delegate_cpu
    modules = weakref.WeakKeyDictionary()

    def call_delegate_cpu(lowered_module, *args):  # upstream's body, with the module built once
        program = lowered_module.original_module
        if program.graph_signature.buffers_to_mutate:
            return upstream(lowered_module, *args)
        if lowered_module not in modules:
            modules[lowered_module] = program.module()
        immutable = {immutable_collections.immutable_dict: dict, immutable_collections.immutable_list: list}
        args = pytree.tree_map_only(
            tuple(immutable), lambda a: immutable[type(a)](a), args, lambda a: isinstance(a, tuple(immutable))
        )
        return modules[lowered_module](*args)

    return patched(ecd, "call_delegate_cpu", call_delegate_cpu)
