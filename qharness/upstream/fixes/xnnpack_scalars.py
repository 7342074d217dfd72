"""Fix: ExecuTorch 1.5.1's XNNPACK quantizer lifts int64 scalar operands as float32 buffers.

Upstream: https://github.com/pytorch/executorch/issues/22062 (fixed by PR #22065, after 1.5.1).
Test that tells when to retire it: tests/test_upstream_fixes.py::test_upstream_xnnpack_still_lifts_int_scalars_as_float.
Retire: delete this module and use ``XNNPACKQuantizer`` directly in qharness/recipes/registry.py.
"""

from __future__ import annotations

import torch


def _lift_scalars_keeping_dtype(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Lift scalar operands of aten.add/mul into buffers of the node's own dtype.

    ExecuTorch 1.5.1's ``_convert_scalars_to_attrs`` lifts them as float32, which turns HF Llama's
    int64 ``arange(n) + 0`` into a float index ("tensors used as indices must be long ...").
    Upstream: pytorch/executorch issue #22062, fixed by PR #22065 (after 1.5.1).
    """
    from torchao.quantization.pt2e.utils import get_new_attr_name_with_prefix

    for node in model.graph.nodes:
        if node.op != "call_function" or node.target not in (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor):
            continue
        new_args = []
        for arg in node.args:
            if isinstance(arg, torch.fx.Node):
                new_args.append(arg)
                continue
            name = get_new_attr_name_with_prefix("_tensor_constant_")(model)
            val = node.meta["val"]
            value = torch.tensor(
                arg, dtype=val.dtype, device=val.device
            )  # the graph's device (CUDA when it trains there)
            model.register_buffer(name, value)
            with model.graph.inserting_before(node):
                get_attr = model.graph.create_node("get_attr", name, (), {})
                get_attr.meta["val"] = node.meta["val"].fake_mode.from_tensor(value, static_shapes=True)
            new_args.append(get_attr)
        node.args = tuple(new_args)
    model.recompile()
    return model


def xnnpack_quantizer_cls():
    """``XNNPACKQuantizer`` with the scalar-lifting fix applied (see ``_lift_scalars_keeping_dtype``)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer

    class FixedXNNPACKQuantizer(XNNPACKQuantizer):
        def transform_for_annotation(self, model):
            return _lift_scalars_keeping_dtype(model)

    return FixedXNNPACKQuantizer


def upstream_xnnpack_scalar_lifting():
    """The unpatched upstream function, for the test that tells when the workaround can go."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer_utils import _convert_scalars_to_attrs

    return _convert_scalars_to_attrs
