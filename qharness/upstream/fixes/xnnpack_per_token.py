"""Adaptation: ExecuTorch 1.5.1's XNNPACK backend quantizes "per-tensor" dynamic activations per token.

A PT2E dynamic recipe (``XNNPACKQuantizer`` with ``is_dynamic=True``) converts to one activation scale per call
(``choose_qparams.tensor`` -> ``quantize/dequantize_per_tensor.tensor``). XNNPACK has no per-tensor dynamic
quantization: its serializer maps that chain to ``qdint8`` (``backends/xnnpack/operators/node_visitor.py``,
``get_quant_params``: "We use per_token quantization for per_tensor quantization"), so the ``.pte`` computes one
asymmetric scale per row (token). On SmolLM2-135M the converted per-tensor graph scored +58% perplexity over FP where
the ``.pte`` scored +3.5%: one outlier token widened every token's scale. The converted graph, the parity gate's
reference and QAT's fake quantization must compute what the kernels compute, so the chain is rewritten here to
``quantized_decomposed``'s per-token ops (``choose_qparams_per_token_asymmetric``, XNNPACK's own zero-point nudging),
which the XNNPACK partitioner lowers to the same ``qdint8`` program.
No upstream issue filed (the behaviour is documented in the code above). Test that tells when to revisit it:
tests/test_upstream_fixes.py::test_upstream_xnnpack_still_quantizes_per_tensor_dynamic_activations_per_token.
Retire: when that test fails (XNNPACK honours one scale per tensor), delete this module and its calls in
``deploy/lower.py`` and ``recipes/xnnpack.py`` and decide which granularity the recipes ask for.

Example::

    converted = convert_pt2e(prepared)
    per_token(converted)   # -> 14 (activation chains rewritten); converted(x) now equals the .pte's output
"""

from __future__ import annotations

import operator

import torch


def per_token(graph: torch.fx.GraphModule) -> int:
    """Rewrite every dynamic int8 activation chain of ``graph`` (``choose_qparams.tensor`` and the
    ``quantize/dequantize_per_tensor.tensor`` ops reading its scale) into the per-token ops; returns how many."""
    from qharness.upstream import imports

    imports.quantized_decomposed_ops()
    qd = torch.ops.quantized_decomposed
    retarget = {
        qd.quantize_per_tensor.tensor: (qd.quantize_per_token.default, ()),
        qd.dequantize_per_tensor.tensor: (qd.dequantize_per_token.default, (torch.float32,)),
    }
    g = graph.graph
    count = 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target != qd.choose_qparams.tensor:
            continue
        x, qmin, qmax, _eps, dtype = node.args
        if (qmin, qmax, dtype) != (-128, 127, torch.int8):
            raise ValueError(f"dynamic activations of range [{qmin}, {qmax}] {dtype}: XNNPACK quantizes int8 only")
        with g.inserting_before(node):
            chosen = g.call_function(qd.choose_qparams_per_token_asymmetric.default, (x, dtype))
        node.replace_all_uses_with(chosen)
        g.erase_node(node)
        users = {u for item in chosen.users if item.target is operator.getitem for u in item.users}
        for user in users:
            target, extra = retarget[user.target]  # a KeyError: an op of the chain this rewrite does not know
            with g.inserting_before(user):
                new = g.call_function(target, (*user.args, *extra))
            user.replace_all_uses_with(new)
            g.erase_node(user)
        count += 1
    if count:
        graph.recompile()
    return count


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` through int8 per-token dynamic quantization as XNNPACK computes it (the same ops as ``per_token``'s
    graph), with a straight-through gradient: QAT's activation fake quantization of the PT2E dynamic recipes."""
    from qharness.upstream import imports

    imports.quantized_decomposed_ops()
    qd = torch.ops.quantized_decomposed
    with torch.no_grad():
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        scale, zero = qd.choose_qparams_per_token_asymmetric.default(flat, torch.int8)
        q = qd.quantize_per_token.default(flat, scale, zero, -128, 127, torch.int8)
        dq = qd.dequantize_per_token.default(q, scale, zero, -128, 127, torch.int8, torch.float32)
    return x + (dq.reshape(x.shape).to(x.dtype) - x).detach()
