"""Fix: ExecuTorch 1.5.1's eager ``llama::custom_sdpa`` and ``llama::custom_quantized_sdpa`` log ``No temp allocator
provided`` on every call.

Upstream: ExecuTorch's AOT wrappers of both (extension/llm/custom_ops/op_sdpa_aot.cpp) run the kernel with a
context that has no temp allocator; no upstream issue is filed yet.
Tests that tell when to retire it: tests/test_upstream_fixes.py::test_upstream_eager_custom_sdpa_still_logs_on_every_call
and ::test_upstream_eager_custom_quantized_sdpa_still_logs_on_every_call (one override each).
Retire: keep ``llm_custom_ops`` importing the ops, drop the CPU overrides.
"""

from __future__ import annotations

import torch

_CPU_SDPA_LIB = None


def llm_custom_ops() -> None:
    """Register ``llama::update_cache`` / ``llama::custom_sdpa`` (eager kernels, export meta functions and,
    in the Python runtime, their ExecuTorch kernels), with ``custom_sdpa``'s eager CPU kernel replaced.

    Workaround: ExecuTorch 1.5.1's eager (AOT) ``custom_sdpa`` runs its kernel with a context that has no
    temp allocator and logs ``No temp allocator provided`` to stderr on every call (every layer of every
    calibration or scoring step). ``_custom_sdpa_cpu`` computes the same attention with PyTorch's SDPA
    for CPU tensors; export (Meta kernel) and the ``.pte`` (ExecuTorch's kernel) are unaffected.
    Test: tests/test_upstream_fixes.py (fails once upstream stops logging).
    """
    global _CPU_SDPA_LIB
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401

    if _CPU_SDPA_LIB is None:
        _CPU_SDPA_LIB = torch.library.Library("llama", "IMPL")
        _CPU_SDPA_LIB.impl("custom_sdpa", _custom_sdpa_cpu, "CPU")
        _CPU_SDPA_LIB.impl("custom_quantized_sdpa", _custom_quantized_sdpa_cpu, "CPU")


def _custom_sdpa_cpu(query, key, value, start_pos, attn_mask=None, drpout_p=0.0, is_causal=False, scale=None):
    """``llama::custom_sdpa`` in PyTorch: ``query [B, n, H, D]`` over caches ``[B, S, H_kv, D]``. Causal:
    query ``i`` sees cache positions ``<= start_pos + i``; with ``attn_mask`` (additive, ``[n, S]``) every
    position under the mask; otherwise positions ``< start_pos + n``. Plain matmuls and softmax: torch's
    fused CPU SDPA took milliseconds per call on tiny decode shapes on a busy machine."""
    b, n, h, d = query.shape
    if attn_mask is None:
        key, value = key[:, : start_pos + n], value[:, : start_pos + n]
    kv_heads, length = key.shape[2], key.shape[1]
    q = query.reshape(b, n, kv_heads, h // kv_heads, d).permute(0, 2, 3, 1, 4)  # [B, H_kv, rep, n, D]
    scores = q @ key.permute(0, 2, 3, 1).unsqueeze(2) * (d**-0.5 if scale is None else scale)  # [B, H_kv, rep, n, L]
    if attn_mask is not None:
        scores = scores + attn_mask
    elif is_causal:
        hidden = torch.arange(length)[None, :] > (start_pos + torch.arange(n))[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()  # softmax by hand: aten::softmax took ~1 ms on tiny
    weights = weights / weights.sum(-1, keepdim=True)  # shapes (its parallel_for), busy machine
    out = weights @ value.permute(0, 2, 1, 3).unsqueeze(2)  # [B, H_kv, rep, n, D]
    return out.permute(0, 3, 1, 2, 4).reshape(b, n, h, d).contiguous()


def _custom_quantized_sdpa_cpu(
    query,
    key,
    value,
    start_pos,
    attn_mask=None,
    drpout_p=0.0,
    is_causal=False,
    scale=None,
    q_zero_point=None,
    q_scale=None,
    k_zero_point=None,
    k_scale=None,
    v_zero_point=None,
    v_scale=None,
    is_seq_at_dim_2=False,
):
    """``llama::custom_quantized_sdpa`` in PyTorch (the same log-free replacement as ``_custom_sdpa_cpu``): int8
    ``query`` / caches with per-token ``[B, n, H, 1]`` scales and zero points, dequantized, then
    ``_custom_sdpa_cpu``. BSHD only (``is_seq_at_dim_2`` false), as the fast path calls it."""
    if is_seq_at_dim_2:
        raise NotImplementedError("custom_quantized_sdpa CPU replacement: is_seq_at_dim_2 is not implemented")

    def dq(x, zero_point, s):
        return (x.to(torch.float32) - zero_point.to(torch.float32)) * s

    return _custom_sdpa_cpu(
        dq(query, q_zero_point, q_scale),
        dq(key, k_zero_point, k_scale),
        dq(value, v_zero_point, v_scale),
        start_pos,
        attn_mask,
        drpout_p,
        is_causal,
        scale,
    )


def upstream_custom_sdpa(*args, op: str = "custom_sdpa"):
    """ExecuTorch's own eager ``custom_sdpa`` (or ``op``, e.g. ``custom_quantized_sdpa``) kernel, bypassing the
    replacements above, for the workaround's test."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return getattr(torch.ops.llama, op).default.redispatch(keys, *args)
