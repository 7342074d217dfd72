"""The fast path's recurrent-state cache layers: what a layer keeps instead of keys and values (LFM2's short gated
convolutions; the gated DeltaNet of Qwen3.5 / Qwen3-Next and the Mamba2 mixers: a convolution window and a recurrent
state), as mutable buffers of the program beside the KV caches.

transformers' own ``LinearAttentionLayer`` decides prefill or decode in Python (``has_previous_state``) and
allocates its state on first use; a program exported once must do both through one graph. ``StateLayer`` keeps each
state in a buffer registered on ``FastDecoder`` and answers every call in the prefill form the model's code already
has (``get_conv_state`` / ``get_recurrent_state`` return ``None``): ``update_conv_state`` hands back the stored window
followed by the new inputs and keeps the last ``kernel`` of them in place; the gated delta rule (swapped into the
model's module for the export, ``gated_delta_rule``) starts from the stored recurrent state, which
``update_recurrent_state`` then overwrites. A call at ``input_pos`` 0 starts a new sequence: the stored states count
as zeros (what the model's own prefill starts from), so a runner needs no reset. A later chunk or a decode step
continues from them, as a KV cache continues from its positions.

Mamba2's selective scan (Falcon-H1, Granite-4.0-H, Bamba, Nemotron-H, Zamba2, Mamba2) is carried the same way:
``mamba2_scan`` (swapped in for the model's ``mamba2_chunk_scan``) is the scan's state-space dual form over the call's
tokens as one chunk, started from the stored state; a hybrid layer that also attends (Falcon-H1's parallel
attention and Mamba2 mixer) keeps its KV cache in the same layer (``HybridLayer``). The layers' depthwise causal
convolution runs as multiply-adds XNNPACK delegates (``causal_conv``, swapped in for ``causal_conv1d_fn``). Other
recurrent states (Mamba1's selective scan: Mamba, Jamba, Zamba) are not held: ``recurrent_state_reason`` says so
before any work, and ``update_recurrent_state`` refuses a state no route reads.

Example::

    layer = StateLayer(cache, conv=[torch.zeros(1, 64, 3)], recurrent=[None])  # cache.carry: 1.0 after position 0
    window = layer.update_conv_state(x)                                        # x [1, 64, n] -> [1, 64, 3 + n]
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class StateShapes:
    """A recurrent layer's state buffers, one shape per state index: ``conv`` (``[1, channels, kernel]``) and
    ``recurrent`` (any shape); ``None`` where the layer keeps no such state. ``kv``: the key and value cache shapes
    of a hybrid layer that also attends (Falcon-H1, Zamba2), ``None`` for one that does not."""

    conv: tuple[tuple[int, ...] | None, ...]
    recurrent: tuple[tuple[int, ...] | None, ...]
    kv: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclasses.dataclass(frozen=True)
class StateBuffers:
    """A recurrent layer's buffers, as ``StateShapes`` lays them out: ``conv`` and ``recurrent`` (``None`` where it
    keeps none), and a hybrid layer's ``(keys, values, qparams or None)`` (``kv_cache.update_cache_kv``'s)."""

    conv: list
    recurrent: list
    kv: tuple | None = None


def state_shapes(layer, kv: tuple | None = None) -> StateShapes:
    """The shapes of a transformers ``LinearAttentionCacheLayerMixin`` layer after a one-token forward."""
    n = layer.number_of_states
    conv = tuple(tuple(layer.conv_states[i].shape) if layer.is_conv_states_initialized[i] else None for i in range(n))
    recurrent = tuple(
        tuple(layer.recurrent_states[i].shape) if layer.is_recurrent_states_initialized[i] else None for i in range(n)
    )
    return StateShapes(conv, recurrent, kv)


CURRENT: list = []  # the state layer whose convolution state was updated last: the one the recurrent rule continues
GATED_DELTA = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")  # transformers' module functions
MAMBA2 = ("mamba2_chunk_scan",)  # the Mamba2 mixers' chunked scan (transformers' module function)
CONV = "causal_conv1d_fn"  # the recurrent layers' depthwise causal convolution (LFM2, gated DeltaNet, Mamba2)


def _modeling_modules(model) -> list:
    """The Python modules that define ``model``'s submodules (transformers' ``modeling_*``)."""
    import sys

    found = {}
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if module is not None:
            found[module.__name__] = module
    return list(found.values())


def rule_modules(model) -> list:
    """The transformers modeling modules of ``model`` whose layers run a recurrent rule the fast path carries,
    through module functions (``GATED_DELTA``: Qwen3.5, Qwen3.5-MoE, Qwen3-Next; ``MAMBA2``: Falcon-H1,
    Granite-4.0-H, Bamba, Nemotron-H, Zamba2, Mamba2), which ``swap_rules`` replaces for the export."""
    return [
        module
        for module in _modeling_modules(model)
        if any(all(hasattr(module, name) for name in names) for names in (GATED_DELTA, MAMBA2))
    ]


def recurrent_state_reason(arch: str, shapes: list, carried: bool = False) -> str | None:
    """Why the fast path cannot hold these layers' states (``None``: it can): a recurrent (SSM / linear-attention)
    state that no route carries from call to call (``carried``: the model's layers run a rule ``rule_modules``
    finds, the gated delta rule or Mamba2's scan)."""
    for i, layer in enumerate(shapes):
        if isinstance(layer, StateShapes) and any(s is not None for s in layer.recurrent) and not carried:
            return (
                f"{arch}: layer {i} keeps a recurrent (SSM) state; the fast path carries convolution states (LFM2), "
                "the gated delta rule's state (Qwen3.5, Qwen3-Next) and Mamba2's (Falcon-H1, Granite-4.0-H), not "
                "this selective scan's"
            )
    return None


def _stored_state(shape: tuple) -> torch.Tensor:
    """The recurrent state the layer running now (``CURRENT``) continues, float32: its buffer times the cache's
    ``carry`` (zeros at position 0), or zeros of ``shape`` outside a ``StateLayer``."""
    layer = CURRENT[-1] if CURRENT else None
    state = None if layer is None else layer.recurrent_states[0]
    if state is None:
        return torch.zeros(shape)
    return state.to(torch.float32) * layer.cache.carry


def mamba2_scan(
    hidden_states,
    dt,
    A,
    B,
    C,
    chunk_size: int = 256,
    D=None,
    dt_bias=None,
    initial_states=None,
    dt_softplus: bool = False,
    dt_limit: tuple = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs,
):
    """transformers' ``mamba2_chunk_scan`` (same arguments, same results: ``[B, T, H, P]`` and the final
    ``[B, H, P, N]`` state) with the call's ``T`` tokens as one chunk, so one exported graph serves a prefill of any
    length and a one-token decode step (``O(T^2)`` per call, one ``[T, T]`` decay per head), starting from the state
    the layer running now keeps (``StateLayer``, times the cache's ``carry``) when the model passes none.

    Per head ``h``: ``state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T``, ``y_t = state_t C_t + D x_t``.
    """
    batch, length, heads, width = hidden_states.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = torch.clamp(dt.float(), min=dt_limit[0], max=dt_limit[1])

    def per_head(t):  # [B, T, H, ...] -> [B * H, T, ...]: batched matmuls, no reshape of two dynamic dims (XNNPACK)
        t = t.float().transpose(1, 2)
        return t.reshape(batch * heads, *t.shape[2:])

    x = per_head(hidden_states)  # [BH, T, P]
    B = per_head(B.repeat_interleave(heads // B.shape[2], dim=2))  # [BH, T, N]
    C = per_head(C.repeat_interleave(heads // C.shape[2], dim=2))
    dt = per_head(dt)  # [BH, T]
    if initial_states is None:
        initial_states = _stored_state((batch, heads, width, B.shape[-1]))
    state0 = initial_states.to(torch.float32).reshape(batch * heads, width, -1)  # [BH, P, N]
    a = A.float().repeat(batch)[:, None] * dt  # [BH, T]: log decay per step
    cum = torch.cumsum(a, dim=-1)
    # decay[t, s] = exp(a_{s+1} + ... + a_t) for s <= t (a cumulative sum of the masked steps: no cum_t - cum_s)
    below = torch.tril(torch.ones(length, length, dtype=torch.bool), diagonal=-1)
    segsum = torch.cumsum(a[:, :, None].expand(-1, -1, length).masked_fill(~below, 0.0), dim=1)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    decay = torch.exp(segsum.masked_fill(~causal, float("-inf")))  # [BH, T, S]
    xdt = x * dt[..., None]
    y = torch.bmm(torch.bmm(C, B.transpose(1, 2)) * decay, xdt)  # [BH, T, P]
    y = y + torch.bmm(C, state0.transpose(1, 2)) * torch.exp(cum)[..., None]
    if D is not None:
        y = y + D.float().repeat(batch)[:, None, None] * x
    y = y.reshape(batch, heads, length, width).transpose(1, 2).contiguous()  # callers view() it (Falcon-H1)
    if not return_final_states:
        return y
    total = a.sum(dim=1, keepdim=True)  # [BH, 1] (no slice of the last step: all_logits_twin cuts the only one)
    to_end = torch.exp(total - cum)  # [BH, T]: decay from each step to the last
    final = torch.bmm((xdt * to_end[..., None]).transpose(1, 2), B)  # [BH, P, N]
    final = final + torch.exp(total)[..., None] * state0
    return y, final.reshape(batch, heads, width, -1)


def causal_conv(hidden_states, weight, bias=None, activation: str | None = None, **kwargs):
    """transformers' ``causal_conv1d_fn`` (``[B, C, L]`` -> ``[B, C, L]``: the depthwise causal convolution with
    ``weight [C, K]``, then ``activation``) as ``K`` shifted multiply-adds, which XNNPACK's delegate runs: a decode
    step's window is a few columns, where ExecuTorch's portable conv kernel (what a ``conv1d`` over a dynamic length
    lowers to) cost a Mamba2 layer a quarter of its step."""
    from transformers.activations import ACT2FN

    kernel, length = weight.shape[-1], hidden_states.shape[-1]
    x = torch.nn.functional.pad(hidden_states.to(weight.dtype), (kernel - 1, 0))
    out = x[..., :length] * weight[:, :1]
    for k in range(1, kernel):
        out = out + x[..., k : k + length] * weight[:, k : k + 1]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype)


def gated_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    chunk_size: int = 64,
    initial_state=None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs,
):
    """transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` (same arguments, same
    results: ``[B, T, H_v, D_v]`` and the final ``[B, H_v, D_k, D_v]`` state) computed by ExecuTorch's
    ``llama::gated_delta_rule`` kernel, starting from the state the layer running now keeps (``StateLayer``, times
    the cache's ``carry``) when the model passes none: the model's prefill branch, continued."""
    from qharness.upstream.fixes.custom_sdpa import llm_custom_ops

    llm_custom_ops()
    dtype = query.dtype
    heads_k, heads_v = key.shape[2], value.shape[2]
    if heads_k != heads_v:  # each query/key head serves heads_v // heads_k consecutive value heads
        query = query.repeat_interleave(heads_v // heads_k, dim=2)
        key = key.repeat_interleave(heads_v // heads_k, dim=2)
    query, key, value, beta, g = (
        x.transpose(1, 2).to(torch.float32).contiguous() for x in (query, key, value, beta, g)
    )
    if use_qk_l2norm_in_kernel:  # transformers' l2norm
        query = query * torch.rsqrt((query * query).sum(dim=-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(dim=-1, keepdim=True) + 1e-6)
    query = query / (query.shape[-1] ** 0.5)
    if initial_state is None:
        initial_state = _stored_state((*value.shape[:2], key.shape[-1], value.shape[-1]))
    out, final = torch.ops.llama.gated_delta_rule.default(
        query, key, value, g.exp(), beta, initial_state.to(torch.float32)
    )
    return out.transpose(1, 2).contiguous().to(dtype), (final if output_final_state else None)


@contextlib.contextmanager
def swap_rules(model):
    """Inside the block the modules of ``model``'s layers call ``gated_delta_rule`` for both of their gated delta
    rule functions, ``mamba2_scan`` for their Mamba2 chunked scan and ``causal_conv`` for their causal convolution,
    where they have them."""
    rules = {**dict.fromkeys(GATED_DELTA, gated_delta_rule), **dict.fromkeys(MAMBA2, mamba2_scan), CONV: causal_conv}
    saved = []
    try:
        for module in _modeling_modules(model):
            for name, rule in rules.items():
                if hasattr(module, name):
                    saved.append((module, name, getattr(module, name)))
                    setattr(module, name, rule)
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


@functools.cache
def _state_layer_class():
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    class StateLayer(LinearAttentionCacheLayerMixin):
        """One recurrent layer's states over registered buffers (``conv``: ``[1, C, K]`` buffers, ``recurrent``: any
        shape; ``None`` where it keeps none, one per state index), read and written in the prefill form;
        ``cache.carry`` (a tensor, 1.0 when the call continues a sequence, 0.0 at position 0) decides whether the
        stored states are the past or zeros. Updating the convolution state makes this layer the cache's ``current``
        one, whose recurrent state ``gated_delta_rule`` starts from."""

        is_sliding = False

        def __init__(self, cache, conv: list[torch.Tensor | None], recurrent: list[torch.Tensor | None]):
            super().__init__(number_of_states=len(conv))
            self.cache = cache
            for i, (window, state) in enumerate(zip(conv, recurrent)):
                if window is not None:
                    self.conv_states[i] = window
                    self.conv_kernel_size[i] = window.shape[-1]
                    self.is_conv_states_initialized[i] = True
                    self.dtype, self.device = window.dtype, window.device
                if state is not None:
                    self.recurrent_states[i] = state
                    self.is_recurrent_states_initialized[i] = True
            # has_previous_state stays False: the model's code takes its prefill branch, which this layer continues

        def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
            pass

        def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
            state = self.conv_states[state_idx]
            if state is None or conv_states.shape[:-1] != state.shape[:-1]:
                raise ValueError(
                    f"conv states {tuple(conv_states.shape)} do not fit a state buffer "
                    f"{None if state is None else tuple(state.shape)}"
                )
            CURRENT[:] = [self]  # the layer gated_delta_rule continues (it runs next, in the same layer's forward)
            full = torch.cat([state * self.cache.carry.to(state.dtype), conv_states.to(state.dtype)], dim=-1)
            state.copy_(full[..., -state.shape[-1] :])
            return full

        def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs):
            state = self.recurrent_states[state_idx]
            if state is None or recurrent_states.shape != state.shape:
                raise NotImplementedError(
                    f"a recurrent state {tuple(recurrent_states.shape)} with no buffer of its shape (the fast path "
                    "carries the gated delta rule's state)"
                )
            state.copy_(recurrent_states.to(state.dtype))
            return state

        def reset(self) -> None:
            for states in (self.conv_states, self.recurrent_states):
                for i in range(self.number_of_states):
                    if states[i] is not None:
                        states[i].zero_()

    return StateLayer


@functools.cache
def _hybrid_layer_class(attention_layer):
    class HybridLayer(_state_layer_class(), attention_layer):
        """A hybrid layer's states (``StateLayer``) and its keys and values (``attention_layer``, the KV cache's
        ``UpdateCacheLayer``): Falcon-H1 runs attention and a Mamba2 mixer side by side in every layer, Zamba2 a
        shared attention block beside some mixers. transformers counts such a layer as attention, not linear."""

        is_compileable = True

        def __init__(self, cache, buffers: StateBuffers):
            attention_layer.__init__(self, cache, *buffers.kv)
            _state_layer_class().__init__(self, cache, buffers.conv, buffers.recurrent)

        def get_max_length(self) -> int:
            return self.max_cache_len

    return HybridLayer


def state_layer(cache, buffers: StateBuffers, attention_layer=None):
    """A ``StateLayer`` of ``cache`` (an ``UpdateCacheKV``) over ``buffers``; with keys and values (``buffers.kv``),
    a ``HybridLayer`` that also is an ``attention_layer`` over them."""
    if buffers.kv is None:
        return _state_layer_class()(cache, buffers.conv, buffers.recurrent)
    return _hybrid_layer_class(attention_layer)(cache, buffers)
