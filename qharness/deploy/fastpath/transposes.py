"""An FX pass over the exported fast-path graph: transposes sunk below the rotary math and cancelled, so each layer's
XNNPACK partition is not cut by ``permute_copy``s.
"""

from __future__ import annotations

import torch

_ELEMENTWISE = {  # element-wise ops (and a mean over other dimensions) that a transpose moves across
    "mul.Tensor",
    "add.Tensor",
    "sub.Tensor",
    "div.Tensor",
    "neg.default",
    "rsqrt.default",
    "pow.Tensor_Scalar",
    "to.dtype",
    "type_as.default",
    "alias.default",
    "mean.dim",
}


class _Free:
    """Placeholder in ``_moved_args``: transpose this broadcast operand (``args[0]``), a view moving no data."""

    def __init__(self, node):
        self.args = (node,)


def _moved_args(user, t, pair):
    """``user``'s arguments with transpose ``t`` (dimensions ``pair``) moved below it, or None if it cannot move:
    transposes of ``pair`` give their input; same-rank operands with size 1 in ``pair`` are transposed (``_Free``);
    lower-rank operands broadcasting over dimensions after ``pair`` and non-tensors stay."""
    rank = t.meta["val"].dim()
    out = []
    for i, x in enumerate(user.args):
        if user.target == torch.ops.aten.type_as.default and i == 1:
            out.append(x)  # only its dtype counts
        elif isinstance(x, torch.fx.Node):
            r = x.meta["val"].dim()
            if _is_t(x) and _dims(x) == pair:
                out.append(x.args[0])
            elif r == rank and _unit(x, *pair):
                out.append(_Free(x))
            elif r < rank and max(pair) < rank - r:
                out.append(x)
            else:
                return None
        elif user.target == torch.ops.aten.mean.dim and i == 1:
            if set(pair) & {d % rank for d in x} or len(user.args) < 3 or not user.args[2]:
                return None  # a mean over a moved dimension, or one that drops dimensions
            out.append(x)
        else:
            out.append(x)
    return out


def _unit(node: torch.fx.Node, a: int, b: int) -> bool:
    """``node``'s value has a static size 1 in dimension ``a`` or ``b`` (so swapping them moves no data)."""
    shape = node.meta["val"].shape
    return any(isinstance(shape[d], int) and shape[d] == 1 for d in (a, b))


def _unsqueezed(node, pair: tuple[int, int]) -> int | None:
    """The dimension ``d`` (one of ``pair``) if ``node`` is ``aten.unsqueeze(y, d)``, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return None
    if node.target != torch.ops.aten.unsqueeze.default:
        return None
    d = node.args[1] % node.meta["val"].dim()
    return d if d in pair else None


def _is_t(n) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target == torch.ops.aten.transpose.int


def _dims(t: torch.fx.Node) -> tuple[int, int]:
    """The two dimensions transpose ``t`` swaps, non-negative and sorted."""
    rank = t.meta["val"].dim()
    return tuple(sorted(d % rank for d in t.args[1:3]))


def _make(graph: torch.fx.Graph, target, args, like: torch.fx.Node) -> torch.fx.Node:
    """A new ``target(*args)`` node with ``like``'s metadata and its own fake value."""
    node = graph.call_function(target, args)
    node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    fake = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    fake = [
        [b.meta["val"] if isinstance(b, torch.fx.Node) else b for b in a] if isinstance(a, list) else a for a in fake
    ]
    node.meta["val"] = target(*fake)
    return node


def sink_transposes(graph_module: torch.fx.GraphModule) -> int:
    """Move every ``aten.transpose(x, a, b)`` below the slices, element-wise ops and concatenations that use it,
    and drop a transpose of a transpose on the same two dimensions; returns how many rewrites.

    HF attention turns projections into BHSD (``view(...).transpose(1, 2)``), applies rotary positions there
    (element-wise, with slices and a concatenation for ``rotate_half``), and the fast path turns the result
    back into BSHD for ``update_cache`` / ``custom_sdpa``. Lowered as they are, the two transposes become
    ``permute_copy``s that cut each layer's XNNPACK partition in two around the (non-delegated) slices. Sunk
    and cancelled, the rotary math runs in BSHD as ExecuTorch's own Llama does (same values: only the order of
    layout changes). An element-wise op moves a transpose across only when each other operand is a transpose of
    the same dimensions, a scalar, or a broadcast operand of the same rank with size 1 in one of the two
    dimensions (that operand is transposed instead: no data moves)."""
    graph = graph_module.graph
    rewrites, changed = 0, True
    while changed:
        changed = False
        for user in list(graph.nodes):
            done = _in_place(user)
            rewrites, changed = rewrites + done, changed or bool(done)
            name = _sinkable(user)
            if name is None:
                continue
            with graph.inserting_before(user):
                new = _replacement(graph, user, name)
            if new is None:
                continue
            user.replace_all_uses_with(new)
            graph.erase_node(user)
            rewrites, changed = rewrites + 1, True
        graph.eliminate_dead_code()
    _share_unsqueezes(graph)
    graph_module.recompile()
    return rewrites


