"""Fix: ExecuTorch 1.5.1's XNNPACK backend computes ``gelu(approximate="tanh")`` as exact (erf) GELU.

Its serializer ignores GELU's ``approximate`` argument and emits ``XNNGelu`` for both forms, so a delegated
``gelu_pytorch_tanh`` (Gemma, GPT-2 style MLPs) computes another function: up to 4.7e-4 apart per activation, which a
deep model amplifies (Gemma-3-270M 8da4w: the ``.pte``'s KL from its converted model 2.3x the model's own rounding
noise, perplexity 3.9% apart). The graph is given the tanh form's own arithmetic instead (``0.5 x (1 + tanh(sqrt(2/pi)
(x + 0.044715 x^3)))``, PyTorch's formula), which the converted model and the ``.pte`` both compute.
Upstream: pytorch/executorch PR #22851 ("XNNPACK: Route tanh GELU to approxgelu", after 1.5.1).
Test that tells when to retire it: tests/test_upstream_fixes.py::test_upstream_xnnpack_still_computes_tanh_gelu_as_erf.
Retire: delete this module and its call in ``deploy/lower.py``.

Example::

    decompose_tanh_gelu(graph)   # -> 18 (one per decoder layer's MLP)
"""

from __future__ import annotations

import math

import torch


def decompose_tanh_gelu(graph: torch.fx.GraphModule) -> int:
    """Replace every ``aten.gelu(x, approximate="tanh")`` of ``graph`` by its formula in elementary ops; returns how
    many."""
    aten = torch.ops.aten
    g = graph.graph
    count = 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target != aten.gelu.default:
            continue
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approximate != "tanh":
            continue
        x = node.args[0]
        with g.inserting_before(node):
            cube = g.call_function(aten.mul.Tensor, (g.call_function(aten.mul.Tensor, (x, x)), x))
            inner = g.call_function(aten.add.Tensor, (x, g.call_function(aten.mul.Tensor, (cube, 0.044715))))
            tanh = g.call_function(
                aten.tanh.default, (g.call_function(aten.mul.Tensor, (inner, math.sqrt(2 / math.pi))),)
            )
            half_x = g.call_function(aten.mul.Tensor, (x, 0.5))
            out = g.call_function(aten.mul.Tensor, (half_x, g.call_function(aten.add.Tensor, (tanh, 1.0))))
        out.meta.update(node.meta)
        node.replace_all_uses_with(out)
        g.erase_node(node)
        count += 1
    if count:
        graph.recompile()
    return count
