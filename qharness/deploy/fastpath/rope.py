"""Rotary embeddings on the fast path: which rotary types it takes, and each rotary module as tables of every cache
position, read at the call's start.
"""

from __future__ import annotations

import inspect

import torch

from qharness.deploy.fastpath.kv_cache import ACTIVE

STATIC_ROPE = {"default", "linear", "llama3", "yarn", "proportional"}


def rope_types(config) -> set[str]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return {"default"}
    per_layer_type = [v for v in rope.values() if isinstance(v, dict)]  # e.g. Gemma3: {"sliding_attention": {...}}
    return {r.get("rope_type", r.get("type", "default")) for r in (per_layer_type or [rope])}


class RopeTable(torch.nn.Module):
    """A rotary-embedding module of the model (``forward(x, position_ids[, layer_type]) -> (cos, sin)``) as
    tables of every cache position, computed once by that module: a call reads rows ``start .. start + n``
    (``FastDecoder`` passes ``position_ids = start + arange(n)``) instead of computing the angles per call."""

    def __init__(self, rotary: torch.nn.Module, max_seq_len: int, dtype: torch.dtype, layer_types: list[str]):
        super().__init__()
        self.keys = [None]
        if "layer_type" in inspect.signature(rotary.forward).parameters:  # one table per layer type it has factors for
            known = getattr(rotary, "rope_type", None)  # e.g. LFM3: full and sliding attention, not its conv layers
            self.keys = [t for t in dict.fromkeys(layer_types) if not isinstance(known, dict) or t in known]
        if isinstance(getattr(rotary, "layer_types", None), list):  # LFM3's model asks its rotary which types it has
            self.layer_types = list(rotary.layer_types)
        probe, positions = torch.zeros(1, dtype=dtype), torch.arange(max_seq_len)[None]
        with torch.no_grad():
            for i, key in enumerate(self.keys):
                out = rotary(probe, positions) if key is None else rotary(probe, positions, key)
                if not (isinstance(out, tuple) and len(out) == 2) or any(t.is_complex() for t in out):
                    raise ValueError(
                        f"{type(rotary).__name__} gives complex rotary factors (torch.polar, applied with "
                        "view_as_complex), not (cos, sin); ExecuTorch has no complex dtype"
                    )
                cos, sin = out
                self.register_buffer(f"cos_{i}", cos.clone(), persistent=False)  # [1, max_seq_len, dim]
                self.register_buffer(f"sin_{i}", sin.clone(), persistent=False)

    def forward(self, x, position_ids, layer_type=None):
        i = self.keys.index(layer_type)
        start, n = ACTIVE[-1].start, position_ids.shape[-1]
        cos, sin = getattr(self, f"cos_{i}").narrow(1, start, n), getattr(self, f"sin_{i}").narrow(1, start, n)
        return (cos, sin) if cos.dtype == x.dtype else (cos.to(x.dtype), sin.to(x.dtype))
