"""Speed-up: cut partitions out with an in-place topological sort and one recompile per partitioning."""

from __future__ import annotations

import contextlib
import copy

import torch

from qharness.upstream.lowering.patching import patched

_LEGALIZE_FIRST = None


def legalize_graph_in_place(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``torch.fx.passes.tools_common.legalize_graph`` without copying the graph or recompiling.

    Upstream topologically sorts with Kahn's algorithm into a new graph (``node_copy`` of every node)
    and sets it on ``gm`` (a recompile). This computes the same order with the same queue rules, then
    relinks the nodes and rebuilds what the copy would have rebuilt (users in creation order, the name
    space, the find-nodes table), so the graph is indistinguishable from upstream's result.
    ``gm``'s generated code is left stale: recompile before running it.
    """
    import collections
    import operator

    from torch.fx.graph import _FindNodesLookupTable

    global _LEGALIZE_FIRST
    if _LEGALIZE_FIRST is None:
        _LEGALIZE_FIRST = (
            operator.add,
            operator.mul,
            operator.sub,
            operator.floordiv,
            operator.truediv,
            operator.mod,
            operator.le,
            operator.lt,
            operator.ge,
            operator.gt,
            operator.eq,
            operator.ne,
            torch.ops.aten.sym_constrain_range.default,
            torch.ops.aten.sym_constrain_range_for_size.default,
            torch.ops.aten._assert_async.msg,
            torch.ops.aten.scalar_tensor.default,
            torch.ops.aten._assert_scalar.default,
        )
    graph = gm.graph
    nodes = list(graph.nodes)
    indeg = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            indeg[user] += 1
    queue = collections.deque(n for n in nodes if indeg[n] == 0)
    order = []
    while queue:
        cur = queue.popleft()
        order.append(cur)
        for user in cur.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                if user.op == "call_function" and user.target in _LEGALIZE_FIRST:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(nodes):
        from torch.fx.passes.tools_common import legalize_graph

        return legalize_graph(gm)  # raises upstream's cycle error
    position = {n: i for i, n in enumerate(order)}
    table, metas = _FindNodesLookupTable(), set()
    for n in order:
        graph._root._prepend(n)  # moves n to the end
        users = n.users
        if len(users) > 1:  # the copy registers users as it creates them: in the new order
            keys = list(users)
            ordered = sorted(keys, key=position.__getitem__)
            if ordered != keys:
                users.clear()
                users.update(dict.fromkeys(ordered))
        table.insert(n)
        if id(n.meta) in metas:  # the copy gives each node its own meta dict
            n.meta = copy.copy(n.meta)
        metas.add(id(n.meta))
    graph._graph_namespace, graph._find_nodes_lookup_table = _namespace_of(order), table
    graph._tracer_cls = graph._tracer_extras = None
    graph._co_fields = {}
    return gm


_NAME_PARTS: dict = {}


def _namespace_of(nodes: list):
    """The ``torch.fx.graph._Namespace`` a new graph has after ``create_node(name=n.name)`` for each of
    ``nodes`` in order (names already unique and legal): every name used, per base name the count
    ``create_name`` leaves (the suffix of the last ``base_N``, else what it was)."""
    from torch.fx.graph import _illegal_names, _name_regex, _Namespace

    namespace = _Namespace()
    used, counts = namespace._used_names, namespace._base_count
    for n in nodes:
        name = n.name
        parts = _NAME_PARTS.get(name)
        if parts is None:
            match = _name_regex.match(name)
            if match is None or name in _illegal_names:
                return _namespace_by_create_name(nodes)
            base, num = match.group(1, 2)
            parts = _NAME_PARTS[name] = (base, None if num is None else int(num))
        base, num = parts
        if name in used:
            return _namespace_by_create_name(nodes)
        counts[base] = counts.get(base, 0) if num is None else num
        used.add(name)
        namespace._obj_to_name[n] = name
    return namespace


def _namespace_by_create_name(nodes: list):
    from torch.fx.graph import _Namespace

    namespace = _Namespace()
    for n in nodes:
        if namespace.create_name(n.name, None) != n.name:
            raise AssertionError(f"node name {n.name} is not reproducible")
        namespace.associate_name_with_obj(n.name, n)
    return namespace


def patch():
    """ExecuTorch's ``create_submodule_from_nodes`` re-sorts the whole program graph after cutting out
    each partition (``legalize_graph``: a copy of every node, then the whole program's Python code is
    regenerated and compiled): O(partitions x nodes), the largest cost of lowering a 30-layer model.
    The sort is done in place (``legalize_graph_in_place``), the code regenerated once, after the last
    partition (``_create_partitions_in_graph_module``). Nothing runs the program in between."""
    import executorch.exir.backend.backend_api as backend_api
    import executorch.exir.lowered_backend_module as lbm

    upstream_create = backend_api._create_partitions_in_graph_module

    def create_partitions_in_graph_module(tagged_graph_module, *args, **kwargs):
        out = upstream_create(tagged_graph_module, *args, **kwargs)
        tagged_graph_module.recompile()
        return out

    stack = contextlib.ExitStack()
    stack.enter_context(patched(lbm, "legalize_graph", legalize_graph_in_place))
    stack.enter_context(patched(backend_api, "_create_partitions_in_graph_module", create_partitions_in_graph_module))
    return stack
