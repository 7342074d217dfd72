"""Imports that move between releases of torchao, ExecuTorch and transformers: one function per symbol.

When upstream moves a symbol, the function here is the one place to edit. Imports are done inside the
functions: ``import executorch`` and the quantizers take seconds.

Example::

    pt2e = imports.pt2e()
    prepared = pt2e.prepare_qat_pt2e(graph, quantizer)
"""

from __future__ import annotations

import torch  # noqa: F401


def pt2e():
    """The PT2E entry points as a namespace: prepare_pt2e, prepare_qat_pt2e, convert_pt2e, ..."""
    import types

    from torchao.quantization import pt2e as _pt2e
    from torchao.quantization.pt2e import export_utils, quantize_pt2e

    return types.SimpleNamespace(
        prepare_pt2e=quantize_pt2e.prepare_pt2e,
        prepare_qat_pt2e=quantize_pt2e.prepare_qat_pt2e,
        convert_pt2e=quantize_pt2e.convert_pt2e,
        move_to_train=_pt2e.move_exported_model_to_train,
        move_to_eval=_pt2e.move_exported_model_to_eval,
        TRAINING_ATTR=export_utils._EXPORTED_TRAINING_ATTR,  # the mode the switches above record (private in 0.18)
        FakeQuantize=_pt2e.FakeQuantize,
        FakeQuantizeBase=_pt2e.FakeQuantizeBase,
        LearnableFakeQuantize=_pt2e.LearnableFakeQuantize,
        ObserverBase=_pt2e.ObserverBase,
        MovingAverageMinMaxObserver=_pt2e.MovingAverageMinMaxObserver,
        MinMaxObserver=_pt2e.MinMaxObserver,
        HistogramObserver=_pt2e.HistogramObserver,
        MovingAveragePerChannelMinMaxObserver=_pt2e.MovingAveragePerChannelMinMaxObserver,
        PerChannelMinMaxObserver=_pt2e.PerChannelMinMaxObserver,
    )


def torchao_qat():
    """torchao's source-level QAT as a namespace: QATConfig, the fake-quantized modules and quantizers, and
    ``infer_configs(base_config) -> (activation, weight)``, the fake-quant configs ``QATConfig(base_config)`` derives
    (private ``_infer_fake_quantize_configs`` in 0.18)."""
    import types

    from torchao.quantization import qat
    from torchao.quantization.qat.fake_quantize_config import _infer_fake_quantize_configs

    return types.SimpleNamespace(
        QATConfig=qat.QATConfig,
        FakeQuantizedLinear=qat.FakeQuantizedLinear,
        FakeQuantizerBase=qat.FakeQuantizerBase,
        IntxFakeQuantizer=qat.IntxFakeQuantizer,
        infer_configs=_infer_fake_quantize_configs,
    )


def xnnpack_symmetric_config(**kwargs):
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import get_symmetric_quantization_config

    return get_symmetric_quantization_config(**kwargs)


def vulkan_symmetric_config(**kwargs):
    from executorch.backends.vulkan.quantizer.vulkan_quantizer import get_symmetric_quantization_config

    return get_symmetric_quantization_config(**kwargs)


def xnnpack_partitioner(dynamic_quant: bool):
    """An XNNPACK partitioner. Dynamically quantized graphs need the dynamic-quant partitioner placed
    before the plain one, or lowering fails with "Invalid partition, found dependency cycles"."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackDynamicallyQuantizedPartitioner,
        XnnpackPartitioner,
    )

    return XnnpackDynamicallyQuantizedPartitioner() if dynamic_quant else XnnpackPartitioner()


def to_edge_transform_and_lower(*args, **kwargs):
    import executorch.kernels.quantized  # noqa: F401  out variants of quantized ops (quantized embeddings)
    from executorch.exir import to_edge_transform_and_lower as _lower

    return _lower(*args, **kwargs)


def executorch_backend_config(**kwargs):
    from executorch.exir import ExecutorchBackendConfig

    return ExecutorchBackendConfig(**kwargs)


def quantized_decomposed_ops() -> None:
    """Register ``torch.ops.quantized_decomposed`` (per-token quantize ops of the int8 KV cache): torch still defines
    them in ``torch.ao.quantization.fx._decomposed``; torchao's pt2e imports that module too."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401


def tag_delegate_constant(node, tag: str) -> None:
    """Have a delegate write the constant that ``node`` (a weight, or the dequantize of one) reads to the data file
    ``tag`` instead of the ``.pte``: ExecuTorch 1.5.1's XNNPACK serializer reads ``meta["custom"]
    ["delegate_constant_tag"]`` (``backends/xnnpack/operators/node_visitor.py``; what ``exir.passes.
    external_constants_pass.delegate_external_constants_pass_unlifted`` sets), and the named-data store writes equal
    bytes once (``exir/_serialize/_named_data_store.py``)."""
    node.meta.setdefault("custom", {})["delegate_constant_tag"] = tag
    source = node.args[0] if node.args else None
    if hasattr(source, "meta"):  # the weight itself, where the serializer reads the tag off the placeholder
        source.meta.setdefault("custom", {})["delegate_constant_tag"] = tag


