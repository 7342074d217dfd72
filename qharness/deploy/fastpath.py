"""The fast deploy graph: an HF decoder-only LM rewritten around ExecuTorch's LLM custom ops.

HF's static-cache export decodes 5-10x slower than ExecuTorch's own LLM export: it repeats KV heads
over the whole cache (``expand_copy``), writes the cache with ``index_put`` and builds a causal mask per
call, all outside the XNNPACK delegate. ``FastDecoder`` runs the same HF modules (embedding, RMSNorms,
q/k/v/o projections, MLPs, ``lm_head``: quantizers see the same ``nn.Linear``s) but writes the KV cache
with ``llama::update_cache`` into ``[1, max_seq_len, kv_heads, head_dim]`` buffers and attends with
``llama::custom_sdpa`` (causal from ``start_pos``, grouped-query heads without expansion), the ops
ExecuTorch's Llama export uses. Rotary tables come from the HF model's own ``rotary_emb`` for every
cache position, so numerics equal the HF model's up to float rounding.

``forward(tokens[1, n], input_pos[1]) -> logits[1, 1, vocab]``: the logits of the last token only, as
ExecuTorch's LLM export returns them (its runner samples from the last position). Prefill then skips
the final norm and ``lm_head`` for ``n - 1`` positions; all-position scores come from feeding a block
one token at a time, or from ``all_logits_twin(graph)``: the same quantized weights and ops, one call per block.

Example::

    reason = unsupported_reason(model, max_seq_len=256)      # None: the fast path applies
    graph = export_fast(model, max_seq_len=256).module()     # (tokens, input_pos) -> last-token logits
    scorer = all_logits_twin(graph)                          # (tokens, input_pos) -> logits of every position
"""

from __future__ import annotations

import copy

import torch
from torch.export import Dim

from qharness.upstream.fixes import custom_sdpa

# HF causal-LM classes whose decoder layers are: pre-norm attention (q/k/v/o projections with optional
# bias, optional q/k head norms) and a pre-norm MLP, with rotary positions and no attention extras.
SUPPORTED = {
    "LlamaForCausalLM": False,  # value: has q_norm/k_norm on the head dimension
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": False,
    "Qwen3ForCausalLM": True,
}
# Rotary types whose table for a position does not depend on the length of the sequence.
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


def unsupported_reason(model, max_seq_len: int) -> str | None:
    """Why ``model`` cannot take the fast path (``None``: it can), e.g. ``"GPT2LMHeadModel: not a supported architecture"``."""
    arch = type(model).__name__
    if arch not in SUPPORTED:
        return f"{arch}: not a supported architecture (fast path: {', '.join(sorted(SUPPORTED))})"
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if window is not None and window < max_seq_len:
        return (
            f"{arch}: sliding-window attention (window {window} < deploy.max_seq_len {max_seq_len}) is not implemented"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in STATIC_ROPE:
        return f"{arch}: rotary type {rope_type!r} depends on the sequence length (fast path: {', '.join(sorted(STATIC_ROPE))})"
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(config, name, None):
            return f"{arch}: {name} is not implemented"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return f"{arch}: pretraining_tp={config.pretraining_tp} is not implemented"
    if getattr(model.model, "rotary_emb", None) is None:
        return f"{arch}: no model.rotary_emb module"
    return None


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FastDecoder(torch.nn.Module):
    """``forward(tokens[1, n], input_pos[1]) -> logits[1, 1, vocab]`` over the HF model's own modules,
    a KV cache of ``max_seq_len`` positions written by ``llama::update_cache``, ``llama::custom_sdpa``."""

    def __init__(self, model, max_seq_len: int, all_logits: bool = False):
        super().__init__()
        self.all_logits = all_logits  # True: logits[1, n, vocab] of every position (the final norm + lm_head on all n)
        custom_sdpa.llm_custom_ops()
        config = model.config.get_text_config()
        base = model.model
        self.embed_tokens, self.layers, self.norm, self.lm_head = (
            base.embed_tokens,
            base.layers,
            base.norm,
            model.lm_head,
        )
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.scaling = float(attn.scaling)
        self.qk_norm = SUPPORTED.get(type(model).__name__, False)
        self.max_seq_len = max_seq_len
        weight = self.embed_tokens.weight
        dtype = torch.float32 if not weight.dtype.is_floating_point else weight.dtype
        with torch.no_grad():
            probe = torch.zeros(1, max_seq_len, self.head_dim, dtype=dtype)
            cos, sin = base.rotary_emb(probe, torch.arange(max_seq_len)[None])
        self.register_buffer("rope_cos", cos[0].to(dtype).clone(), persistent=False)  # [max_seq_len, head_dim]
        self.register_buffer("rope_sin", sin[0].to(dtype).clone(), persistent=False)
        shape = (1, max_seq_len, self.n_kv_heads, self.head_dim)
        for i in range(len(self.layers)):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=dtype), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=dtype), persistent=False)

    def _attention(self, i: int, attn, x, start: int, cos, sin):
        n = x.shape[1]
        q = attn.q_proj(x).view(1, n, self.n_heads, self.head_dim)
        k = attn.k_proj(x).view(1, n, self.n_kv_heads, self.head_dim)
        v = attn.v_proj(x).view(1, n, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
        torch.ops.llama.update_cache(k, k_cache, start)
        torch.ops.llama.update_cache(v, v_cache, start)
        y = torch.ops.llama.custom_sdpa(q, k_cache, v_cache, start, None, 0.0, True, self.scaling)
        return attn.o_proj(y.view(1, n, self.n_heads * self.head_dim))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + n <= self.max_seq_len)
        cos = self.rope_cos.narrow(0, start, n)[None, :, None, :]  # [1, n, 1, head_dim]
        sin = self.rope_sin.narrow(0, start, n)[None, :, None, :]
        h = self.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            h = h + self._attention(i, layer.self_attn, layer.input_layernorm(h), start, cos, sin)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.lm_head(self.norm(h if self.all_logits else h[:, -1:, :]))


def example_inputs(max_seq_len: int):
    n = min(8, max_seq_len - 1)
    return (torch.zeros(1, n, dtype=torch.long), torch.tensor([0], dtype=torch.long))


def dynamic_shapes(max_seq_len: int):
    return ({1: Dim("seq_len", min=1, max=max_seq_len - 1)}, None)


def export_fast(model, max_seq_len: int, all_logits: bool = False) -> torch.export.ExportedProgram:
    """Export ``FastDecoder(model)``: ``(tokens[1, n], input_pos[1]) -> logits[1, 1, vocab]`` (``all_logits``:
    ``[1, n, vocab]``), ``n`` dynamic."""
    with torch.no_grad():  # with grad on, torchao weight subclasses export as parametrizations the quant fusion misses
        return torch.export.export(
            FastDecoder(model, max_seq_len, all_logits),
            example_inputs(max_seq_len),
            dynamic_shapes=dynamic_shapes(max_seq_len),
            strict=True,
        )


def _last_token_slices(graph: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The ``h[:, -1:, :]`` of ``FastDecoder.forward``: ``aten.slice(h, 1, -1, <end>)`` nodes."""
    return [
        n
        for n in graph.graph.nodes
        if n.op == "call_function" and n.target == torch.ops.aten.slice.Tensor and tuple(n.args[1:3]) == (1, -1)
    ]


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
