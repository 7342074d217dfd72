"""Workarounds in qharness/compat.py, each with a test that fails once upstream changes."""

import torch

from qharness import compat


def _graph_with_int_add():
    class M(torch.nn.Module):
        def forward(self, x):
            idx = torch.arange(x.shape[1]) + 0
            return x[:, idx] * 2.0

    return torch.export.export(M(), (torch.randn(2, 4),)).module()


def _lifted_dtypes(gm):
    return {n.target: getattr(gm, n.target).dtype for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_tensor_constant")}


def test_upstream_xnnpack_still_lifts_int_scalars_as_float():
    """executorch#22062: when this fails, upstream fixed it; drop compat._lift_scalars_keeping_dtype."""
    gm = compat.upstream_xnnpack_scalar_lifting()(_graph_with_int_add())
    assert torch.float32 in _lifted_dtypes(gm).values()
    assert all(d == torch.float32 for d in _lifted_dtypes(gm).values())


def test_our_lifting_keeps_the_node_dtype_and_runs():
    gm = compat._lift_scalars_keeping_dtype(_graph_with_int_add())
    assert sorted(map(str, _lifted_dtypes(gm).values())) == ["torch.float32", "torch.int64"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), x * 2.0)
