"""The ``lm_head``'s input rounded twice: two int8 rows in one GEMM (a recipe's ``quantizer: {split_head_input:
true}``).

8da recipes round every linear's input to int8, one scale per token. For the ``lm_head`` (its input the final norm's
output, 576 channels on SmolLM2-135M, a few of them far larger than the rest) that rounding is the largest single
activation loss left after QAT (``scripts/qat_loss_sources.py``), and XNNPACK's partitioner takes no GEMM of float
inputs on int8 weights. It takes one of two int8 rows:

    W x  ~  W hi + W lo      hi: x on its token's int8 grid; lo = x - hi, at most half a step, on a grid of its own

``SplitInput`` stacks ``hi`` and ``lo`` as two batches of rows ``[2b, n, in]`` of one GEMM and adds the two halves of
its output (stacked on the batch, not the positions: a graph traced with one position, HF's ``logits_to_keep=1``, is
re-used for every position by ``deploy/fastpath/twin.py``). The kernel quantizes each row with its own range: ``hi`` is already on its grid (requantized exactly), ``lo``'s step is
about 1/255 of ``hi``'s, so the head reads its input at about 16 bits. The weight is read once (the tied table stays
stored once); the cost is a second row in the head's GEMM and the rounding of ``hi`` outside it, per token.
QAT trains against the same sum with the head's activation fake quantizer wrapped (``TwiceRounded``:
``hi + fq(x - hi)``, the rows' sum before the GEMM), so the trained model and the ``.pte`` compute one function.

Example::

    quantize_(model, config)         # or QATConfig(step="prepare"): the head's input is int8 per token
    split_head_input(model)          # -> "lm_head": its input now rounds as two int8 rows
"""

from __future__ import annotations

import torch

QMIN, QMAX = -128, 127
SPLIT = "+split-input"  # appended to the head's scheme in a run's layer plan (``8da8w-pc+split-input``)


def on_grid(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., in]`` rounded to its row's asymmetric int8 grid (the range of each row and 0, 255 steps), in
    plain ATen ops that every runtime has; a kernel quantizing the result per row (any min-max rule) reproduces it."""
    low = x.amin(-1, keepdim=True).clamp(max=0)
    high = x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((high - low) / (QMAX - QMIN)).clamp(min=torch.finfo(torch.float32).eps)
    zero = QMIN - torch.round(low / scale)
    codes = torch.clamp(torch.round(x / scale) + zero, QMIN, QMAX)
    return (codes - zero) * scale


def split_rows(x: torch.Tensor) -> torch.Tensor:
    """``[b, ..., in] -> [2b, ..., in]``: ``x`` on its grid, then what that rounding left (the gradient goes through
    the second half)."""
    hi = on_grid(x.detach())
    return torch.cat([hi, x - hi], dim=0)


def join_rows(y: torch.Tensor, b: int) -> torch.Tensor:
    """``[2b, ..., out] -> [b, ..., out]``: the two halves' sum."""
    return y[:b] + y[b:]


class SplitInput:
    """Mixin over a linear module's class: ``forward(x)`` runs ``[hi; lo]`` through the class's own forward and adds
    the halves (``split_head_input`` swaps it in)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return join_rows(super().forward(split_rows(x)), x.shape[0])


class TwiceRounded(torch.nn.Module):
    """A per-token activation fake quantizer ``fq`` applied as the split head's kernel rounds: ``hi + fq(x - hi)``
    (``fq(hi) == hi``), the straight-through gradient of ``fq`` on the remainder. ``enabled`` is ``fq``'s."""

    def __init__(self, fq: torch.nn.Module):
        super().__init__()
        self.fq = fq

    @property
    def enabled(self) -> bool:
        return self.fq.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.fq.enabled = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fq.enabled:
            return self.fq(x)
        hi = on_grid(x.detach())
        return hi + self.fq(x - hi)


_CLASSES: dict[type, type] = {}


def head_name(model: torch.nn.Module) -> str | None:
    """The module name of ``model``'s output projection (``get_output_embeddings``), None if it has none."""
    head = model.get_output_embeddings()
    return next((n for n, m in model.named_modules() if m is head), None) if head is not None else None


def split_head_input(model: torch.nn.Module) -> str:
    """Make ``model``'s output projection round its input as two int8 rows (in place; names, parameters and the
    state dict unchanged); returns its module name. A QAT head (torchao's ``FakeQuantizedLinear``) keeps its GEMM
    and gets ``TwiceRounded`` as its activation fake quantizer; a quantized head (deployment) runs the two halves."""
    name = head_name(model)
    head = model.get_submodule(name) if name is not None else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"split_head_input: {type(model).__name__}'s output projection is not a linear layer")
    fq = getattr(head, "activation_fake_quantizer", None)
    if fq is not None:
        if not isinstance(fq, TwiceRounded):
            head.activation_fake_quantizer = TwiceRounded(fq)
        return name
    if isinstance(head, SplitInput):
        return name
    cls = type(head)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"SplitInput{cls.__name__}", (SplitInput, cls), {})
    head.__class__ = _CLASSES[cls]
    return name
