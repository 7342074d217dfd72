"""What the lowering patches share: a scoped attribute patch and the set of ops a graph calls."""

from __future__ import annotations

import contextlib
import types

import torch


@contextlib.contextmanager
def patched(owner, name: str, value):
    """``owner.name = value`` inside the block (a class attribute it inherits is shadowed, then unshadowed)."""
    missing = object()
    saved = getattr(owner, name) if isinstance(owner, types.ModuleType) else owner.__dict__.get(name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if saved is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)


def aten_op(op):
    """An Edge op's ATen overload (an ``EdgeOpOverload`` wraps it in ``_op``); anything else as is."""
    return op if isinstance(op, torch._ops.OpOverload) else getattr(op, "_op", op)


def called_ops(gm: torch.fx.GraphModule) -> set:
    """ATen overloads ``gm`` (and its control-flow subgraphs) call; Edge ops count as their ATen op."""
    from executorch.exir.graph_module import get_control_flow_submodules

    ops, queue = set(), [gm]
    while queue:
        g = queue.pop()
        ops.update(aten_op(n.target) for n in g.graph.nodes if n.op == "call_function")
        queue.extend(sub for _, sub, _ in get_control_flow_submodules(g))
    return ops


def op_named(name: str):
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)
