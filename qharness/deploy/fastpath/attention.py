"""The fast path's attention function (and mask function) in transformers' ``AttentionInterface``: ExecuTorch's
``custom_sdpa`` (or ``custom_quantized_sdpa`` over an int8 cache) over the whole cache, BSHD, causal from the call's
start; sliding windows, soft-capping and multi-head latent attention's two widths handled here.
"""

from __future__ import annotations

import torch

from qharness.deploy.fastpath.kv_cache import ACTIVE, dequantize, quantize_per_token
from qharness.upstream.fixes import custom_sdpa

ATTENTION = "qharness_executorch"  # the name of the attention (and mask) function in transformers' interfaces


def window_mask(start, n: int, length: int, window: int, dtype) -> torch.Tensor:
    """Additive ``[n, length]`` mask: query ``i`` (position ``start + i``) sees keys ``j`` with
    ``start + i - window < j <= start + i`` (transformers' sliding-window convention)."""
    pos = (torch.arange(n) + start)[:, None]
    keys = torch.arange(length)[None, :]
    visible = (keys <= pos) & (keys > pos - window)
    return torch.where(visible, 0.0, float("-inf")).to(dtype)


def _softcapped_attention(q, k_cache, v_cache, start, scaling: float, softcap: float, window: int | None):
    """``softmax(softcap * tanh(q k^T * scaling / softcap) + mask) v`` with plain ops over the whole caches (the mask
    hides positions after ``start + i`` and outside the window). ``q [1, n, H, D]``, caches ``[1, S, H_kv, D]`` ->
    ``[1, n, H, D]``.

    The caches are read in their own layout, never permuted: the query is laid out block-diagonally per KV head,
    ``[H_kv * groups * n, H_kv * D]`` (zeros off its own head), so ``linear(q_blocks, k_cache.view(S, H_kv * D))``
    gives every head's scores and ``weights @ v_cache.view(S, H_kv * D)`` every head's output (its diagonal blocks
    kept). KV heads are never repeated; the zeros cost ``H_kv`` times the (small) attention matmuls, and the shapes
    are static but for ``n``, so XNNPACK takes the matmuls."""
    _, n, h, d = q.shape
    _, length, kv_heads, _ = k_cache.shape
    groups = h // kv_heads
    eye = torch.eye(kv_heads, dtype=q.dtype)
    q = q[0].view(n, kv_heads, groups, d).permute(1, 2, 0, 3).reshape(kv_heads, groups * n, 1, d)
    q_blocks = (q * eye.view(kv_heads, 1, kv_heads, 1)).reshape(kv_heads * groups * n, kv_heads * d)
    scores = torch.nn.functional.linear(q_blocks, k_cache.view(length, kv_heads * d)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    mask = window_mask(start, n, length, window if window is not None else length + 1, scores.dtype)
    scores = scores.view(kv_heads, groups, n, length) + mask
    weights = torch.softmax(scores, dim=-1).view(kv_heads * groups * n, length)
    out = (weights @ v_cache.view(length, kv_heads * d)).view(kv_heads, groups * n, kv_heads, d)
    out = (out * eye.view(kv_heads, 1, kv_heads, 1)).sum(2)  # each head's own block: [H_kv, groups * n, D]
    return out.view(kv_heads, groups, n, d).permute(2, 0, 1, 3).reshape(1, n, h, d)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """transformers attention function (registered as ``ATTENTION``): ``query [1, H, n, D]`` (BHSD), ``key`` /
    ``value`` the layer's whole cache ``[1, S, H_kv, D]`` (BSHD, from ``UpdateCacheKV``) -> ``[1, n, H, D]``. A
    ``latent`` cache layer's model (MLA) expands its cache into ``key [1, H, S, Dk]`` and ``value [1, H, S, Dv]``
    (BHSD, ``Dk != Dv``): they are laid out BSHD and padded to one width (``_same_width``) -> ``[1, n, H, Dv]``."""
    if dropout:
        raise ValueError(f"{ATTENTION} attention does not implement dropout")
    for name in ("head_mask", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{ATTENTION} attention does not implement {name}")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{ATTENTION} attention is causal only")
    if not ACTIVE:
        raise RuntimeError(f"{ATTENTION} attention runs only inside FastDecoder")
    start = ACTIVE[-1].start
    q = query.transpose(1, 2)  # [1, n, H, D]: a view of the projection's output
    v_dim = None
    layer_idx = getattr(module, "layer_idx", None)
    if (
        layer_idx is not None and ACTIVE[-1].layers[layer_idx].latent
    ):  # MLA: keys [1, H, S, Dk], values [1, H, S, Dv], expanded
        q, key, value, v_dim = _same_width(q, key.transpose(1, 2), value.transpose(1, 2))
    out, _ = _attention(module, q, key, value, start, scaling, softcap, kwargs.get("sliding_window"))
    return (out if v_dim is None else out[..., :v_dim]), None


def _same_width(q, key, value):
    """``(q, key, value, value width)`` with the narrower of keys (and the query) or values zero-padded to the other's
    width: ``custom_sdpa`` takes one head dim. Zeros added to queries and keys leave every score as it was; the
    outputs' extra columns (``weights @ 0``) are cut off after attention."""
    dk, dv = key.shape[-1], value.shape[-1]
    pad = torch.nn.functional.pad
    if dk < dv:
        q, key = pad(q, (0, dv - dk)), pad(key, (0, dv - dk))
    elif dv < dk:
        value = pad(value, (0, dk - dv))
    return q, key.contiguous(), value.contiguous(), dv


def _attention(module, q, key, value, start, scaling, softcap, window):
    """``attention`` over BSHD ``q [1, n, H, D]`` and caches ``[1, S, H_kv, D]`` -> ``([1, n, H, D], None)``."""
    n, length = q.shape[1], key.shape[1]
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    window = window if isinstance(window, int) and window < length else None
    if key.dtype == torch.int8:  # the int8 KV cache: its layer holds the per-token scales and zero points
        ks, kz, vs, vz = ACTIVE[-1].layers[module.layer_idx].qparams
        if not softcap and window is None:  # as export_llm's quantized cache (dequantizing instead decoded slower)
            qq, qs, qz = quantize_per_token(q)
            out = torch.ops.llama.custom_quantized_sdpa(
                qq, key, value, start, None, 0.0, True, scale, qz, qs, kz, ks, vz, vs
            )
            return out, None
        used = start + n  # no quantized kernel for these: attend over the dequantized positions written so far
        key = dequantize(key.narrow(1, 0, used), kz.narrow(1, 0, used), ks.narrow(1, 0, used))
        value = dequantize(value.narrow(1, 0, used), vz.narrow(1, 0, used), vs.narrow(1, 0, used))
        length = used
    if softcap:
        return _softcapped_attention(q, key, value, start, scale, float(softcap), window), None
    if window is None:
        return torch.ops.llama.custom_sdpa(q, key, value, start, None, 0.0, True, scale), None
    mask = window_mask(start, n, length, window, q.dtype)
    return torch.ops.llama.custom_sdpa(q, key, value, start, mask, 0.0, False, scale), None


def no_mask(*args, **kwargs) -> None:
    """transformers mask function (registered as ``ATTENTION``): no mask tensor; ``attention`` masks."""
    return None


def register() -> None:
    """Register ``attention`` / ``no_mask`` with transformers as ``ATTENTION`` and load ExecuTorch's LLM ops."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from qharness.upstream import imports

    custom_sdpa.llm_custom_ops()
    imports.quantized_decomposed_ops()  # the int8 KV cache's per-token quantization
    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, no_mask)
