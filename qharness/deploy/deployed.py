"""What ``quantize_for_deploy`` records on the deploy graph it makes: one typed record in ``graph.meta``, read by the
export, the checks, the summary and lm-eval's scorer (which export it took, why, its KV cache, its quantized layers
and coverage)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from qharness.deploy.coverage_record import Coverage

META_KEY = "qharness_deploy"  # the one key of graph.meta qharness writes


@dataclass(frozen=True)
class DeployRecord:
    """How a deploy graph was made.

    ``export_path``: ``"fast"`` (``deploy/fastpath``) or ``"generic"`` (HF's static cache); ``fallback_reason``: why
    the generic one (None on the fast path); ``kv_cache``: ``"fp32"`` or ``"int8"`` (``KV_CACHES``); ``layers``:
    ``{module name: scheme}`` of a source-level recipe (None for PT2E and FP recipes); ``coverage``:
    ``coverage.measure``'s record."""

    export_path: str
    fallback_reason: str | None
    kv_cache: str
    layers: dict[str, str] | None = None
    coverage: Coverage | None = None


def stamp(graph: torch.fx.GraphModule, record: DeployRecord) -> None:
    """Record ``record`` on ``graph`` (its twins and copies carry ``graph.meta`` along)."""
    graph.meta[META_KEY] = record


def record_of(graph: torch.fx.GraphModule) -> DeployRecord | None:
    """The record ``quantize_for_deploy`` left on ``graph``; None for a graph it did not make."""
    return graph.meta.get(META_KEY)


def export_path(graph: torch.fx.GraphModule) -> str:
    """``"fast"`` or ``"generic"``: the export ``quantize_for_deploy`` used for ``graph``."""
    record = record_of(graph)
    return "generic" if record is None else record.export_path


def fallback_reason(graph: torch.fx.GraphModule) -> str | None:
    """Why ``graph`` took the generic export (``None`` for the fast path)."""
    record = record_of(graph)
    return None if record is None else record.fallback_reason


def kv_cache_dtype(graph: torch.fx.GraphModule) -> str:
    """``"fp32"`` or ``"int8"``: the KV cache of the program ``quantize_for_deploy`` made (``KV_CACHES``)."""
    record = record_of(graph)
    return "fp32" if record is None else record.kv_cache


def quantized_layers(graph: torch.fx.GraphModule) -> dict[str, str] | None:
    """``{module name: scheme}`` that ``quantize_for_deploy`` applied (source-level recipes; ``fp``: kept in
    floating point by the recipe's ``layers``); None for graph-level (PT2E) and FP recipes."""
    record = record_of(graph)
    return None if record is None else record.layers


def graph_coverage(graph: torch.fx.GraphModule) -> Coverage | None:
    """How much of the model ``quantize_for_deploy`` quantized (``coverage.measure``: linear weights and bytes,
    per recipe rule, the float ones with why); None for a graph it did not make."""
    record = record_of(graph)
    return None if record is None else record.coverage


def mark_shared_tables(graph: torch.fx.GraphModule, data_name: str) -> None:
    """Record that the lowering stored ``graph``'s tied tables once (``deploy/shared_table.py``), in the data file
    ``data_name``: each tied table's coverage entry becomes ``shared``, its second copy costing nothing."""
    record = record_of(graph)
    if record is None or record.coverage is None:
        return
    tables = {
        name: dataclasses.replace(
            t,
            shared=True,
            note=f"stored once: the lookup table and {t.tied_to} hold the same int8 values, kept in {data_name}",
        )
        if t.tied_to and t.bits is not None
        else t
        for name, t in record.coverage.embeddings.items()
    }
    coverage = dataclasses.replace(record.coverage, embeddings=tables)
    stamp(graph, dataclasses.replace(record, coverage=coverage))
