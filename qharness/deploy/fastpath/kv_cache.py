"""The fast path's KV cache: a transformers ``Cache`` whose layers write ``[1, max_seq_len, kv_heads, head_dim]``
buffers with ``llama::update_cache`` (float, or int8 per token and head), and the cache of the decoder running now.
"""

from __future__ import annotations

import functools

import torch

ACTIVE: list = []  # the UpdateCacheKV of the FastDecoder running now (the attention function reads its start)


def quantize_per_token(x: torch.Tensor):
    """``x [1, n, H, D]`` -> ``(int8 values, scales float32 [1, n, H, 1], zero points int8 [1, n, H, 1])``: asymmetric
    per token and head, as ExecuTorch's quantized KV cache stores keys and values (``quantized_decomposed`` ops)."""
    qd = torch.ops.quantized_decomposed
    scales, zero_points = qd.choose_qparams_per_token_asymmetric.default(x, torch.int8)
    values = qd.quantize_per_token(x, scales, zero_points, -128, 127, torch.int8)
    return values, scales.to(torch.float32), zero_points.to(torch.int8)


def dequantize(values, zero_points, scales):
    return (values.to(torch.float32) - zero_points.to(torch.float32)) * scales


@functools.cache
def _cache_layer_class():
    from transformers.cache_utils import CacheLayerMixin

    class UpdateCacheLayer(CacheLayerMixin):
        """One layer's keys and values, ``[1, max_seq_len, kv_heads, head_dim]``, written by ``llama::update_cache``
        at the cache's ``start``; ``update`` returns the whole buffers (BSHD) for ``attention``. With ``qparams``
        (``(k_scales, k_zero_points, v_scales, v_zero_points)``, each ``[1, max_seq_len, kv_heads, 1]``) the buffers
        are int8: each new token's keys and values are quantized per token and head (``quantize_per_token``).

        ``latent``: keys and values of different shapes (multi-head latent attention caches its compressed latent
        and rotary key, one head each). The model's own code, not ``attention``, reads those: ``update`` hands them
        over as the ``[1, heads, max_seq_len, dim]`` views transformers' cache layers return (free with one head;
        dequantized first when int8), and ``attention`` gets the keys and values the model expanded from them."""

        is_compileable = True
        is_sliding = False

        def __init__(self, cache, keys: torch.Tensor, values: torch.Tensor, qparams: tuple | None = None):
            super().__init__()
            self.cache, self.keys, self.values, self.qparams = cache, keys, values, qparams
            self.max_cache_len = keys.shape[1]
            self.latent = keys.shape != values.shape
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            for new, buf in ((key_states, self.keys), (value_states, self.values)):  # update_cache aborts on these
                if new.dim() != 4 or new.shape[0] != 1 or (new.shape[1], new.shape[3]) != buf.shape[2:]:
                    raise ValueError(f"key/value states {tuple(new.shape)} do not fit a cache {tuple(buf.shape)}")
                if new.dtype != buf.dtype and self.qparams is None:
                    raise ValueError(f"key/value states of {new.dtype} for a cache of {buf.dtype}")
            start = self.cache.start
            if self.qparams is not None:
                ks, kz, vs, vz = self.qparams
                for new, buf, scales, zero_points in (
                    (key_states, self.keys, ks, kz),
                    (value_states, self.values, vs, vz),
                ):
                    for part, into in zip(quantize_per_token(new.transpose(1, 2)), (buf, scales, zero_points)):
                        torch.ops.llama.update_cache(part, into, start)
                if self.latent:
                    return dequantize(self.keys, kz, ks).transpose(1, 2), dequantize(self.values, vz, vs).transpose(
                        1, 2
                    )
                return self.keys, self.values
            torch.ops.llama.update_cache(key_states.transpose(1, 2), self.keys, start)  # [1, n, H_kv, D]: small
            torch.ops.llama.update_cache(value_states.transpose(1, 2), self.values, start)
            if self.latent:
                return self.keys.transpose(1, 2), self.values.transpose(1, 2)
            return self.keys, self.values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.max_cache_len, 0

        def get_seq_length(self) -> int:
            return self.cache.start

        def get_max_length(self) -> int:
            return self.max_cache_len

    return UpdateCacheLayer


def cache_argument(model) -> str:
    """The keyword ``model``'s forward takes its cache by: ``cache`` (transformers' state-space models: Mamba2, the
    Mamba2 hybrids, where ``past_key_values`` is a deprecated alias or, for Mamba2, ignored) or ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def update_cache_kv(buffers: list):
    """``UpdateCacheKV``: a transformers ``Cache`` over ``buffers``, one per layer: ``(keys, values, qparams or None)``
    for an attention layer, ``state_cache.StateBuffers`` for a layer that keeps states instead or beside them."""
    from transformers.cache_utils import Cache

    from qharness.deploy.fastpath.state_cache import StateBuffers, state_layer

    class UpdateCacheKV(Cache):
        """transformers ``Cache`` over per-layer ``update_cache`` buffers; ``start`` is the position of the first
        token of the current call (set by ``FastDecoder.forward``)."""

        def __init__(self):
            layer = _cache_layer_class()
            super().__init__(
                layers=[
                    state_layer(self, b, layer) if isinstance(b, StateBuffers) else layer(self, *b) for b in buffers
                ]
            )
            self.start = 0
            self.carry = torch.zeros(1)  # state layers: 1.0 when a call continues a sequence (FastDecoder sets it)

        def get_seq_length(self, layer_idx: int = 0) -> int:
            """The positions before this call, whatever the layers (transformers asks attention layers only, and a
            model of state layers alone has none)."""
            return self.start

    return UpdateCacheKV()


def kv_shapes(model, max_seq_len: int) -> list:
    """Each layer's key and value cache shapes ``[1, max_seq_len, heads, dim]``, read off the ``DynamicCache`` of a
    one-token forward of the model (its own attention): the heads the model really projects, whatever its config
    calls them. Keys and values may differ in heads and width: multi-head latent attention (DeepSeek-V2/V3) caches
    its compressed latent (``kv_lora_rank`` wide) as keys and its rotary key (``qk_rope_head_dim``) as values, one
    head each. A layer that keeps a state instead (LFM2's convolutions, SSMs) or beside them (Falcon-H1's hybrid
    layers) gives its ``state_cache.StateShapes``."""
    from transformers import DynamicCache
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    from qharness.deploy.fastpath.state_cache import state_shapes

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=True, **{cache_argument(model): cache})
    shapes = []
    for layer in cache.layers:
        kv = None
        if not isinstance(layer, LinearAttentionCacheLayerMixin) or hasattr(layer, "keys"):  # hybrid: both
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if keys is None or values is None or keys.dim() != 4 or values.dim() != 4:
                raise ValueError(f"a {type(layer).__name__} cache layer without 4-D keys and values")
            kv = tuple((1, max_seq_len, t.shape[1], t.shape[3]) for t in (keys, values))
        shapes.append(state_shapes(layer, kv) if isinstance(layer, LinearAttentionCacheLayerMixin) else kv)
    return shapes
