"""``qharness::straight_through(w, w_q, on) -> w_q`` (``w`` where ``on`` is 0) whose gradient goes to ``w`` unchanged
(the straight-through estimator), as a custom op: ``torch.export`` keeps it one node with this autograd formula, where an
``autograd.Function`` is decomposed into its forward's round/clamp (zero gradient). ``recipes/embedding.py`` trains a
PT2E recipe's quantized embedding table through it.

Example::

    w_q = straight_through.apply(w, fake_quantize(w), on)   # forward: w_q (on: a 1-element tensor, 1); d/dw = identity
"""

from __future__ import annotations

import torch


@torch.library.custom_op("qharness::straight_through", mutates_args=())
def _straight_through(w: torch.Tensor, w_q: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    return torch.where(on.bool(), w_q, w)


@_straight_through.register_fake
def _(w, w_q, on):
    return torch.empty_like(w_q)


def _backward(ctx, grad):
    return grad, None, None


_straight_through.register_autograd(_backward)


def apply(w: torch.Tensor, w_q: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """``w_q`` in the forward pass (``w`` while ``on`` holds 0: fake quantization off), the identity's gradient to
    ``w`` (none to ``w_q``) in the backward pass."""
    return _straight_through(w, w_q, on)
