"""Rewrites of the deploy graph into operators XNNPACK's partitioner takes, so that a decoder layer is a few delegate
calls around the ops that must run outside it (``update_cache``, ``custom_sdpa``), not ten.

Two ops of every Llama-style layer ran outside XNNPACK and cut its partitions:

- RMSNorm's ``mean(x**2, -1, keepdim=True)``: XNNPACK's ``mean`` takes a 4-D tensor averaged over its two inner
  dimensions only. ``mean_as_4d`` views ``x[..., d]`` as ``[n, m, d, 1]``, averages over ``(2, 3)`` and views the
  result back (the same sum over the same ``d`` values).
- ``rotate_half(x) = cat(-x[..., h:], x[..., :h])`` of the rotary embedding: XNNPACK takes no slice over a dynamic
  sequence length. ``rotate_half_as_linear`` computes it as ``linear(x, R)``, ``R`` the ``2h x 2h`` matrix of that
  signed permutation (each output one input times +-1: exact in float).

With both, and one ``XnnpackPartitioner`` for the whole graph (``xnnpack_8da4w``'s ``partitioners: [xnnpack]``),
SmolLM2-135M's program makes 62 delegate calls per step instead of 303 (2 a layer) and is 0.15 MB smaller; its
decode speed is the same (a first version at 4 calls a layer timed side by side, this one against llama.cpp: the
calls were not what decode waits on; docs/benchmarks/real-model.md).
Applied to the converted graph at lowering (``deploy/lower.py``), after coverage was measured: the matrix ``R`` is no
projection of the model, and no quantizer sees it.

Example::

    counts = keep_layers_whole(graph)   # {"mean": 61, "rotate_half": 60} on SmolLM2-135M (30 layers)
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten


def keep_layers_whole(graph: torch.fx.GraphModule) -> dict[str, int]:
    """Both rewrites on ``graph`` (in place, the same function); how many of each."""
    counts = {"mean": mean_as_4d(graph), "rotate_half": rotate_half_as_linear(graph)}
    if any(counts.values()):
        graph.graph.lint()
        graph.recompile()
    return counts


def mean_as_4d(graph: torch.fx.GraphModule) -> int:
    """Every ``mean(x, [-1], keepdim=True)`` of a 3- or 4-D ``x`` with at most one dynamic dimension becomes a 4-D
    mean over ``(2, 3)`` between two views; returns how many."""
    g = graph.graph
    count = 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target != aten.mean.dim or node.kwargs.get("dtype") is not None:
            continue
        x, dims = node.args[0], node.args[1]
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
        if val is None or val.dim() not in (3, 4) or not keepdim or [d % val.dim() for d in dims] != [val.dim() - 1]:
            continue
        lead = [d if isinstance(d, int) else -1 for d in val.shape[:-1]]
        if lead.count(-1) > 1 or not isinstance(val.shape[-1], int):
            continue
        outer = -1 if -1 in lead[:-1] else math.prod(lead[:-1])
        with g.inserting_before(node):
            as_4d = g.call_function(aten.view.default, (x, [outer, lead[-1], val.shape[-1], 1]))
            mean = g.call_function(aten.mean.dim, (as_4d, [2, 3], True))
            out = g.call_function(aten.view.default, (mean, [*lead, 1]))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        g.erase_node(node)
        count += 1
    return count


def rotate_half_as_linear(graph: torch.fx.GraphModule) -> int:
    """Every ``cat([-x[..., h:], x[..., :h]], -1)`` (HF's ``rotate_half``) becomes ``linear(x, R)``, one ``R``
    buffer per width; returns how many."""
    g = graph.graph
    count = 0
    matrices: dict[int, str] = {}
    for node in list(g.nodes):
        x = _rotate_half_input(node)
        if x is None:
            continue
        width = x.meta["val"].shape[-1]
        if width not in matrices:
            matrices[width] = f"_rotate_half_{width}"
            graph.register_buffer(matrices[width], rotate_half_matrix(width))
        with g.inserting_before(node):
            out = g.call_function(aten.linear.default, (x, g.get_attr(matrices[width])))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        count += 1
    if count:
        g.eliminate_dead_code()
    return count


def rotate_half_matrix(width: int) -> torch.Tensor:
    """``R`` ``[width, width]`` with ``x @ R.T == cat(-x[..., h:], x[..., :h])``, ``h = width // 2``."""
    h = width // 2
    r = torch.zeros(width, width)
    r[torch.arange(h), torch.arange(h) + h] = -1.0
    r[torch.arange(h) + h, torch.arange(h)] = 1.0
    return r


def _rotate_half_input(node: torch.fx.Node) -> torch.fx.Node | None:
    """``x`` when ``node`` is ``cat([neg(x[..., h:]), x[..., :h]], -1)`` over ``x``'s last dimension, else None
    (also when ``x`` is itself a slice: its rows are strided, and the linear's 2-D view of them fails to export)."""
    if node.op != "call_function" or node.target != aten.cat.default or len(node.args[0]) != 2:
        return None
    neg, first = node.args[0]
    if not (isinstance(neg, torch.fx.Node) and neg.target == aten.neg.default):
        return None
    second = neg.args[0]
    a, b = _last_dim_slice(first), _last_dim_slice(second)
    if a is None or b is None or a[0] is not b[0] or a[0].target == aten.slice.Tensor:
        return None
    x, width = a[0], a[0].meta["val"].shape[-1]
    rank = x.meta["val"].dim()
    cat_dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(width, int) or width % 2 or cat_dim % rank != rank - 1:
        return None
    h = width // 2
    return x if a[1:] == (0, h) and b[1] == h and b[2] >= width else None


def _last_dim_slice(node) -> tuple[torch.fx.Node, int, int] | None:
    """``(x, start, end)`` of ``node`` = ``aten.slice(x, last dim, start, end)`` with step 1, else None."""
    if not isinstance(node, torch.fx.Node) or node.target != aten.slice.Tensor or node.kwargs:
        return None
    defaults = [None, 0, None, None, 1]
    x, dim, start, end, step = list(node.args) + defaults[len(node.args) :]
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if val is None or dim % val.dim() != val.dim() - 1 or step != 1:
        return None
    start, end = start or 0, val.shape[-1] if end is None else end
    if not all(isinstance(v, int) for v in (start, end)):
        return None
    return x, start, end