def _in_place(user: torch.fx.Node) -> int:
    """Rewrites of ``user``'s arguments that need no new node: a dtype/device check or ``type_as`` of a transpose
    reads its input instead. Returns how many."""
    aten = torch.ops.aten
    if user.target == aten._assert_tensor_metadata.default and _is_t(user.args[0]) and len(user.args) == 1:
        if user.kwargs.get("size") is None and user.kwargs.get("stride") is None:
            user.replace_input_with(user.args[0], user.args[0].args[0])  # dtype/device: check the input
            return 1
    if user.target == aten.type_as.default and _is_t(user.args[1]):
        user.update_arg(1, user.args[1].args[0])  # only the dtype of its second argument counts
        return 1
    return 0


def _sinkable(user: torch.fx.Node) -> str | None:
    """``user``'s op name (``slice.Tensor``) when a transpose may move below it, else None."""
    if user.op != "call_function" or user.kwargs:
        return None
    name = f"{user.target._opname}.{user.target._overloadname}" if hasattr(user.target, "_opname") else ""
    inputs = list(user.args[0]) if name == "cat.default" else [user.args[0]]
    if name == "transpose.int" and _unsqueezed(user.args[0], _dims(user)) is not None:
        return name
    if not all(_is_t(t) for t in inputs) or len({_dims(t) for t in inputs}) != 1:
        if name not in _ELEMENTWISE or not any(_is_t(a) for a in user.args):
            return None
    return name


def _replacement(graph: torch.fx.Graph, user: torch.fx.Node, name: str) -> torch.fx.Node | None:
    """The node that computes ``user`` with its transpose moved below it (None: it cannot move)."""
    aten = torch.ops.aten
    if name == "transpose.int" and _is_t(user.args[0]) and _dims(user) == _dims(user.args[0]):
        return user.args[0].args[0]
    if name == "transpose.int" and _unsqueezed(user.args[0], _dims(user)) is not None:
        a, b = _dims(user)  # transpose(unsqueeze(y, a), a, b) == unsqueeze(y, b)
        d = _unsqueezed(user.args[0], (a, b))
        return _make(graph, aten.unsqueeze.default, (user.args[0].args[0], b if d == a else a), user)
    if name == "slice.Tensor":
        t = user.args[0]
        a, b = _dims(t)
        d = user.args[1] % t.meta["val"].dim()
        d = b if d == a else a if d == b else d
        moved = _make(graph, user.target, (t.args[0], d, *user.args[2:]), user)
        return _make(graph, aten.transpose.int, (moved, a, b), t)
    if name == "cat.default":
        inputs = list(user.args[0])
        a, b = _dims(inputs[0])
        d = (user.args[1] if len(user.args) > 1 else 0) % inputs[0].meta["val"].dim()
        d = b if d == a else a if d == b else d
        cat = _make(graph, user.target, ([t.args[0] for t in inputs], d), user)
        return _make(graph, aten.transpose.int, (cat, a, b), inputs[0])
    if name in _ELEMENTWISE:
        t = next(a for a in user.args if _is_t(a))
        a, b = _dims(t)
        args = _moved_args(user, t, (a, b))
        if args is None:
            return None
        args = [_make(graph, aten.transpose.int, (x.args[0], a, b), t) if isinstance(x, _Free) else x for x in args]
        return _make(graph, aten.transpose.int, (_make(graph, user.target, tuple(args), user), a, b), t)
    return None


def _share_unsqueezes(graph: torch.fx.Graph) -> None:
    """One unsqueeze of the rotary tables for all layers, not one per use."""
    seen: dict[tuple, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten.unsqueeze.default and not node.kwargs:
            first = seen.setdefault((node.args[0], node.args[1] % node.meta["val"].dim()), node)
            if first is not node:
                node.replace_all_uses_with(first)
                graph.erase_node(node)
