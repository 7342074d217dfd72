"""The Python API's argument checks, shared by ``prepare``, ``calibrate``, ``export``, ``evaluate`` and ``Pte``: each
bad argument one ``UserError`` line naming it and the fix, before any long work (never a traceback from torch's
internals), and the models ``prepare`` must not take (already quantized or prepared, hooked, all frozen for QAT).

Example::

    model = unwrap_compiled(model)            # torch.compile(model) -> the module it compiled
    check_flag(check_architecture, "check_architecture")
    check_tokens(batch, vocab_size(model), "calibration batch 0")
"""

from __future__ import annotations

import os
import threading

import torch

from qharness.errors import UserError

# torch.export and the PT2E/torchao preparations change process-wide state (dynamo's config, torchao's registries)
# while they run: one at a time in a process, whichever thread calls (prepare, export).
EXPORT_LOCK = threading.RLock()

PREPARED = "_qharness_prepared"  # set on a model that a QAT prepare turned into its graph's weights: "recipe (mode)"
ROTATED = "_qharness_rotated"  # set on a model whose recipe rotation was folded in: the recipe's name
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def check_flag(value, name: str) -> None:
    """``value`` is a bool (``"no"`` or ``0`` would silently read as true or false)."""
    if not isinstance(value, bool):
        raise UserError(f"{name} must be True or False (got {value!r})", fix=f"pass {name}=True or {name}=False")


def check_path(value, name: str) -> None:
    """``value`` is a path (``str`` or ``os.PathLike``)."""
    if not isinstance(value, (str, os.PathLike)) or value == "":
        raise UserError(
            f"{name} must be a path (got {type(value).__name__} {value!r:.60})",
            fix=f'pass {name} as a str or Path, e.g. "out/"',
        )


def unwrap_compiled(model):
    """``torch.compile(model)``'s wrapper -> the module it compiled (the same parameters): export traces the module."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(model, torch.nn.Module) and isinstance(inner, torch.nn.Module):
        return inner
    return model


def vocab_size(model) -> int | None:
    """Rows of the model's input embedding table (token ids must be below it), None when it has none."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, NotImplementedError):
        return None


def check_tokens(tokens: torch.Tensor, vocab: int | None, what: str) -> None:
    """``tokens`` are integer ids in ``[0, vocab)``: else one line (the embedding lookup's ``IndexError`` otherwise,
    or much later, inside the export's calibration)."""
    if tokens.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        raise UserError(f"{what} is a {tokens.dtype} tensor", fix="pass integer token ids (a LongTensor)")
    if vocab is None or tokens.numel() == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab:
        raise UserError(
            f"{what} holds token id {low if low < 0 else high}, outside the model's vocabulary [0, {vocab})",
            fix="tokenize with the model's own tokenizer",
        )


def check_preparable(model, mode: str, recipe) -> None:
    """``model`` (a float32 causal LM) is one ``prepare`` can take: not quantized already (torchao tensor subclasses,
    fake-quant or observer modules), not prepared or rotated already by qharness, without hooks (torch.export bakes
    what a hook computes into the graph once; its side effects never run again, in training or in the ``.pte``), and
    with something to train for QAT."""
    prepared = getattr(model, PREPARED, None)
    if prepared:
        raise UserError(
            f"model was already prepared by qharness.prepare with {prepared}: QAT changed it in place (its tensors "
            "are that QuantizedModel's graph weights)",
            fix="keep using that QuantizedModel, or prepare a fresh FP model (from_pretrained again, or "
            "copy.deepcopy(model) before the first prepare; its .fp_model is such a copy)",
        )
    rotated = getattr(model, ROTATED, None)
    if rotated and recipe.rotation is not None:
        raise UserError(
            f"model was already rotated by qharness.prepare with recipe {rotated!r} (its rotation folded into the "
            f"weights); recipe {recipe.name!r} would rotate it again",
            fix="prepare the unrotated FP model (from_pretrained again), or a recipe without rotation",
        )
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise UserError(
                f"model's {name} is a {type(t).__name__}, not a plain tensor: the model is quantized already "
                "(torchao's quantize_?)",
                fix="prepare the floating-point model, before any quantization (the recipe quantizes it)",
            )
    for name, m in model.named_modules():
        origin = type(m).__module__
        if origin.startswith(("torchao.", "torch.ao.")) and not isinstance(m, torch.fx.GraphModule):
            raise UserError(
                f"model's {name or 'root'} is a {type(m).__name__} ({origin}): the model is quantized already "
                "(fake-quantized or observed)",
                fix="prepare the floating-point model, before any quantization (the recipe quantizes it)",
            )
    for name, m in model.named_modules():
        kinds = [h.strip("_").replace("_hooks", "") for h in HOOKS if getattr(m, h, None)]
        if kinds:
            where = "model" + (f".{name}" if name else "")
            raise UserError(
                f"{where} has a {' and '.join(kinds)} hook: torch.export would bake what it computes into the graph "
                "once (its side effects never run again, in training or in the .pte)",
                fix="remove it before prepare/export (handle.remove()); put its logic in the model or your loop",
            )
    if mode == "qat" and recipe.starts_from_rounding:
        raise UserError(
            f"recipe {recipe.name!r} starts QAT from the program its PTQ chooses on calibration blocks (zero-point "
            "layers, smoothed weights, searched scales), which prepare() is given no blocks for",
            fix="run it as a job (qharness.run_job(config, 'fit') or `qharness fit`), or prepare its PTQ twin "
            "(xnnpack_8da4w_zp) with mode='ptq'",
        )
    if mode == "qat" and not recipe.learns_scales and not any(p.requires_grad for p in model.parameters()):
        raise UserError(
            "every parameter of model has requires_grad=False: QAT would train nothing",
            fix="unfreeze what should train (e.g. model.requires_grad_(True)), or prepare with mode='ptq'",
        )
