"""Every import that moves between releases of torchao / ExecuTorch / transformers lives here.

When upstream moves a symbol, this is the one file to edit. Each workaround names the upstream
issue it works around and has a test (tests/test_compat.py) that fails once upstream changes.

Imports are done inside functions: ``import executorch`` and the quantizers take seconds.
"""

from __future__ import annotations

import torch


# --- PT2E (torchao.quantization.pt2e; torch.ao.quantization was the old home) -------------------
def pt2e():
    """The PT2E entry points as a namespace: prepare_pt2e, prepare_qat_pt2e, convert_pt2e, ..."""
    import types

    from torchao.quantization import pt2e as _pt2e
    from torchao.quantization.pt2e import quantize_pt2e

    return types.SimpleNamespace(
        prepare_pt2e=quantize_pt2e.prepare_pt2e,
        prepare_qat_pt2e=quantize_pt2e.prepare_qat_pt2e,
        convert_pt2e=quantize_pt2e.convert_pt2e,
        move_to_train=_pt2e.move_exported_model_to_train,
        move_to_eval=_pt2e.move_exported_model_to_eval,
        allow_train_eval=_pt2e.allow_exported_model_train_eval,
        FakeQuantize=_pt2e.FakeQuantize,
        FakeQuantizeBase=_pt2e.FakeQuantizeBase,
        MovingAverageMinMaxObserver=_pt2e.MovingAverageMinMaxObserver,
        MinMaxObserver=_pt2e.MinMaxObserver,
        HistogramObserver=_pt2e.HistogramObserver,
        MovingAveragePerChannelMinMaxObserver=_pt2e.MovingAveragePerChannelMinMaxObserver,
    )


# --- XNNPACK quantizer ----------------------------------------------------------------------------
def _lift_scalars_keeping_dtype(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Lift scalar operands of aten.add/mul into buffers of the node's own dtype.

    ExecuTorch 1.5.1's ``_convert_scalars_to_attrs`` lifts them as float32, which turns HF Llama's
    int64 ``arange(n) + 0`` into a float index ("tensors used as indices must be long ...").
    Upstream: pytorch/executorch issue #22062, fixed by PR #22065 (after 1.5.1).
    """
    from torchao.quantization.pt2e.utils import get_new_attr_name_with_prefix

    for node in model.graph.nodes:
        if node.op != "call_function" or node.target not in (torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor):
            continue
        new_args = []
        for arg in node.args:
            if isinstance(arg, torch.fx.Node):
                new_args.append(arg)
                continue
            name = get_new_attr_name_with_prefix("_tensor_constant_")(model)
            value = torch.tensor(arg, dtype=node.meta["val"].dtype)
            model.register_buffer(name, value)
            with model.graph.inserting_before(node):
                get_attr = model.graph.create_node("get_attr", name, (), {})
                get_attr.meta["val"] = node.meta["val"].fake_mode.from_tensor(value, static_shapes=True)
            new_args.append(get_attr)
        node.args = tuple(new_args)
    model.recompile()
    return model


def xnnpack_quantizer_cls():
    """``XNNPACKQuantizer`` with the scalar-lifting fix applied (see ``_lift_scalars_keeping_dtype``)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer

    class FixedXNNPACKQuantizer(XNNPACKQuantizer):
        def transform_for_annotation(self, model):
            return _lift_scalars_keeping_dtype(model)

    return FixedXNNPACKQuantizer


def vulkan_quantizer_cls():
    """``VulkanQuantizer`` that leaves scalar operands in place.

    Upstream's ``transform_for_annotation`` lifts every add/mul scalar into a buffer (same code as the
    XNNPACK bug above); the Vulkan backend's RMSNorm fusion then reads ``eps`` from a fake tensor and
    fails ("Could not guard on data-dependent expression", vulkan/patterns/rms_norm.py). Weight-only
    recipes annotate no add/mul, so nothing needs lifting.
    """
    from executorch.backends.vulkan.quantizer.vulkan_quantizer import VulkanQuantizer

    class NoLiftVulkanQuantizer(VulkanQuantizer):
        def transform_for_annotation(self, model):
            return model

    return NoLiftVulkanQuantizer


def vulkan_partitioner():
    """``VulkanPartitioner`` that leaves buffer writes whose value only feeds the program output (HF's
    static-cache ``cumulative_length`` counters) outside the delegate: upstream tags them into a
    partition and serialization then fails ("Buffer output getitem does not point to a buffer")."""
    from executorch.backends.vulkan.partitioner.vulkan_partitioner import VulkanPartitioner

    class BufferSafeVulkanPartitioner(VulkanPartitioner):
        def partition(self, exported_program):
            result = super().partition(exported_program)
            sig = exported_program.graph_signature
            buffer_of_input = {v: k for k, v in sig.inputs_to_buffers.items()}
            untag = set()
            for node in exported_program.graph.nodes:
                buffer = sig.buffers_to_mutate.get(node.name)
                if buffer and all(u.op == "output" for u in node.users) and "delegation_tag" in node.meta:
                    node.meta.pop("delegation_tag")
                    untag.add(buffer_of_input.get(buffer))
            for node in exported_program.graph.nodes:
                if node.op == "placeholder" and node.name in untag:
                    node.meta.pop("delegation_tag", None)
            return result

    return BufferSafeVulkanPartitioner()


def xnnpack_symmetric_config(**kwargs):
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import get_symmetric_quantization_config

    return get_symmetric_quantization_config(**kwargs)


def upstream_xnnpack_scalar_lifting():
    """The unpatched upstream function, for the test that tells when the workaround can go."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer_utils import _convert_scalars_to_attrs

    return _convert_scalars_to_attrs


# --- Partitioners ---------------------------------------------------------------------------------
def xnnpack_partitioner(dynamic_quant: bool):
    """An XNNPACK partitioner. Dynamically quantized graphs need the dynamic-quant partitioner placed
    before the plain one, or lowering fails with "Invalid partition, found dependency cycles"."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackDynamicallyQuantizedPartitioner,
        XnnpackPartitioner,
    )

    return XnnpackDynamicallyQuantizedPartitioner() if dynamic_quant else XnnpackPartitioner()


