"""Speed-up: XNNPACK's 4-bit weight packing in one NumPy pass instead of six multi-threaded torch ops."""

from __future__ import annotations

import torch

from qharness.upstream.lowering.patching import patched


def pack_int4(weight: torch.Tensor) -> torch.Tensor:
    """``NodeVisitor.convert_to_qc4w``'s result for an int8 CPU tensor of values in [-8, 7], from NumPy: each value
    plus 8 as a uint8 nibble, two per byte along the last axis (odd column high), the last axis padded to even."""
    import numpy as np

    values = weight.detach().numpy()
    low, high = int(values.min()), int(values.max())
    assert high <= 7 and low >= -8, f"convert_to_qc4w: [min,max] out of [-8, 7] range, got [{low}, {high}]"
    if values.ndim != 2:
        values = values.squeeze()
    assert values.ndim == 2, f"convert_to_qc4w: expecting input tensor to be 2d, got {values.ndim}"
    if values.shape[-1] % 2:
        values = np.pad(values, ((0, 0), (0, 1)))  # the pad's 0 becomes 8 below, as upstream's F.pad then + 8
    oc, ic = values.shape
    nibbles = (values.astype(np.int16) + 8).astype(np.uint8).reshape(-1)
    return torch.from_numpy((nibbles[1::2] << 4) | nibbles[::2]).view(oc, ic // 2)


def patch():
    """ExecuTorch's XNNPACK backend packs every 4-bit weight (``NodeVisitor.convert_to_qc4w``,
    backends/xnnpack/operators/node_visitor.py) with six whole-tensor torch ops (min, max, to uint8, + 8, two strided
    slices shifted and or-ed). Each is an OpenMP parallel region; on a machine whose cores other jobs hold, every
    region waits for a descheduled thread (~12 ms per op for a 576 x 576 weight: 8 s for a 30-layer model against
    ~0.1 s on one thread). The same bytes come from one single-threaded NumPy pass (``pack_int4``: values in
    [-8, 7] plus 8 are exact in uint8, so the nibbles and their order are upstream's; the result owns exactly
    ``oc * ic / 2`` bytes, which ``get_serialized_buffer_index`` serializes). Other dtypes keep upstream's code."""
    from executorch.backends.xnnpack.operators.node_visitor import NodeVisitor

    upstream = NodeVisitor.convert_to_qc4w

    def convert_to_qc4w(inp: torch.Tensor) -> torch.Tensor:
        if inp.dtype != torch.int8 or inp.device.type != "cpu" or type(inp) not in (torch.Tensor, torch.nn.Parameter):
            return upstream(inp)
        return pack_int4(inp)

    return patched(NodeVisitor, "convert_to_qc4w", staticmethod(convert_to_qc4w))
