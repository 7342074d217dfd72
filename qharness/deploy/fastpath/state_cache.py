"""The fast path's recurrent-state cache layer: the convolution window of a layer that keeps a state instead of keys
and values (LFM2's short gated convolutions), as mutable buffers of the program beside the KV caches.

transformers' own ``LinearAttentionLayer`` decides prefill or decode in Python (``has_previous_state``) and
allocates its state on first use; a program exported once must do both through one graph. ``StateLayer`` keeps each
state in a ``[1, channels, kernel]`` buffer registered on ``FastDecoder`` and answers every call in the prefill form
the model's code already has (``get_conv_state`` returns ``None``): ``update_conv_state`` hands back the stored window
followed by the new inputs, and keeps the last ``kernel`` of them in place. A call at ``input_pos`` 0 starts a new
sequence: the stored window counts as zeros (what the model's own prefill pads with), so a runner needs no reset.
A later chunk or a decode step continues from the stored window, as a KV cache continues from its positions.

SSM and linear-attention *recurrent* states (Mamba2, gated DeltaNet) are not held here: those families' prefill
code starts from a zero state, so a chunk after the first would forget the past. ``recurrent_state_reason`` says so
before any work, and ``update_recurrent_state`` refuses instead of computing something else.

Example::

    layer = StateLayer(cache, conv=[torch.zeros(1, 64, 3)])   # cache.carry: 1.0 after position 0, else 0.0
    window = layer.update_conv_state(x)                         # x [1, 64, n] -> [1, 64, 3 + n]
"""

from __future__ import annotations

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


def recurrent_state_reason(arch: str, shapes: list) -> str | None:
    """Why the fast path cannot hold these layers' states (``None``: it can): a recurrent (SSM / linear-attention)
    state, which the families' prefill code would not continue from."""
    for i, layer in enumerate(shapes):
        if isinstance(layer, StateShapes) and any(s is not None for s in layer.recurrent):
            return (
                f"{arch}: layer {i} keeps a recurrent (SSM / linear-attention) state; the fast path holds "
                "convolution states (LFM2's short convolutions) but not a recurrent state a chunked prefill continues from"
            )
    return None


def _state_layer_class():
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    class StateLayer(LinearAttentionCacheLayerMixin):
        """One recurrent layer's convolution states over registered buffers (``conv``: one ``[1, C, K]`` buffer or
        ``None`` per state index), read and written in the prefill form; ``cache.carry`` (a tensor, 1.0 when the
        call continues a sequence, 0.0 at position 0) decides whether the stored window is the past or zeros."""

        is_sliding = False

        def __init__(self, cache, conv: list[torch.Tensor | None]):
            super().__init__(number_of_states=len(conv))
            self.cache = cache
            for i, buffer in enumerate(conv):
                if buffer is not None:
                    self.conv_states[i] = buffer
                    self.conv_kernel_size[i] = buffer.shape[-1]
                    self.is_conv_states_initialized[i] = True
                    self.dtype, self.device = buffer.dtype, buffer.device
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
            full = torch.cat([state * self.cache.carry.to(state.dtype), conv_states.to(state.dtype)], dim=-1)
            state.copy_(full[..., -state.shape[-1] :])
            return full

        def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs):
            raise NotImplementedError(
                "a recurrent (SSM / linear-attention) state: the fast path holds convolution states only"
            )

        def reset(self) -> None:
            for i in range(self.number_of_states):
                if self.conv_states[i] is not None:
                    self.conv_states[i].zero_()

    return StateLayer


def state_layer(cache, conv: list[torch.Tensor | None]):
    """A ``StateLayer`` of ``cache`` (an ``UpdateCacheKV``) over the buffers ``conv``."""
    return _state_layer_class()(cache, conv)
