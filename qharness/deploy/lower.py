"""Deployment stages: static-KV-cache export -> quantize (convert_pt2e) -> lower -> ``.pte``.

The ``.pte``'s ``forward(tokens[1, n], input_pos[1]) -> logits`` takes ``n`` new tokens starting at
cache position ``input_pos`` (prefill: many tokens at 0; decode: one token at a time). That is the
signature ExecuTorch's LLM runner calls (``TextDecoderRunner::step`` passes a one-element ``input_pos``
when the method's second input has one element), and ``runner_metadata`` gives the constant methods it reads.

Two exports: the fast path (``qharness.deploy.fastpath``: the model's own forward with ExecuTorch's
``custom_sdpa`` / ``update_cache`` ops plugged in as its attention and cache, ``logits[1, 1, vocab]`` of the last
token) for every model that takes it, else the generic HF static cache (``logits[1, n, vocab]``), with a logged
reason. ``deployed.export_path(graph)`` says which one (``deployed.DeployRecord``: what the graph records).

Example::

    deployed = quantize_for_deploy(model, recipe, max_seq_len=256, calibrate=lambda g: g(tokens, torch.tensor([0])))
    meta = runner_metadata(max_seq_len=256, vocab_size=2048, bos_id=0, eos_ids=[0])
    pte_bytes = lower_to_pte(deployed, recipe, max_seq_len=256, metadata=meta)
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qharness.deploy.deployed import DeployRecord, export_path, stamp
from qharness.deploy.fastpath import decoder as fast_decoder
from qharness.deploy.fastpath import support as fast_support
from qharness.deploy.fastpath.decoder import dynamic_shapes as _dynamic_shapes
from qharness.deploy.fastpath.decoder import example_inputs as _example
from qharness.progress import bar, stage
from qharness.upstream import imports, lowering

log = logging.getLogger(__name__)


class TokensAndPos(torch.nn.Module):
    """``forward(tokens, input_pos) -> logits`` over a static-cache model taking keyword arguments."""

    def __init__(self, cache_model):
        super().__init__()
        self.cache_model = cache_model

    def forward(self, tokens, input_pos):
        return self.cache_model(input_ids=tokens, cache_position=input_pos)


def export_static_cache(model, max_seq_len: int) -> torch.export.ExportedProgram:
    """Export ``(tokens, input_pos) -> logits`` with a static KV cache of ``max_seq_len`` positions."""
    wrapper = TokensAndPos(imports.hf_static_cache_exportable(model, batch_size=1, max_cache_len=max_seq_len))
    with torch.no_grad():  # with grad on, torchao weight subclasses export as parametrizations the quant fusion misses
        return torch.export.export(
            wrapper, _example(max_seq_len), dynamic_shapes=_dynamic_shapes(max_seq_len), strict=True
        )


_CHECK = object()  # export_deploy's default: run the fast path's support check on the model as given


def export_deploy(
    model, max_seq_len: int, kv_cache: str = "fp32", reason=_CHECK
) -> tuple[torch.export.ExportedProgram, str | None]:
    """The fast export when ``fastpath`` takes the model (``unsupported_reason`` is None and its export
    succeeds), else the HF static cache; returns ``(exported program, reason for the fallback or None)``.
    ``kv_cache`` (``fp32`` or ``int8``) is the fast path's; the generic export keeps HF's float cache. ``reason``: the
    support check's answer when it already ran (on the FP weights of a model quantized since)."""
    if reason is _CHECK:
        reason = fast_support.unsupported_reason(model, max_seq_len)
    if reason is None:
        try:
            return fast_decoder.export_fast(model, max_seq_len, kv_cache=kv_cache), None
        except Exception as e:  # e.g. torch.export cannot trace the model's forward with the fast path's cache
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
            reason = f"{type(model).__name__}: torch.export of the fast path failed ({type(e).__name__}: {first})"
    log.warning(
        "fast export path not used, falling back to the generic HF static-cache export (slower decode): %s", reason
    )
    if kv_cache != "fp32":
        log.warning("the recipe's %s KV cache needs the fast path; this program keeps a float KV cache", kv_cache)
    try:
        return export_static_cache(model, max_seq_len), reason
    except Exception as e:  # neither export: say why for both
        raise RuntimeError(
            f"fast path: {reason}; generic HF static-cache export: {_static_cache_failure(model, e)}"
        ) from e


