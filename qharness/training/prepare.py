"""Export a causal LM for training and insert the recipe's fake-quant (QAT) or observers (PTQ); the switches of
those fake-quants and observers.

Stages: ``export_for_training`` (logits-only wrapper -> ``torch.export`` pre-dispatch graph) ->
``prepare_for_training`` (the recipe's quantizer: ``prepare_qat_pt2e``/``prepare_pt2e``, or torchao QAT
modules for source-level recipes).
"""

from __future__ import annotations

import torch

from qharness.schema import LoRA
from qharness.upstream import imports, pt2e_modes


class LogitsOnly(torch.nn.Module):
    """``input_ids -> logits`` with no KV cache, the form that is trained."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def export_for_training(model, batch_size: int, seq_len: int) -> torch.fx.GraphModule:
    """Pre-dispatch ATen graph (autograd-safe) of the logits-only model, static ``[batch_size, seq_len]``,
    on the model's device (the graph bakes devices in: export where it will train)."""
    example = torch.zeros(batch_size, seq_len, dtype=torch.long, device=next(model.parameters()).device)
    return torch.export.export(LogitsOnly(model).eval(), (example,)).module()


def prepare_for_training(
    model, recipe, batch_size: int, seq_len: int, is_qat: bool, layerwise: bool = False, lora: LoRA | None = None
) -> torch.nn.Module:
    """Export the model and insert the recipe's fake-quant (QAT) or observers (PTQ).

    PT2E recipes annotate the exported graph (``prepare_qat_pt2e`` / ``prepare_pt2e``), their quantized embedding
    tables fake-quantized at source level first (QAT, ``recipes/embedding.py``); source-level
    recipes (torchao ``quantize_``) swap in fake-quantized modules first and export the result.
    ``layerwise``: one graph per decoder layer (``training/layerwise.py``) instead of one for the whole model.
    ``lora`` (QAT): low-rank adapters on the target linears, fake-quantized merged with the frozen base weights
    (``training/lora.py``); everything but the adapters (and learned scales) is frozen.
    """
    root = _prepare(model, recipe, batch_size, seq_len, is_qat, layerwise, lora)
    if lora is not None:
        from qharness.recipes.learned_scales import quantization_parameter_names
        from qharness.training.layerwise import graph_modules
        from qharness.training.lora import check_merged_fake_quant, freeze_base

        freeze_base(root, keep=quantization_parameter_names(root))
        for _, graph in graph_modules(root):
            check_merged_fake_quant(graph)
    return root


def _prepare(model, recipe, batch_size, seq_len, is_qat, layerwise, lora) -> torch.nn.Module:
    if lora is not None and not is_qat:
        raise ValueError("LoRA adapters need QAT")
    quantizer = recipe.make_quantizer(is_qat=is_qat)
    if recipe.kind == "source":
        if is_qat:
            # torchao's fake quantizers pass gradients straight through in autograd.Functions, which
            # torch.export decomposes into round/clamp (zero gradient: nothing would train). Train the eager
            # modules instead; deployment re-exports the trained weights anyway.
            quantizer.prepare_qat(model)
            from qharness.upstream import qat_speed

            qat_speed.install(model)  # the same fake quantization and gradients in fewer passes over each tensor
            if lora is not None:  # onto torchao's FakeQuantizedLinear modules: their weight fake quantizer sees W + sBA
                from qharness.training.lora import add_adapters

                add_adapters(model, lora)
            if recipe.learns_scales:
                from qharness.recipes.learned_scales import init_source_scales

                init_source_scales(model)  # the scales are parameters before the optimizer (or a checkpoint) sees them
            return LogitsOnly(model).train()
        quantizer.check(model)  # the recipe's layers against this model now, not at deployment after calibration
        return export_for_training(model, batch_size, seq_len)

    def prepare(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
        pt2e = imports.pt2e()
        if quantizer is None:
            return pt2e_modes.allow_train_eval(graph)
        prepared = (pt2e.prepare_qat_pt2e if is_qat else pt2e.prepare_pt2e)(graph, quantizer)
        if is_qat and recipe.learns_scales:
            from qharness.recipes.learned_scales import init_learned_scales

            init_learned_scales(prepared)  # the scales are parameters before the optimizer (or a checkpoint) sees them
        return pt2e_modes.allow_train_eval(prepared)

    if recipe.embedding is not None:  # PT2E takes linears only: the tables are quantized at source level
        from qharness.recipes import embedding

        if is_qat:  # trained through the deploy config's fake quantizer, before export
            embedding.prepare_exportable_qat(model, recipe.embedding)
        else:  # PTQ quantizes them at deployment; checked against the model now, before calibration
            embedding.quantizer(recipe.embedding).check(model)
    if lora is not None:  # before export: each linear's exported weight input is W + s * B @ A
        from qharness.training.lora import add_adapters

        add_adapters(model, lora)
    if layerwise:
        from qharness.training.layerwise import export_layerwise

        return LogitsOnly(export_layerwise(model, batch_size, seq_len, prepare))
    return prepare(export_for_training(model, batch_size, seq_len))


def _has_observed(fq) -> bool:
    """Whether a fake-quant's observer has seen data (its scale is computed); min/max start empty or inf."""
    obs = getattr(fq, "activation_post_process", None)
    lo = getattr(obs, "min_val", None)
    return lo is None or (lo.numel() > 0 and bool(torch.isfinite(lo).all()))


def set_static_observers(graph: torch.nn.Module, enabled: bool) -> None:
    """Enable/disable observers of static fake-quants (weights, static activations).

    One that has seen no data yet stays on (validation before the first training step, e.g. Lightning's
    sanity check, would otherwise run with an uncomputed scale).
    """
    pt2e = imports.pt2e()
    for m in graph.modules():
        if isinstance(m, pt2e.FakeQuantizeBase) and not getattr(m, "is_dynamic", False):
            (m.enable_observer if enabled or not _has_observed(m) else m.disable_observer)()


def set_fake_quant(graph: torch.nn.Module, enabled: bool) -> None:
    """Turn every PT2E fake-quant on or off. Off, the graph computes in floating point (observers still record).

    Example::

        set_fake_quant(prepared, False)   # prepared(x) == the exported FP graph's output
    """
    from qharness.recipes import embedding

    pt2e = imports.pt2e()
    for m in graph.modules():
        if isinstance(m, pt2e.FakeQuantizeBase):
            (m.enable_fake_quant if enabled else m.disable_fake_quant)()
    embedding.set_fake_quant(graph, enabled)  # a PT2E recipe's quantized embedding tables
