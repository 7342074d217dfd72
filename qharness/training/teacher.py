"""The FP teacher of distillation (``model.distill.teacher``): a model checkpoint, or an FP run's trained weights."""

from __future__ import annotations

import torch

from qharness.errors import UserError
from qharness.training.weights import check_finite_state, hf_weights, load_weights_into


def load_teacher(source: str, trust_remote_code: bool = False):
    """The FP model of ``model.distill.teacher``: a ``model.checkpoint`` value, or the run directory of a ``qharness
    fit`` with an FP recipe, whose trained weights (``checkpoints/last.ckpt``, read ``weights_only``) are loaded
    into its source model. Example::

        teacher = load_teacher("runs/fp32_finetune-qat")   # the fine-tuned FP model, an HF causal LM
    """
    from qharness.schema.model import teacher_run_checkpoint
    from qharness.sources.models import load_model_and_tokenizer, resolve_checkpoint

    ckpt_path = teacher_run_checkpoint(source)
    if ckpt_path is None:
        return load_model_and_tokenizer(resolve_checkpoint(source), trust_remote_code)[0]
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    saved = ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}
    if "state_dict" not in ckpt or "recipe" not in saved:
        raise UserError(f"model.distill.teacher {ckpt_path} is not a qharness training checkpoint")
    check_finite_state(ckpt["state_dict"], f"model.distill.teacher {ckpt_path}")
    from qharness.recipes.registry import load_recipe

    recipe = load_recipe(saved["recipe"])
    if recipe.quantized or recipe.rotation is not None or saved.get("lora") is not None:
        raise UserError(
            f"model.distill.teacher {source} was trained with the quantized recipe {recipe.name!r}"
            if recipe.quantized
            else f"model.distill.teacher {source} was trained with a rotation or LoRA (recipe {recipe.name!r})",
            fix="use the run of a plain FP recipe (e.g. xnnpack_fp32_finetune) or a model directory",
        )
    graph = ((k[len("graph.") :], v) for k, v in ckpt["state_dict"].items() if k.startswith("graph."))
    model, _ = load_model_and_tokenizer(resolve_checkpoint(saved["checkpoint"]), trust_remote_code)
    load_weights_into(hf_weights(graph), model)
    return model