def _static_cache_failure(model, error: Exception) -> str:
    """Why the generic export failed: keys and values of different widths (MLA caches its latent and its rotary key)
    that transformers' ``StaticCache`` (one ``head_dim`` for both) cannot hold, else the error's first line."""
    from qharness.deploy.fastpath.kv_cache import kv_shapes

    try:
        shapes = kv_shapes(model, 8)
    except Exception:
        shapes = []
    for i, layer in enumerate(shapes):
        if not isinstance(layer, tuple):  # a state layer (state_cache.StateShapes): no keys and values
            continue
        keys, values = layer
        if keys[2:] != values[2:]:
            return (
                f"layer {i} caches keys of {keys[2]} x {keys[3]} and values of {values[2]} x {values[3]} (heads x width)"
                "; transformers' StaticCache holds both with one head count and head_dim"
            )
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"


def quantize_for_deploy(
    model,
    recipe,
    max_seq_len: int,
    calibrate: Callable[[torch.fx.GraphModule], None],
    weight_qparams: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.fx.GraphModule:
    """The deployable graph ``(tokens, input_pos) -> logits`` of an FP HF model, quantized by the recipe.

    PT2E recipes: cache export (``export_deploy``), ``prepare_pt2e`` with the recipe's (non-QAT)
    quantizer, ``calibrate(prepared)`` (runs data through the observers), ``convert_pt2e``. With
    ``weight_qparams`` (trained scales keyed by ``model``'s parameter names, ``recipes/learned_scales.py``) every
    weight is quantized with its trained scale instead of min-max of its values. Source-level recipes: torchao
    ``quantize_`` on the model (in place; ``weight_qparams`` through torchao's range-learning convert,
    ``SourceQuantizer.convert``), then the cache export. Then the graph's coverage is measured (``coverage.py``,
    ``graph_coverage``): a projection the recipe meant to quantize and left float is a ``UserError``.
    """
    from qharness.deploy import coverage

    linears = coverage.inventory(model)  # before torchao's quantize_ replaces the weights
    graph, reason, layers, quantizer = _quantize_for_deploy(model, recipe, max_seq_len, calibrate, weight_qparams)
    if _lowers_to_xnnpack(recipe):  # its tanh GELU is erf GELU: the formula instead
        from qharness.upstream.fixes import xnnpack_gelu_tanh

        xnnpack_gelu_tanh.decompose_tanh_gelu(graph)
    measured = coverage.measure(graph, linears, recipe, quantizer, layers)
    stamp(
        graph,
        DeployRecord(
            export_path="generic" if reason else "fast",
            fallback_reason=reason,
            kv_cache="fp32" if reason else recipe.kv_cache,
            layers=layers,
            coverage=measured,
        ),
    )
    coverage.check(measured, recipe.name, type(model).__name__)  # no float projection the recipe meant to quantize
    coverage.check_embeddings(measured, recipe, model)  # nor a float table it meant to quantize
    return graph


def _lowers_to_xnnpack(recipe) -> bool:
    """Whether one of ``recipe``'s partitioners is XNNPACK's (the graph then gets XNNPACK's fixes and rewrites)."""
    return any(p.startswith("xnnpack") for p in recipe.partitioners)


def _quantize_for_deploy(model, recipe, max_seq_len, calibrate, weight_qparams):
    model.requires_grad_(False)  # deployment: no leaf may require grad (to_executorch mutates buffers in place)
    for m in model.modules():  # padding_idx only masks gradients; exported as aten.embedding(w, idx, 0) it
        if isinstance(m, torch.nn.Embedding):  # defeats ExecuTorch's quantized-embedding fusion pattern
            m.padding_idx = None
    if recipe.kind == "source" and _lowers_to_xnnpack(recipe):
        from qharness.upstream.fixes import xnnpack_zero_rows

        nudged = xnnpack_zero_rows.nudge_zero_rows(model)  # XNNPACK computes a wide all-zero row as ~1e-5: see there
        if nudged:
            log.info(
                "all-zero embedding rows (%s) hold +-2**-40 in the program: XNNPACK's 4-bit matmuls compute an "
                "all-zero row as ~1e-5 (upstream/fixes/xnnpack_zero_rows.py)",
                "; ".join(
                    f"{name}: token ids {ids[:8]}{' ...' if len(ids) > 8 else ''}" for name, ids in nudged.items()
                ),
            )
    quantizer = recipe.make_quantizer(is_qat=False)
    if weight_qparams is not None and recipe.kind not in ("pt2e", "source"):
        raise ValueError(f"learned weight scales need a quantized recipe ({recipe.name} is {recipe.kind})")
    # The support check compares the fast path's logits with the model's own, so it runs on the FP weights, before any
    # quantization: after torchao's quantize_, one int8 activation rounded the other way moves the logits past its
    # float tolerance (0.13 on a 30-layer 135M model), and a model the fast path takes would fall back to the slow export.
    reason = fast_support.unsupported_reason(model, max_seq_len)
    layers = None
    if recipe.kind == "source":
        from qharness.upstream.fixes import torchao_metadata

        torchao_metadata.register()  # a quantized weight's .to(dtype) exports (DeepSeek-V3's router)
        layers = quantizer.convert(model, weight_qparams)
        log.info("quantized layers: %s", layer_counts(layers))
    elif recipe.kind == "pt2e" and recipe.embedding is not None:  # tables at source level, linears by PT2E below
        from qharness.recipes import embedding

        embedding.quantizer(recipe.embedding).convert(model)  # coverage reads the tables from the graph
    ep, reason = export_deploy(model, max_seq_len, recipe.kv_cache, reason)
    graph = ep.module()
    if recipe.kind != "pt2e":
        return graph, reason, layers, quantizer
    from qharness.upstream.fixes import torchao_fold

    pt2e = imports.pt2e()
    prepared = pt2e.prepare_pt2e(graph, quantizer)
    if weight_qparams is not None:
        from qharness.recipes.learned_scales import use_learned_qparams

        use_learned_qparams(prepared, model, weight_qparams)
    calibrate(prepared)
    converted = pt2e.convert_pt2e(prepared)
    torchao_fold.fold_weight_quantization(converted)  # kv_b_proj of MLA: see that module
    if recipe.quantizer == "xnnpack":  # its kernels quantize dynamic activations per token: so does the graph
        from qharness.upstream.fixes import xnnpack_per_token

        xnnpack_per_token.per_token(converted)
    return converted, reason, layers, quantizer


def layer_counts(layers: dict[str, str] | None) -> dict[str, int] | None:
    """How many layers got each scheme, e.g. ``{"8da4w-g32": 12, "fp": 1}``."""
    return None if layers is None else dict(sorted(Counter(layers.values()).items()))


def runner_metadata(
    max_seq_len: int, vocab_size: int, bos_id: int | None, eos_ids: list[int], use_sdpa_with_kv_cache: bool = False
) -> dict:
    """Constant methods for ExecuTorch's LLM runner (``extension/llm/runner/llm_runner_helper.cpp``).

    The runner requires ``get_max_seq_len`` (its prefill chunk size) and reads ``get_max_context_len``
    (KV-cache positions), ``use_kv_cache``, ``enable_dynamic_shape`` (prefill in one call, not token
    by token), ``use_sdpa_with_kv_cache`` and ``get_eos_ids``. It takes BOS and vocab size from the
    tokenizer; ``get_bos_id`` / ``get_vocab_size`` are for other readers. Both lengths are the cache
    size: with ``get_max_seq_len`` below ``get_max_context_len`` the runner assumes a sliding-window
    cache and no longer bounds generation by the cache position. ``use_sdpa_with_kv_cache``: the
    program attends with ExecuTorch's custom SDPA over its KV cache (the fast path; ``lower_to_pte``
    sets it from the graph it lowers).
    """
    meta = {
        "get_max_seq_len": max_seq_len,
        "get_max_context_len": max_seq_len,
        "get_vocab_size": vocab_size,
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": use_sdpa_with_kv_cache,
        "enable_dynamic_shape": True,
    }
    if bos_id is not None:
        meta["get_bos_id"] = bos_id
    if eos_ids:
        meta["get_eos_ids"] = sorted(set(eos_ids))
    return meta


def lower_to_pte(graph: torch.fx.GraphModule, recipe, max_seq_len: int, metadata: dict | None = None) -> bytes:
    """Re-export, decompose to core ATen, lower with the recipe's partitioners, serialize: one self-contained ``.pte``
    (``lower_program``'s bytes; a tied table is not shared with a data file here).

    ``metadata`` becomes constant methods of the program (``runner_metadata``); its
    ``use_sdpa_with_kv_cache`` is set to whether ``graph`` is a fast-path graph.
    """
    return lower_program(graph, recipe, max_seq_len, metadata).pte


@dataclass(frozen=True)
class Program:
    """A lowered program: the ``.pte`` bytes, the bytes of its data file (``<name>.ptd``: a tied table stored once,
    ``deploy/shared_table.py``; None: the ``.pte`` holds everything) and its structure digest
    (``structure.structure_digest`` of the lowered edge program: equal for programs that differ only in weight
    values)."""

    pte: bytes
    data: bytes | None
    structure: str


def lower_program(
    graph: torch.fx.GraphModule,
    recipe,
    max_seq_len: int,
    metadata: dict | None = None,
    share_tables: bool = False,
) -> Program:
    """``lower_to_pte``'s program, with its structure digest; with ``share_tables`` a tied table whose lookup and
    ``lm_head`` hold the same int8 values is stored once, in the program's data file (``Program.data``)."""
    from qharness.deploy import shared_table
    from qharness.deploy.structure import structure_digest

    if metadata is not None and "use_sdpa_with_kv_cache" in metadata:
        metadata = {**metadata, "use_sdpa_with_kv_cache": export_path(graph) == "fast"}
    for p in graph.parameters():  # to_executorch fails on in-place ops over leaves that require grad
        p.requires_grad_(False)
    if _lowers_to_xnnpack(recipe):
        from qharness.deploy.whole_layers import keep_layers_whole

        keep_layers_whole(graph)  # RMSNorm's mean and rotate_half in ops XNNPACK takes (same function)
    partitioners = recipe.make_partitioners()
    phases = LoweringProgress()
    with (
        lowering.fast_lowering(),  # the same program without upstream's redundant work (see qharness/upstream/lowering)
        lowering.delegation_progress(phases.bar),
    ):
        with phases.stage("export"):
            ep = lowering.export_for_lowering(graph, _example(max_seq_len), _dynamic_shapes(max_seq_len))
        with phases.stage("decompositions"):
            ep = lowering.decompose_for_lowering(ep, partitioners)
        shared = shared_table.tag_shared_tables(ep) if share_tables else set()
        with phases.stage("Edge dialect, partitioning, delegation"):
            edge = imports.to_edge_transform_and_lower(ep, partitioner=partitioners, constant_methods=metadata)
        digest = structure_digest(edge)  # before to_executorch's passes rewrite the graph
        fields = executorch_config(recipe)
        if shared:
            fields["external_constants"] = shared_table.external_tag_fn(shared)
        config = imports.executorch_backend_config(**fields)
        with phases.stage(f"to_executorch ({delegated_partitions(edge)} delegated parts): memory planning, emitting"):
            manager = edge.to_executorch(config)
            data = imports.program_data(manager, shared_table.DATA_TAG) if shared else None
            return Program(manager.buffer, data, digest)


class LoweringProgress:
    """Lowering's phase lines and per-backend bars (``progress.stage``, ``progress.bar``), silent until the lowering
    has run ``QUIET_S`` (a tiny model lowers in seconds): a phase running then says so at once, a later one at its
    start."""

    QUIET_S = 10.0

    def __init__(self):
        self.quiet_until = time.perf_counter() + self.QUIET_S

    def quiet_for(self) -> float:
        return max(0.0, self.quiet_until - time.perf_counter())

    def stage(self, phase: str):
        return stage(f"lowering: {phase}", quiet_below=self.quiet_for())

    def bar(self, backend: str, partitions: int):
        """A backend's preprocess of its delegated partitions (``lowering.delegation_progress``)."""
        return bar(None, f"lowering: {backend} preprocess", total=partitions, unit="partition", delay=self.quiet_for())


def delegated_partitions(edge) -> int:
    """How many delegated (lowered) parts an ``EdgeProgramManager``'s methods call."""
    count = 0
    for name in edge.methods:
        gm = edge.exported_program(name).graph_module
        count += sum(n.op == "get_attr" and hasattr(getattr(gm, n.target, None), "backend_id") for n in gm.graph.nodes)
    return count


def executorch_config(recipe) -> dict:
    """The recipe's ``ExecutorchBackendConfig`` fields; with quantized embeddings ``do_quant_fusion_and_const_prop``
    defaults to on: it fuses a table's dequantize + lookup into ExecuTorch's quantized-embedding kernel (the table
    stays packed; without it the program would store and dequantize it whole)."""
    if recipe.embedding is None:
        return dict(recipe.executorch_config)
    return {"do_quant_fusion_and_const_prop": True, **recipe.executorch_config}
