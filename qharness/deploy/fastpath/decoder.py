"""``FastDecoder``: the HF model's own forward over ``UpdateCacheKV`` with the fast path's attention function and
rotary tables, and its export (``export_fast``).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.export import Dim

from qharness.deploy.fastpath.attention import ATTENTION, register
from qharness.deploy.fastpath.kv_cache import ACTIVE, cache_argument, kv_shapes, update_cache_kv
from qharness.deploy.fastpath.rope import RopeTable
from qharness.deploy.fastpath.state_cache import (
    StateBuffers,
    StateShapes,
    recurrent_state_reason,
    rule_modules,
    swap_rules,
)
from qharness.deploy.fastpath.transposes import sink_transposes
from qharness.recipes.registry import KV_CACHES


@contextlib.contextmanager
def fast_modules(model, rope_tables: dict[str, torch.nn.Module] | None = None):
    """Inside the block ``model`` (and its sub-models) runs with the ``ATTENTION`` implementation, the recurrent
    rules of ``state_cache.swap_rules`` (the gated delta rule, Mamba2's scan, the causal convolution) where its layers
    run one, and, given ``rope_tables`` (``{module path: table}``, ``FastDecoder``'s), with those rotary modules swapped
    for their tables."""
    before = model.config._attn_implementation
    swapped = []
    model.set_attn_implementation(ATTENTION)
    try:
        for path, table in (rope_tables or {}).items():
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            swapped.append((parent, name, getattr(parent, name)))
            setattr(parent, name, table)
        with swap_rules(model):  # the gated delta rule and Mamba2 scan from the stored state (state_cache.py)
            yield
    finally:
        for parent, name, original in reversed(swapped):
            setattr(parent, name, original)
        model.set_attn_implementation(before)


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
        layout = kv_shapes(model, max_seq_len)
        reason = recurrent_state_reason(type(model).__name__, layout, bool(rule_modules(model)))
        if reason is not None:
            raise NotImplementedError(reason)
        for i, shapes in enumerate(layout):
            if isinstance(shapes, StateShapes):  # a layer that keeps states, and keys and values if hybrid
                kv = None if shapes.kv is None else self._kv_buffers(i, shapes.kv, dtype, int8)
                buffers.append(StateBuffers(*self._state_buffers(i, shapes, dtype), kv))
            else:
                buffers.append(self._kv_buffers(i, shapes, dtype, int8))
        self.cache = update_cache_kv(buffers)
        self.cache_argument = cache_argument(model)
        config = model.config.get_text_config()
        layer_types = sorted(set(getattr(config, "layer_types", None) or ["full_attention"]))
        self.rope_tables = torch.nn.ModuleDict()  # module path (dots as "__") -> RopeTable
        for path, module in model.named_modules():
            if path.rpartition(".")[2] == "rotary_emb":
                self.rope_tables[path.replace(".", "__")] = RopeTable(module, max_seq_len, dtype, layer_types)

    def _kv_buffers(self, i: int, shapes: tuple, dtype, int8: bool) -> tuple:
        """Layer ``i``'s key and value caches, zeros: ``k_cache_{i}`` and ``v_cache_{i}`` (int8: with their per-token
        scales and zero points), as ``(keys, values, qparams or None)``."""
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
        return getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}"), qparams

    def _state_buffers(self, i: int, shapes: StateShapes, dtype) -> tuple[list, list]:
        """Layer ``i``'s state buffers, zeros: ``conv_state_{i}_{j}`` and ``recurrent_state_{i}_{j}`` (float32: the
        gated delta rule's state), ``None`` where it keeps none."""
        out = ([], [])
        for kind, kind_shapes, kind_dtype, into in (
            ("conv", shapes.conv, dtype, out[0]),
            ("recurrent", shapes.recurrent, torch.float32, out[1]),
        ):
            for j, shape in enumerate(kind_shapes):
                if shape is None:
                    into.append(None)
                    continue
                self.register_buffer(f"{kind}_state_{i}_{j}", torch.zeros(shape, dtype=kind_dtype), persistent=False)
                into.append(getattr(self, f"{kind}_state_{i}_{j}"))
        return out

    def swapped(self):
        """``fast_modules`` of this decoder's model: the ``ATTENTION`` implementation and the rotary tables."""
        return fast_modules(self.model, {k.replace("__", "."): v for k, v in self.rope_tables.items()})

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        start = input_pos[0].item()
        torch._check(start >= 0)
        torch._check(start + n <= self.max_seq_len)
        self.cache.start = start
        self.cache.carry = (input_pos > 0).to(torch.float32)  # state layers: continue the stored window, or a new one
        position_ids = (input_pos + torch.arange(n))[None]
        ACTIVE.append(self.cache)
        try:
            with contextlib.nullcontext() if torch.compiler.is_compiling() else self.swapped():
                out = self.model(
                    input_ids=tokens,
                    position_ids=position_ids,
                    **{self.cache_argument: self.cache},
                    use_cache=True,
                    logits_to_keep=0 if self.all_logits else 1,
                )
        finally:
            ACTIVE.pop()
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
        ep = torch.export.export(  # the quant fusion misses; side effects: the cache's start, ACTIVE (by design)
            decoder, example_inputs(max_seq_len), dynamic_shapes=dynamic_shapes(max_seq_len), strict=True
        )
    sink_transposes(ep.graph_module)
    return ep
