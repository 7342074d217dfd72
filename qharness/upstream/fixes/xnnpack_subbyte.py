"""Adaptation: ExecuTorch 1.5.1's XNNPACK backend lowers 4- and 8-bit weights only; 2/3-bit weights ship as int4.

XNNPACK has int4 (``qc4w``, ``qb4w``) and int8 weight kernels and no 2- or 3-bit ones; its serializer asserts
"Only 4b group quantization is supported" (``backends/xnnpack/operators/node_visitor.py``) for any other group-wise
range. torchao quantizes a 3-bit weight into int8 storage with values in [-4, 3] and a declared range of int3. The
same values, scales and zero points declared as int4 ([-8, 7]) dequantize to exactly the same weights, and XNNPACK
lowers them as 4-bit: the program computes with the 2/3-bit weights QAT trained, at the size and speed of 4-bit.
Not a bug upstream (no issue): XNNPACK would need sub-4-bit kernels.
Test that tells when to revisit it: tests/test_upstream_fixes.py::test_upstream_xnnpack_still_lowers_no_3bit_groups.
Retire: when that test fails, lower 2/3-bit weights as they are (delete this module and its call in
``SourceQuantizer.convert``) and record their real size.

Example::

    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int3, ...))
    store_as_int4(model)   # -> {"model.layers.0.mlp.up_proj": "int3", ...}; lowers with XNNPACK's int4 kernels
"""

from __future__ import annotations

import torch

SUB_4BIT = {getattr(torch, f"int{b}"): f"int{b}" for b in (1, 2, 3)}


def store_as_int4(model: torch.nn.Module) -> dict[str, str]:
    """Declare every torchao intx weight of fewer than 4 bits as int4 (values unchanged); returns ``{module name:
    its bits}`` of the weights changed."""
    changed = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if getattr(weight, "target_dtype", None) in SUB_4BIT:  # torchao's IntxUnpackedToInt8Tensor
            changed[name] = SUB_4BIT[weight.target_dtype]
            weight.target_dtype = torch.int4
    return changed
