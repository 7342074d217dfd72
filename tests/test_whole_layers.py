"""deploy/whole_layers.py: RMSNorm's mean and rotate_half rewritten into ops XNNPACK takes, the same function, and
the lowered 8da4w program's layers in few delegate calls."""

import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from qharness.deploy import whole_layers
from qharness.deploy.lower import lower_to_pte, quantize_for_deploy
from qharness.recipes.registry import load_recipe
from qharness.upstream import imports
from tests.test_fastpath import FAMILIES, _tiny


def _kernel_calls(pte: bytes) -> tuple[Counter, int]:
    """Calls per step of each operator outside the delegates, and the delegate calls, of a program's forward."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.pte"
        path.write_bytes(pte)
        plan = next(p for p in imports.pte_program(path).execution_plan if p.name == "forward")
    ops, delegates = Counter(), 0
    for instruction in plan.chains[0].instructions:
        args = instruction.instr_args
        if hasattr(args, "op_index"):
            op = plan.operators[args.op_index]
            ops[f"{op.name}.{op.overload}" if op.overload else op.name] += 1
        elif hasattr(args, "delegate_index"):
            delegates += 1
    return ops, delegates


@pytest.mark.fast
def test_rotate_half_matrix_is_rotate_half():
    x = torch.randn(3, 5, 8)
    expected = torch.cat([-x[..., 4:], x[..., :4]], dim=-1)
    assert torch.equal(torch.nn.functional.linear(x, whole_layers.rotate_half_matrix(8)), expected)


@pytest.mark.parametrize(  # RMSNorms of the 2 layers and the final one; qwen3 and gemma3 add q/k norms over 4-D heads
    "family, norms", [("llama", 2 * 2 + 1), ("qwen3", 2 * 4 + 1), ("gemma3_text", 2 * 6 + 1)]
)
def test_rewrites_keep_the_function_and_leave_no_mean_or_rotary_slice(family, norms):
    graph = quantize_for_deploy(_tiny(family, **FAMILIES[family]), load_recipe("xnnpack_fp32"), 32, lambda g: None)
    tokens, pos = torch.randint(1, 96, (1, 7), generator=torch.Generator().manual_seed(0)), torch.tensor([0])
    with torch.no_grad():
        before = graph(tokens, pos)
    counts = whole_layers.keep_layers_whole(graph)
    assert counts == {"mean": norms, "rotate_half": 2 * 2}, counts  # q and k of each layer
    aten = torch.ops.aten
    means = [n for n in graph.graph.nodes if n.target == aten.mean.dim]
    assert len(means) == norms and all(list(n.args[1]) == [2, 3] for n in means), means  # each a 4-D mean now
    assert not [n for n in graph.graph.nodes if n.target == aten.neg.default]  # rotate_half's negation is gone
    with torch.no_grad():
        after = graph(tokens, pos)  # the prefill at 0 writes the same cache rows again
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    assert whole_layers.keep_layers_whole(graph) == {"mean": 0, "rotate_half": 0}  # nothing left to rewrite


def test_lowered_8da4w_layer_runs_in_few_delegate_calls():
    """The tiny Llama's 8da4w program: no mean and no rotary slice outside XNNPACK, and two delegate calls a layer
    (before and after its cache updates and attention), where the two-partitioner program made ten."""
    recipe = load_recipe("xnnpack_8da4w")
    graph = quantize_for_deploy(_tiny("llama"), recipe, 32, lambda g: None)
    ops, delegates = _kernel_calls(lower_to_pte(graph, recipe, 32))
    assert "aten::mean.out" not in ops and "aten::neg.out" not in ops, ops
    assert ops["aten::slice_copy.Tensor_out"] <= 3, ops  # the rotary tables' rows at the position, once for all layers
    assert ops["llama::custom_sdpa.out"] == 2 and ops["llama::update_cache.out"] == 4, ops
    assert delegates <= 2 * 2 + 2, delegates  # measured: 6
