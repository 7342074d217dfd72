"""The fast deploy graph: the HF model's own forward, with ExecuTorch's LLM custom ops as its attention and cache.

HF's static-cache export decodes 5-10x slower than ExecuTorch's own LLM export: it repeats KV heads
over the whole cache (``expand_copy``), writes the cache with ``index_put`` and builds a causal mask per
call, all outside the XNNPACK delegate. The fast path changes none of the model's code. It plugs two things
into transformers' own extension points and runs the model's ``forward``:

- an attention function registered with transformers' ``AttentionInterface`` (and a mask function returning
  ``None`` in ``AttentionMaskInterface``, so no mask tensor is built), ``ATTENTION``: ``llama::custom_sdpa``
  over the cache (BSHD, causal from ``start_pos``, grouped-query heads without expansion); a sliding-window
  layer whose window is shorter than the cache passes an additive window mask; attention logit soft-capping
  (Gemma2) runs as plain matmuls over the same cache, the query reshaped per KV head (no KV repetition);
- ``UpdateCacheKV``, a transformers ``Cache`` whose layers write with ``llama::update_cache`` into
  ``[1, max_seq_len, kv_heads, head_dim]`` buffers registered on ``FastDecoder`` (mutable buffers of the program)
  and hand the attention function those buffers as they are (BSHD: no transposes of the cache in the graph).
  Multi-head latent attention (DeepSeek-V3) caches its compressed latent and rotary key, buffers of their own
  widths: the model expands them into keys and values over the whole cache at each call, and ``attention``
  zero-pads the narrower of the two to one head dim for ``custom_sdpa`` (``_same_width``).

Positions (``position_ids = input_pos + arange(n)``) go through the model's own rotary code; the last token's
logits come from HF's ``logits_to_keep=1``. Quantizers see the model's own ``nn.Linear``s. A family whose
attention does not go through ``AttentionInterface`` and ``past_key_values.update`` (or that ``unsupported_reason``
rules out) takes the generic HF static-cache export instead, with the reason logged.

``forward(tokens[1, n], input_pos[1]) -> logits[1, 1, vocab]``: the logits of the last token only, as
ExecuTorch's LLM export returns them (its runner samples from the last position). All-position scores come
from feeding a block one token at a time, or from ``all_logits_twin(graph)``: the same quantized weights and
ops, one call per block.

Example::

    reason = unsupported_reason(model, max_seq_len=256)      # None: the fast path applies
    graph = export_fast(model, max_seq_len=256).module()     # (tokens, input_pos) -> last-token logits
    scorer = all_logits_twin(graph)                          # (tokens, input_pos) -> logits of every position
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings

import torch
from torch.export import Dim

from qharness.recipes.registry import KV_CACHES  # noqa: F401  (a recipe's kv_cache: fp32 or int8 per token and head)
from qharness.upstream.fixes import custom_sdpa

ATTENTION = "qharness_executorch"  # the name of the attention (and mask) function in transformers' interfaces
# Rotary types whose table for a position does not depend on the length of the sequence.
STATIC_ROPE = {"default", "linear", "llama3", "yarn", "proportional"}
_ACTIVE: list = []  # the UpdateCacheKV of the FastDecoder running now (the attention function reads its start)


def _rope_types(config) -> set[str]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return {"default"}
    per_layer_type = [v for v in rope.values() if isinstance(v, dict)]  # e.g. Gemma3: {"sliding_attention": {...}}
    return {r.get("rope_type", r.get("type", "default")) for r in (per_layer_type or [rope])}


def unsupported_reason(model, max_seq_len: int) -> str | None:
    """Why ``model`` cannot take the fast path (``None``: it can), e.g.
    ``"GPT2LMHeadModel: its attention does not use transformers' AttentionInterface"``.

    Static checks first; then a short eager run of ``FastDecoder`` (prefill, a second chunk, one decode step)
    must give the model's own logits: that is what shows a family's attention and cache go through the interfaces.
    """
    arch = type(model).__name__
    config = model.config.get_text_config()
    if getattr(config, "is_encoder_decoder", False):
        return f"{arch}: an encoder-decoder"
    if not model._can_set_attn_implementation():
        return f"{arch}: its attention does not use transformers' AttentionInterface"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not types <= {"full_attention", "sliding_attention"}:
        return f"{arch}: layer types {sorted(types)} (fast path: full_attention, sliding_attention)"
    if getattr(config, "num_kv_shared_layers", 0):
        return f"{arch}: layers sharing another layer's KV cache are not implemented"
    dynamic = _rope_types(config) - STATIC_ROPE
    if dynamic:
        return f"{arch}: rotary type {sorted(dynamic)[0]!r} depends on the sequence length (fast path: {', '.join(sorted(STATIC_ROPE))})"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return f"{arch}: pretraining_tp={config.pretraining_tp} is not implemented"
    return _eager_mismatch(model, max_seq_len)


def _eager_mismatch(model, max_seq_len: int) -> str | None:
    """Run ``FastDecoder`` eagerly on a few tokens against the model's own forward; the reason if they differ."""
    arch = type(model).__name__
    n = min(6, max_seq_len)
    x = torch.randint(0, model.config.get_text_config().vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    try:
        decoder = FastDecoder(model, max_seq_len, all_logits=True)
        with torch.no_grad():
            ref = model(input_ids=x, use_cache=False).logits[0].float()
            cut = max(1, n - 3)
            got = [decoder(x[:, :cut], torch.tensor([0]))[0]]
            if n - cut > 1:
                got.append(decoder(x[:, cut : n - 1], torch.tensor([cut]))[0])
            got.append(decoder(x[:, n - 1 :], torch.tensor([n - 1]))[0])
            got = torch.cat(got).float()
    except Exception as e:  # the model's code refused our cache or attention function
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return f"{arch}: its forward fails with the fast path's cache and attention ({type(e).__name__}: {first})"
    err = (got - ref).abs().max().item()
    if not err <= 1e-3 * max(ref.abs().max().item(), 1.0):
        return f"{arch}: the fast path's logits differ from the model's own (max abs difference {err:.3g})"
    return None


# --- the attention function and the mask function -------------------------------------------------------------


def _window_mask(start, n: int, length: int, window: int, dtype) -> torch.Tensor:
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
    mask = _window_mask(start, n, length, window if window is not None else length + 1, scores.dtype)
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
    if not _ACTIVE:
        raise RuntimeError(f"{ATTENTION} attention runs only inside FastDecoder")
    start = _ACTIVE[-1].start
    q = query.transpose(1, 2)  # [1, n, H, D]: a view of the projection's output
    v_dim = None
    layer_idx = getattr(module, "layer_idx", None)
    if (
        layer_idx is not None and _ACTIVE[-1].layers[layer_idx].latent
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
        ks, kz, vs, vz = _ACTIVE[-1].layers[module.layer_idx].qparams
        if not softcap and window is None:  # as export_llm's quantized cache (dequantizing instead decoded slower)
            qq, qs, qz = quantize_per_token(q)
            out = torch.ops.llama.custom_quantized_sdpa(
                qq, key, value, start, None, 0.0, True, scale, qz, qs, kz, ks, vz, vs
            )
            return out, None
        used = start + n  # no quantized kernel for these: attend over the dequantized positions written so far
        key = _dequantize(key.narrow(1, 0, used), kz.narrow(1, 0, used), ks.narrow(1, 0, used))
        value = _dequantize(value.narrow(1, 0, used), vz.narrow(1, 0, used), vs.narrow(1, 0, used))
        length = used
    if softcap:
        return _softcapped_attention(q, key, value, start, scale, float(softcap), window), None
    if window is None:
        return torch.ops.llama.custom_sdpa(q, key, value, start, None, 0.0, True, scale), None
    mask = _window_mask(start, n, length, window, q.dtype)
    return torch.ops.llama.custom_sdpa(q, key, value, start, mask, 0.0, False, scale), None


def quantize_per_token(x: torch.Tensor):
    """``x [1, n, H, D]`` -> ``(int8 values, scales float32 [1, n, H, 1], zero points int8 [1, n, H, 1])``: asymmetric
    per token and head, as ExecuTorch's quantized KV cache stores keys and values (``quantized_decomposed`` ops)."""
    qd = torch.ops.quantized_decomposed
    scales, zero_points = qd.choose_qparams_per_token_asymmetric.default(x, torch.int8)
    values = qd.quantize_per_token(x, scales, zero_points, -128, 127, torch.int8)
    return values, scales.to(torch.float32), zero_points.to(torch.int8)


def _dequantize(values, zero_points, scales):
    return (values.to(torch.float32) - zero_points.to(torch.float32)) * scales


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


@contextlib.contextmanager
def fast_modules(model, rope_tables: dict[str, torch.nn.Module] | None = None):
    """Inside the block ``model`` (and its sub-models) runs with the ``ATTENTION`` implementation and, given
    ``rope_tables`` (``{module path: table}``, ``FastDecoder``'s), with those rotary modules swapped for their tables."""
    before = model.config._attn_implementation
    swapped = []
    model.set_attn_implementation(ATTENTION)
    try:
        for path, table in (rope_tables or {}).items():
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            swapped.append((parent, name, getattr(parent, name)))
            setattr(parent, name, table)
        yield
    finally:
        for parent, name, original in reversed(swapped):
            setattr(parent, name, original)
        model.set_attn_implementation(before)


class RopeTable(torch.nn.Module):
    """A rotary-embedding module of the model (``forward(x, position_ids[, layer_type]) -> (cos, sin)``) as
    tables of every cache position, computed once by that module: a call reads rows ``start .. start + n``
    (``FastDecoder`` passes ``position_ids = start + arange(n)``) instead of computing the angles per call."""

    def __init__(self, rotary: torch.nn.Module, max_seq_len: int, dtype: torch.dtype, layer_types: list[str]):
        super().__init__()
        self.keys = layer_types if "layer_type" in inspect.signature(rotary.forward).parameters else [None]
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
        start, n = _ACTIVE[-1].start, position_ids.shape[-1]
        cos, sin = getattr(self, f"cos_{i}").narrow(1, start, n), getattr(self, f"sin_{i}").narrow(1, start, n)
        return (cos, sin) if cos.dtype == x.dtype else (cos.to(x.dtype), sin.to(x.dtype))


# --- the cache ------------------------------------------------------------------------------------------------


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
                    return _dequantize(self.keys, kz, ks).transpose(1, 2), _dequantize(self.values, vz, vs).transpose(
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


def _update_cache_kv(buffers: list[tuple]):
    """``UpdateCacheKV``: a transformers ``Cache`` over ``buffers`` (one ``(keys, values, qparams or None)`` per layer)."""
    from transformers.cache_utils import Cache

    class UpdateCacheKV(Cache):
        """transformers ``Cache`` over per-layer ``update_cache`` buffers; ``start`` is the position of the first
        token of the current call (set by ``FastDecoder.forward``)."""

        def __init__(self):
            layer = _cache_layer_class()
            super().__init__(layers=[layer(self, *b) for b in buffers])
            self.start = 0

    return UpdateCacheKV()


def kv_shapes(model, max_seq_len: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each layer's key and value cache shapes ``[1, max_seq_len, heads, dim]``, read off the ``DynamicCache`` of a
    one-token forward of the model (its own attention): the heads the model really projects, whatever its config
    calls them. Keys and values may differ in heads and width: multi-head latent attention (DeepSeek-V2/V3) caches
    its compressed latent (``kv_lora_rank`` wide) as keys and its rotary key (``qk_rope_head_dim``) as values, one
    head each."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), past_key_values=cache, use_cache=True)
    shapes = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.dim() != 4 or values.dim() != 4:
            raise ValueError(f"a {type(layer).__name__} cache layer without 4-D keys and values")
        shapes.append(tuple((1, max_seq_len, t.shape[1], t.shape[3]) for t in (keys, values)))
    return shapes


class FastDecoder(torch.nn.Module):
    """``forward(tokens[1, n], input_pos[1]) -> logits[1, 1, vocab]``: the HF model's own forward over
    ``UpdateCacheKV`` (``max_seq_len`` positions) with the ``ATTENTION`` attention function."""

    def __init__(self, model, max_seq_len: int, all_logits: bool = False, kv_cache: str = "fp32"):
        super().__init__()
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache {kv_cache!r}: use one of {', '.join(KV_CACHES)}")
        register()
        self.model = model
        self.all_logits = all_logits  # True: logits[1, n, vocab] of every position (the final norm + lm_head on all n)
        self.max_seq_len = max_seq_len
        weight = model.get_input_embeddings().weight
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        buffers, int8 = [], kv_cache == "int8"
        for i, shapes in enumerate(kv_shapes(model, max_seq_len)):
            for kv, shape in zip(("k", "v"), shapes):
                self.register_buffer(
                    f"{kv}_cache_{i}", torch.zeros(shape, dtype=torch.int8 if int8 else dtype), persistent=False
                )
                if int8:
                    self.register_buffer(f"{kv}_scales_{i}", torch.ones(shape[:3] + (1,)), persistent=False)
                    self.register_buffer(
                        f"{kv}_zero_points_{i}", torch.zeros(shape[:3] + (1,), dtype=torch.int8), persistent=False
                    )
            qparams = (
                tuple(getattr(self, f"{kv}_{what}_{i}") for kv in ("k", "v") for what in ("scales", "zero_points"))
                if int8
                else None
            )
            buffers.append((getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}"), qparams))
        self.cache = _update_cache_kv(buffers)
        config = model.config.get_text_config()
        layer_types = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
        self.rope_tables = torch.nn.ModuleDict()  # module path (dots as "__") -> RopeTable
        for path, module in model.named_modules():
            if path.rpartition(".")[2] == "rotary_emb":
                self.rope_tables[path.replace(".", "__")] = RopeTable(module, max_seq_len, dtype, layer_types)

    def swapped(self):
        """``fast_modules`` of this decoder's model: the ``ATTENTION`` implementation and the rotary tables."""
        return fast_modules(self.model, {k.replace("__", "."): v for k, v in self.rope_tables.items()})

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + n <= self.max_seq_len)
        self.cache.start = start
        position_ids = (input_pos + torch.arange(n))[None]
        _ACTIVE.append(self.cache)
        try:
            with contextlib.nullcontext() if torch.compiler.is_compiling() else self.swapped():
                out = self.model(
                    input_ids=tokens,
                    position_ids=position_ids,
                    past_key_values=self.cache,
                    use_cache=True,
                    logits_to_keep=0 if self.all_logits else 1,
                )
        finally:
            _ACTIVE.pop()
        return out.logits


def example_inputs(max_seq_len: int):
    n = min(8, max_seq_len - 1)
    return (torch.zeros(1, n, dtype=torch.long), torch.tensor([0], dtype=torch.long))


def dynamic_shapes(max_seq_len: int):
    return ({1: Dim("seq_len", min=1, max=max_seq_len - 1)}, None)


def export_fast(
    model, max_seq_len: int, all_logits: bool = False, kv_cache: str = "fp32"
) -> torch.export.ExportedProgram:
    """Export ``FastDecoder(model)``: ``(tokens[1, n], input_pos[1]) -> logits[1, 1, vocab]`` (``all_logits``:
    ``[1, n, vocab]``), ``n`` dynamic; ``kv_cache``: ``fp32`` or ``int8`` (``KV_CACHES``)."""
    decoder = FastDecoder(model, max_seq_len, all_logits, kv_cache)
    with torch.no_grad(), decoder.swapped(), warnings.catch_warnings():  # no grad: torchao weight subclasses export
        warnings.filterwarnings("ignore", "While compiling, we found certain side effects")  # as parametrizations
        ep = torch.export.export(  # the quant fusion misses; side effects: the cache's start, _ACTIVE (by design)
            decoder, example_inputs(max_seq_len), dynamic_shapes=dynamic_shapes(max_seq_len), strict=True
        )
    sink_transposes(ep.graph_module)
    return ep


_ELEMENTWISE = {  # element-wise ops (and a mean over other dimensions) that a transpose moves across
    "mul.Tensor",
    "add.Tensor",
    "sub.Tensor",
    "div.Tensor",
    "neg.default",
    "rsqrt.default",
    "pow.Tensor_Scalar",
    "to.dtype",
    "type_as.default",
    "alias.default",
    "mean.dim",
}


class _Free:
    """Placeholder in ``_moved_args``: transpose this broadcast operand (``args[0]``), a view moving no data."""

    def __init__(self, node):
        self.args = (node,)


def _moved_args(user, t, pair, is_t, dims):
    """``user``'s arguments with transpose ``t`` (dimensions ``pair``) moved below it, or None if it cannot move:
    transposes of ``pair`` give their input; same-rank operands with size 1 in ``pair`` are transposed (``_Free``);
    lower-rank operands broadcasting over dimensions after ``pair`` and non-tensors stay."""
    rank = t.meta["val"].dim()
    out = []
    for i, x in enumerate(user.args):
        if user.target == torch.ops.aten.type_as.default and i == 1:
            out.append(x)  # only its dtype counts
        elif isinstance(x, torch.fx.Node):
            r = x.meta["val"].dim()
            if is_t(x) and dims(x) == pair:
                out.append(x.args[0])
            elif r == rank and _unit(x, *pair):
                out.append(_Free(x))
            elif r < rank and max(pair) < rank - r:
                out.append(x)
            else:
                return None
        elif user.target == torch.ops.aten.mean.dim and i == 1:
            if set(pair) & {d % rank for d in x} or len(user.args) < 3 or not user.args[2]:
                return None  # a mean over a moved dimension, or one that drops dimensions
            out.append(x)
        else:
            out.append(x)
    return out


def _unit(node: torch.fx.Node, a: int, b: int) -> bool:
    """``node``'s value has a static size 1 in dimension ``a`` or ``b`` (so swapping them moves no data)."""
    shape = node.meta["val"].shape
    return any(isinstance(shape[d], int) and shape[d] == 1 for d in (a, b))


def _unsqueezed(node, pair: tuple[int, int]) -> int | None:
    """The dimension ``d`` (one of ``pair``) if ``node`` is ``aten.unsqueeze(y, d)``, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"):
        return None
    if node.target != torch.ops.aten.unsqueeze.default:
        return None
    d = node.args[1] % node.meta["val"].dim()
    return d if d in pair else None


def sink_transposes(graph_module: torch.fx.GraphModule) -> int:
    """Move every ``aten.transpose(x, a, b)`` below the slices, element-wise ops and concatenations that use it,
    and drop a transpose of a transpose on the same two dimensions; returns how many rewrites.

    HF attention turns projections into BHSD (``view(...).transpose(1, 2)``), applies rotary positions there
    (element-wise, with slices and a concatenation for ``rotate_half``), and the fast path turns the result
    back into BSHD for ``update_cache`` / ``custom_sdpa``. Lowered as they are, the two transposes become
    ``permute_copy``s that cut each layer's XNNPACK partition in two around the (non-delegated) slices. Sunk
    and cancelled, the rotary math runs in BSHD as ExecuTorch's own Llama does (same values: only the order of
    layout changes). An element-wise op moves a transpose across only when each other operand is a transpose of
    the same dimensions, a scalar, or a broadcast operand of the same rank with size 1 in one of the two
    dimensions (that operand is transposed instead: no data moves)."""
    aten = torch.ops.aten
    graph = graph_module.graph
    rewrites = 0

    def is_t(n):
        return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target == aten.transpose.int

    def dims(t):
        rank = t.meta["val"].dim()
        return tuple(sorted(d % rank for d in t.args[1:3]))

    def make(target, args, like):
        node = graph.call_function(target, args)
        node.meta.update({k: v for k, v in like.meta.items() if k != "val"})
        fake = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
        fake = [
            [b.meta["val"] if isinstance(b, torch.fx.Node) else b for b in a] if isinstance(a, list) else a
            for a in fake
        ]
        node.meta["val"] = target(*fake)
        return node

    changed = True
    while changed:
        changed = False
        for user in list(graph.nodes):
            if user.target == aten._assert_tensor_metadata.default and is_t(user.args[0]) and len(user.args) == 1:
                if user.kwargs.get("size") is None and user.kwargs.get("stride") is None:
                    user.replace_input_with(user.args[0], user.args[0].args[0])  # dtype/device: check the input
                    rewrites, changed = rewrites + 1, True
            if user.target == aten.type_as.default and is_t(user.args[1]):
                user.update_arg(1, user.args[1].args[0])  # only the dtype of its second argument counts
                rewrites, changed = rewrites + 1, True
            if user.op != "call_function" or user.kwargs:
                continue
            name = f"{user.target._opname}.{user.target._overloadname}" if hasattr(user.target, "_opname") else ""
            inputs = list(user.args[0]) if name == "cat.default" else [user.args[0]]
            if name == "transpose.int" and _unsqueezed(user.args[0], dims(user)) is not None:
                pass
            elif not all(is_t(t) for t in inputs) or len({dims(t) for t in inputs}) != 1:
                if name not in _ELEMENTWISE or not any(is_t(a) for a in user.args):
                    continue
            with graph.inserting_before(user):
                if name == "transpose.int" and is_t(user.args[0]) and dims(user) == dims(user.args[0]):
                    new = user.args[0].args[0]
                elif name == "transpose.int" and _unsqueezed(user.args[0], dims(user)) is not None:
                    a, b = dims(user)  # transpose(unsqueeze(y, a), a, b) == unsqueeze(y, b)
                    d = _unsqueezed(user.args[0], (a, b))
                    new = make(aten.unsqueeze.default, (user.args[0].args[0], b if d == a else a), user)
                elif name == "slice.Tensor":
                    t = user.args[0]
                    a, b = dims(t)
                    d = user.args[1] % t.meta["val"].dim()
                    d = b if d == a else a if d == b else d
                    new = make(aten.transpose.int, (make(user.target, (t.args[0], d, *user.args[2:]), user), a, b), t)
                elif name == "cat.default":
                    a, b = dims(inputs[0])
                    d = (user.args[1] if len(user.args) > 1 else 0) % inputs[0].meta["val"].dim()
                    d = b if d == a else a if d == b else d
                    cat = make(user.target, ([t.args[0] for t in inputs], d), user)
                    new = make(aten.transpose.int, (cat, a, b), inputs[0])
                elif name in _ELEMENTWISE:
                    t = next(a for a in user.args if is_t(a))
                    a, b = dims(t)
                    args = _moved_args(user, t, (a, b), is_t, dims)
                    if args is None:
                        continue
                    args = [make(aten.transpose.int, (x.args[0], a, b), t) if isinstance(x, _Free) else x for x in args]
                    new = make(aten.transpose.int, (make(user.target, tuple(args), user), a, b), t)
                else:
                    continue
            user.replace_all_uses_with(new)
            graph.erase_node(user)
            rewrites, changed = rewrites + 1, True
        graph.eliminate_dead_code()
    seen: dict[tuple, torch.fx.Node] = {}  # one unsqueeze of the rotary tables for all layers, not one per use
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == aten.unsqueeze.default and not node.kwargs:
            first = seen.setdefault((node.args[0], node.args[1] % node.meta["val"].dim()), node)
            if first is not node:
                node.replace_all_uses_with(first)
                graph.erase_node(node)
    graph_module.recompile()
    return rewrites


def _last_token_slices(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``hidden_states[:, -1:, :]`` of HF's ``logits_to_keep=1``: ``aten.slice(h, 1, -1, <end>)`` nodes."""
    return [
        n
        for n in graph.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.aten.slice.Tensor and tuple(n.args[1:3]) == (1, -1)
    ]


def kv_cache_dtype(graph: torch.fx.GraphModule) -> str:
    """``"fp32"`` or ``"int8"``: the KV cache of the program ``quantize_for_deploy`` made (``KV_CACHES``)."""
    return graph.meta.get("qharness_kv_cache", "fp32")


def export_path(graph: torch.fx.GraphModule) -> str:
    """``"fast"`` or ``"generic"``: the export ``quantize_for_deploy`` used for ``graph``."""
    return graph.meta.get("qharness_export_path", "generic")


def fallback_reason(graph: torch.fx.GraphModule) -> str | None:
    """Why ``graph`` took the generic export (``None`` for the fast path)."""
    return graph.meta.get("qharness_fallback_reason")


def all_logits_twin(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The twin of a fast-path deploy graph (exported, maybe quantized and folded) that returns the logits of
    every position: the same graph without its last-token slice, over the same attributes (weights,
    quantization parameters and KV-cache buffers are shared, not copied). Scoring a block then takes one
    call instead of one per token. A graph of the generic export returns every position already and comes
    back as it is.

    Example::

        scorer = all_logits_twin(deployed)   # scorer(block[None], torch.tensor([0]))[0]: logits[n, vocab]
    """
    if export_path(graph) != "fast":
        return graph
    slices = _last_token_slices(graph)
    if len(slices) != 1:
        raise RuntimeError(f"expected one last-token slice in the fast-path graph, found {len(slices)}")
    new_graph = torch.fx.Graph()
    new_graph._codegen = copy.deepcopy(graph.graph._codegen)  # keeps the (tokens, input_pos) calling convention
    remap: dict[torch.fx.Node, torch.fx.Node] = {}
    output = new_graph.graph_copy(graph.graph, remap)
    new_graph.output(output)
    cut = remap[slices[0]]
    cut.replace_all_uses_with(remap[slices[0].args[0]])
    new_graph.erase_node(cut)
    twin = torch.fx.GraphModule(graph, new_graph)
    twin.meta.update(graph.meta)
    return twin
