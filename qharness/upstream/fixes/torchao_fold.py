"""Fix: torchao 0.18's ``convert_pt2e`` leaves ``quantize`` ops of some weights unfolded (float weights quantized at
every call, outside the delegate).

Its constant folding (``torchao/quantization/pt2e/constant_fold.py``, ``ConstantFolder._find_mutable_buffers``) marks
every producer of a tensor that an in-place ``copy_`` writes as a mutable buffer when any of those producers is a
buffer, and never folds past them. In MLA (DeepSeek-V3) ``kv_b_proj`` expands the cached latent (a buffer) into the
keys, which are ``copy_``-ed into a new tensor: its weight's ``quantize_per_channel`` stayed in the program, and
ExecuTorch's portable kernel aborted the ``.pte`` at run time (``scale.scalar_type() == Double``).
Test that tells when to retire it: tests/test_upstream_fixes.py::test_upstream_convert_pt2e_still_leaves_a_weight_quantize.
Retire: delete this module and its call in qharness/deploy/lower.py.
"""

from __future__ import annotations

import torch

_QUANTIZE_OPS = ("quantize_per_channel.default", "quantize_per_tensor.default")


def fold_weight_quantization(graph: torch.fx.GraphModule) -> int:
    """Fold each ``quantize`` of a parameter (with constant scales) that ``convert_pt2e`` left in ``graph`` into an
    int8 constant, as it folds the others; returns how many.

    torchao's constant folding refuses to fold anything that feeds, through any chain of ops, a tensor written by an
    in-place ``copy_`` when a buffer is among that chain's producers (its guard against folding mutable buffers). In
    MLA (DeepSeek-V2/V3) ``kv_b_proj`` expands the cached latent (a buffer) into keys that are ``copy_``-ed into a new
    tensor, so its weight stayed a float parameter quantized on every call: a ``quantize_per_channel`` outside the
    XNNPACK delegate, which ExecuTorch's portable kernel then refuses at run time (its scales are not double). Only
    parameters are folded, never a buffer (KV caches)."""
    params = dict(graph.named_parameters())
    folded = 0

    def value(node):
        return getattr_path(graph, node.target) if isinstance(node, torch.fx.Node) else node

    for node in list(graph.graph.nodes):
        name = f"{getattr(node.target, '_opname', '')}.{getattr(node.target, '_overloadname', '')}"
        if node.op != "call_function" or name not in _QUANTIZE_OPS or node.kwargs:
            continue
        weight, rest = node.args[0], node.args[1:]
        if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and weight.target in params):
            continue
        if any(isinstance(a, torch.fx.Node) and a.op != "get_attr" for a in rest):
            continue
        with torch.no_grad():
            q = node.target(value(weight), *(value(a) for a in rest))
        attr = f"_qharness_folded_weight_{folded}"
        graph.register_buffer(attr, q)
        with graph.graph.inserting_before(node):
            const = graph.graph.get_attr(attr)
        const.meta.update(node.meta)
        node.replace_all_uses_with(const)
        graph.graph.erase_node(node)
        folded += 1
    if folded:
        graph.graph.eliminate_dead_code()
        used = {n.target for n in graph.graph.nodes if n.op == "get_attr"}
        for name in set(params) - used:  # the float weights just folded: no longer read, not exported
            owner, _, attr = name.rpartition(".")
            delattr(graph.get_submodule(owner) if owner else graph, attr)
        graph.recompile()
    return folded


def getattr_path(module: torch.nn.Module, target: str):
    """The attribute at dotted ``target`` of ``module`` (a ``get_attr`` node's value)."""
    for part in target.split("."):
        module = getattr(module, part)
    return module
