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

A layer that keeps states instead of keys and values (LFM2's short convolutions; gated DeltaNet's convolution window
and recurrent state, Qwen3.5 / Qwen3-Next; a Mamba2 mixer's window and selective-scan state, Granite-4.0-H, Bamba,
Nemotron-H) gets a ``StateLayer`` (``state_cache.py``): buffers beside the KV caches, continued by later calls and
started over by a call at position 0; one that keeps both (Falcon-H1's attention beside its mixer) a ``HybridLayer``.

Modules: ``kv_cache.py`` (``UpdateCacheKV`` and its layers, the int8 cache's per-token quantization, the cache of
the decoder running now), ``state_cache.py`` (the state layers, the gated delta rule, Mamba2's scan, the causal convolution), ``attention.py`` (the attention and mask functions, ``register``), ``rope.py`` (rotary
tables), ``decoder.py`` (``FastDecoder``, ``export_fast``), ``support.py`` (``unsupported_reason``),
``transposes.py`` (the ``sink_transposes`` FX pass), ``twin.py`` (``all_logits_twin``). What the deploy graph records
(which export it took, its KV cache) is ``deploy/deployed.py``'s ``DeployRecord``.
"""