# --- ExecuTorch lowering and runtime --------------------------------------------------------------
def to_edge_transform_and_lower(*args, **kwargs):
    import executorch.kernels.quantized  # noqa: F401  out variants of quantized ops (quantized embeddings)
    from executorch.exir import to_edge_transform_and_lower as _lower

    return _lower(*args, **kwargs)


def executorch_backend_config(**kwargs):
    from executorch.exir import ExecutorchBackendConfig

    return ExecutorchBackendConfig(**kwargs)


def executorch_runtime():
    """The ExecuTorch Python runtime, with the quantized kernels (e.g. quantized embeddings) registered."""
    import executorch.kernels.quantized  # noqa: F401  registers quantized_decomposed ops
    from executorch.runtime import Runtime

    llm_custom_ops()  # llama::update_cache / custom_sdpa kernels of fast-path programs

    return Runtime.get()


# --- transformers ---------------------------------------------------------------------------------
def hf_static_cache_exportable(model, batch_size: int, max_cache_len: int):
    """HF's static-KV-cache wrapper whose forward is ``(input_ids, cache_position) -> logits``."""
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config = GenerationConfig(
        use_cache=True,
        cache_implementation="static",
        cache_config={"batch_size": batch_size, "max_cache_len": max_cache_len},
    )
    return TorchExportableModuleForDecoderOnlyLM(model, batch_size=batch_size, max_cache_len=max_cache_len).model


# --- ExecuTorch LLM custom ops ------------------------------------------------------------------
_CPU_SDPA_LIB = None


def llm_custom_ops() -> None:
    """Register ``llama::update_cache`` / ``llama::custom_sdpa`` (eager kernels, export meta functions and,
    in the Python runtime, their ExecuTorch kernels), with ``custom_sdpa``'s eager CPU kernel replaced.

    Workaround: ExecuTorch 1.5.1's eager (AOT) ``custom_sdpa`` runs its kernel with a context that has no
    temp allocator and logs ``No temp allocator provided`` to stderr on every call (every layer of every
    calibration or scoring step). ``_custom_sdpa_cpu`` computes the same attention with PyTorch's SDPA
    for CPU tensors; export (Meta kernel) and the ``.pte`` (ExecuTorch's kernel) are unaffected.
    Test: tests/test_compat.py (fails once upstream stops logging).
    """
    global _CPU_SDPA_LIB
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401

    if _CPU_SDPA_LIB is None:
        _CPU_SDPA_LIB = torch.library.Library("llama", "IMPL")
        _CPU_SDPA_LIB.impl("custom_sdpa", _custom_sdpa_cpu, "CPU")


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


def upstream_custom_sdpa(*args):
    """ExecuTorch's own eager ``custom_sdpa`` kernel (bypassing ``_custom_sdpa_cpu``), for the workaround's test."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return torch.ops.llama.custom_sdpa.default.redispatch(keys, *args)