def program_data(program_manager, tag: str) -> bytes | None:
    """The bytes of the data file ``tag`` of an ``ExecutorchProgramManager`` (what ``write_tensor_data_to_file``
    writes as ``<tag>.ptd``), or None when the program keeps everything in the ``.pte``."""
    data = getattr(program_manager, "_tensor_data", None) or {}
    return bytes(data[tag]) if tag in data else None


def executorch_runtime():
    """The ExecuTorch Python runtime, with the quantized kernels (e.g. quantized embeddings) registered."""
    import executorch.kernels.quantized  # noqa: F401  registers quantized_decomposed ops
    from executorch.runtime import Runtime

    from qharness.upstream.fixes.custom_sdpa import llm_custom_ops

    llm_custom_ops()  # llama::update_cache / custom_sdpa kernels of fast-path programs

    return Runtime.get()


def runtime_operator_names() -> set[str]:
    """The kernels this ExecuTorch runtime has registered (``executorch_runtime``'s: portable, quantized, LLM ops),
    e.g. ``quantized_decomposed::embedding_4bit.out``."""
    executorch_runtime()
    from executorch.extension.pybindings import portable_lib

    return set(portable_lib._get_operator_names())


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


def gguf_dequantized():
    """transformers' GGUF load setting for a plain float model: every weight dequantized at load (5.x otherwise keeps
    the blocks of architectures its newer GGUF loader handles packed in ``GgufLinear`` modules, where a kernel
    exists)."""
    from transformers.utils.quantization_config import GgufConfig

    return GgufConfig(dequantize=True)


def executorch_profiled_program(path: str, data_path: str | None = None):
    """A ``.pte`` (and its data file ``data_path``, when it has one) loaded with ExecuTorch's event tracer on:
    ``forward((tokens, start))`` then ``write_etdump_result_to_file(path)``. Private pybindings in 1.5.1
    (``_load_for_executorch(data_path=, enable_etdump=True)``; ``executorch.runtime`` has no ETDump switch)."""
    import executorch.kernels.quantized  # noqa: F401  registers quantized_decomposed ops
    from executorch.extension.pybindings import portable_lib

    from qharness.upstream.fixes.custom_sdpa import llm_custom_ops

    llm_custom_ops()
    return portable_lib._load_for_executorch(str(path), data_path, enable_etdump=True, debug_buffer_size=0)


def etdump_inspector(etdump_path: str):
    """ExecuTorch's devtools ``Inspector`` over an ETDump file (no ETRecord: event names, not source nodes)."""
    import warnings

    from executorch.devtools import Inspector

    with warnings.catch_warnings():  # no debug buffer was asked for: it warns that none was found
        warnings.filterwarnings("ignore", message="Output Buffer not found")
        return Inspector(etdump_path=str(etdump_path))


def executorch_threadpool():
    """ExecuTorch's CPU threadpool (XNNPACK runs on it) as ``get_thread_count()`` / ``reset(n)``: private pybindings
    functions in 1.5.1 (``_threadpool_get_thread_count``, ``_unsafe_reset_threadpool``)."""
    import types

    from executorch.extension.pybindings import portable_lib

    return types.SimpleNamespace(
        get_thread_count=portable_lib._threadpool_get_thread_count, reset=portable_lib._unsafe_reset_threadpool
    )


def pte_program(path):
    """A ``.pte``'s program table (ExecuTorch's ``schema.Program``: execution plans, their values and operators),
    read from its flatbuffer alone: the constant and delegate segments after it stay on disk. Private
    ``executorch.exir._serialize`` in 1.5.1 (importing it takes seconds)."""
    from executorch.exir._serialize._flatbuffer_program import _flatbuffer_to_program
    from executorch.exir._serialize._program import _ExtendedHeader, _get_extended_header

    with open(path, "rb") as f:
        head = f.read(_ExtendedHeader.NUM_HEAD_BYTES)
        eh = _get_extended_header(head)  # absent: no segments, the whole file is the flatbuffer
        f.seek(0)
        return _flatbuffer_to_program(f.read(eh.program_size) if eh else f.read())


def pte_external_constants(path) -> list[str]:
    """The names of the constants the program at ``path`` reads from a data file (``.ptd``) instead of itself
    (``schema.TensorDataLocation.EXTERNAL`` in 1.5.1)."""
    from executorch.exir.schema import Tensor, TensorDataLocation

    names = []
    for plan in pte_program(path).execution_plan:
        for value in plan.values:
            t = value.val
            info = getattr(t, "extra_tensor_info", None) if isinstance(t, Tensor) else None
            if info is not None and info.location == TensorDataLocation.EXTERNAL and t.allocation_info is None:
                names.append(info.fully_qualified_name)
    return names


def pte_constant_bytes(tensor) -> int | None:
    """Bytes of a ``schema.Tensor`` of :func:`pte_program`'s values if it is a constant stored in the program
    (weights, scales, zero points), else None (a tensor the program allocates, or another value).
    ``executorch.exir.schema`` / ``executorch.exir.tensor`` in 1.5.1."""
    from executorch.exir.schema import Tensor
    from executorch.exir.tensor import get_scalar_type, num_bytes_from_shape_and_dtype

    if not isinstance(tensor, Tensor) or tensor.allocation_info is not None or tensor.data_buffer_idx <= 0:
        return None
    return num_bytes_from_shape_and_dtype(tensor.sizes, get_scalar_type(tensor.scalar_type))
