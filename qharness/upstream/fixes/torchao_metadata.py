"""Fix: torchao 0.18's ``IntxUnpackedToInt8Tensor`` (the weights of its 8daXw recipes) lacks
``aten._assert_tensor_metadata``, which ``torch.export`` emits for ``weight.to(dtype)`` / ``weight.type(dtype)``.

DeepSeek-V3's router computes ``F.linear(x.float(), self.weight.type(torch.float32))``: once the router's weight is a
torchao quantized tensor (``sources/moe.py`` makes it an ``nn.Linear``'s, so every recipe quantizes it), its export
failed with ``NotImplementedError: IntxUnpackedToInt8Tensor dispatch: ... aten._assert_tensor_metadata``. The op only
checks a tensor's metadata; for the subclass that is its outer dtype and device, checked here as the op would.
Test that tells when to retire it: tests/test_upstream_fixes.py::test_upstream_intx_tensor_still_lacks_assert_metadata.
Retire: delete this module and its call in qharness/deploy/lower.py.
"""

from __future__ import annotations

import torch

_REGISTERED: list[bool] = []


def _assert_tensor_metadata(func, types, args, kwargs):
    kwargs = dict(kwargs or {})
    names = ("size", "stride", "dtype")
    for name, value in zip(names, args[1:]):
        kwargs.setdefault(name, value)
    t = args[0]
    for name, actual in (("size", tuple(t.shape)), ("dtype", t.dtype), ("device", t.device)):
        expected = kwargs.get(name)
        if expected is not None and (tuple(expected) if name == "size" else expected) != actual:
            raise RuntimeError(f"Tensor {name} mismatch! Expected: {expected}, Got: {actual}")
    return None


def register() -> None:
    """Implement ``aten._assert_tensor_metadata`` for ``IntxUnpackedToInt8Tensor`` (once)."""
    if _REGISTERED:
        return
    from torchao.quantization import IntxUnpackedToInt8Tensor

    IntxUnpackedToInt8Tensor.implements(torch.ops.aten._assert_tensor_metadata.default)(_assert_tensor_metadata)
    _REGISTERED.append(True)
