"""The fast path's recurrent-state cache layers: what a layer keeps instead of keys and values (LFM2's short gated
convolutions; the gated DeltaNet of Qwen3.5 / Qwen3-Next: a convolution window and a recurrent state), as mutable
buffers of the program beside the KV caches.

transformers' own ``LinearAttentionLayer`` decides prefill or decode in Python (``has_previous_state``) and
allocates its state on first use; a program exported once must do both through one graph. ``StateLayer`` keeps each
state in a buffer registered on ``FastDecoder`` and answers every call in the prefill form the model's code already
has (``get_conv_state`` / ``get_recurrent_state`` return ``None``): ``update_conv_state`` hands back the stored window
followed by the new inputs and keeps the last ``kernel`` of them in place; the gated delta rule (swapped into the
model's module for the export, ``gated_delta_rule``) starts from the stored recurrent state, which
``update_recurrent_state`` then overwrites. A call at ``input_pos`` 0 starts a new sequence: the stored states count
as zeros (what the model's own prefill starts from), so a runner needs no reset. A later chunk or a decode step
continues from them, as a KV cache continues from its positions.

Other recurrent states (Mamba2's selective scan: Falcon-H1, Granite-4.0-H, Bamba, Jamba) are not held:
``recurrent_state_reason`` says so before any work, and ``update_recurrent_state`` refuses a state no route reads.

Example::

    layer = StateLayer(cache, conv=[torch.zeros(1, 64, 3)], recurrent=[None])  # cache.carry: 1.0 after position 0
    window = layer.update_conv_state(x)                                        # x [1, 64, n] -> [1, 64, 3 + n]
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class StateShapes:
    """A recurrent layer's state buffers, one shape per state index: ``conv`` (``[1, channels, kernel]``) and
    ``recurrent`` (any shape); ``None`` where the layer keeps no such state."""

    conv: tuple[tuple[int, ...] | None, ...]
    recurrent: tuple[tuple[int, ...] | None, ...]


def state_shapes(layer) -> StateShapes:
    """The shapes of a transformers ``LinearAttentionCacheLayerMixin`` layer after a one-token forward."""
    n = layer.number_of_states
    conv = tuple(tuple(layer.conv_states[i].shape) if layer.is_conv_states_initialized[i] else None for i in range(n))
    recurrent = tuple(
        tuple(layer.recurrent_states[i].shape) if layer.is_recurrent_states_initialized[i] else None for i in range(n)
    )
    return StateShapes(conv, recurrent)


CURRENT: list = []  # the state layer whose convolution state was updated last: the one the gated delta rule continues
GATED_DELTA = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")  # transformers' module functions


def gated_delta_modules(model) -> list:
    """The transformers modeling modules of ``model`` whose layers call the gated delta rule through module functions
    (``GATED_DELTA``: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, ...), which ``swap_gated_delta`` replaces for the export."""
    import sys

    found = {}
    for m in model.modules():
        module = sys.modules.get(type(m).__module__)
        if module is not None and all(hasattr(module, name) for name in GATED_DELTA):
            found[module.__name__] = module
    return list(found.values())


def recurrent_state_reason(arch: str, shapes: list, gated_delta: bool = False) -> str | None:
    """Why the fast path cannot hold these layers' states (``None``: it can): a recurrent (SSM / linear-attention)
    state that no route carries from call to call (``gated_delta``: the model's layers run the gated delta rule, which
    ``gated_delta_rule`` carries)."""
    for i, layer in enumerate(shapes):
        if isinstance(layer, StateShapes) and any(s is not None for s in layer.recurrent) and not gated_delta:
            return (
                f"{arch}: layer {i} keeps a recurrent (SSM) state; the fast path carries convolution states (LFM2) and "
                "the gated delta rule's state (Qwen3.5, Qwen3-Next), not a selective scan's"
            )
    return None


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
        layer = CURRENT[-1] if CURRENT else None
        state = None if layer is None else layer.recurrent_states[0]
        if state is None:
            state = torch.zeros(*value.shape[:2], key.shape[-1], value.shape[-1])
        else:
            state = state.to(torch.float32) * layer.cache.carry
        initial_state = state
    out, final = torch.ops.llama.gated_delta_rule.default(
        query, key, value, g.exp(), beta, initial_state.to(torch.float32)
    )
    return out.transpose(1, 2).contiguous().to(dtype), (final if output_final_state else None)


@contextlib.contextmanager
def swap_gated_delta(model):
    """Inside the block the modules ``gated_delta_modules(model)`` call ``gated_delta_rule`` for both of their
    gated delta rule functions."""
    saved = []
    try:
        for module in gated_delta_modules(model):
            for name in GATED_DELTA:
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, gated_delta_rule)
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


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


def state_layer(cache, conv: list[torch.Tensor | None], recurrent: list[torch.Tensor | None]):
    """A ``StateLayer`` of ``cache`` (an ``UpdateCacheKV``) over the buffers ``conv`` and ``recurrent``."""
    return _state_layer_class()(cache, conv, recurrent)
