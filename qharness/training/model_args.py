"""The ``model`` group's own checks (``QuantLM``'s arguments), without torch: the CLI runs them before it loads anything."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from qharness.errors import UserError
from qharness.recipes.registry import Recipe, load_recipe


def check_model_args(
    recipe: str | Recipe,
    mode: str,
    lr: float,
    warmup_steps: int,
    fake_quant_after_n_steps: int = 0,
    freeze_observers_after_n_steps: int | None = None,
    distill: bool = False,
    layerwise: bool = False,
    activation_checkpointing: bool = False,
    strategy: str | None = None,
    weight_decay: float = 0.0,
    lora: bool = False,
) -> Recipe:
    """The recipe (loaded and checked for ``mode``) if the arguments make sense together, else a ``UserError``.

    Example::

        check_model_args("xnnpack_int8_dynamic", "qat", lr=1e-4, warmup_steps=10).kind   # "pt2e"
        check_model_args("xnnpack_int8_dynamic", "qat", lr=-1, warmup_steps=10)          # UserError: model.lr ...
    """
    if isinstance(recipe, Recipe):  # the Python API passes the loaded recipe
        loaded, recipe = recipe, recipe.name
    else:
        loaded = load_recipe(recipe)
    loaded.check_mode(mode)
    if distill and mode != "qat":
        raise UserError(
            f"model.distill needs model.mode: qat (got {mode!r}: PTQ trains nothing)",
            fix="set model.mode: qat, or remove model.distill",
        )
    if lora and mode != "qat":
        raise UserError(
            f"model.lora needs model.mode: qat (got {mode!r}: PTQ trains nothing)",
            fix="set model.mode: qat, or remove model.lora",
        )
    if lora and loaded.learns_scales:
        raise UserError(
            f"model.lora with recipe {recipe!r} (learned weight scales) is not supported yet",
            fix="use its min-max twin (xnnpack_int4w_dynamic, xnnpack_8da4w) with model.lora, or drop model.lora",
        )
    if not lr > 0 or lr == float("inf"):
        raise UserError(f"model.lr must be positive (got {lr})", fix="e.g. model.lr: 1.0e-4")
    if isinstance(weight_decay, bool) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise UserError(
            f"model.weight_decay must be a finite number >= 0 (got {weight_decay})", fix="e.g. model.weight_decay: 0.01"
        )
    if warmup_steps < 0:
        raise UserError(f"model.warmup_steps must be >= 0 (got {warmup_steps})", fix="e.g. model.warmup_steps: 10")
    if fake_quant_after_n_steps < 0 or (
        freeze_observers_after_n_steps is not None and freeze_observers_after_n_steps < 0
    ):
        raise UserError(
            f"model.fake_quant_after_n_steps and model.freeze_observers_after_n_steps must be >= 0 "
            f"(got {fake_quant_after_n_steps}, {freeze_observers_after_n_steps})",
            fix="set them >= 0 (freeze_observers_after_n_steps: null never freezes)",
        )
    if mode == "qat" and (fake_quant_after_n_steps or freeze_observers_after_n_steps is not None):
        if loaded.kind == "source":
            raise UserError(
                f"recipe {recipe!r} fake-quantizes inside its modules at export time: fake_quant_after_n_steps and "
                "freeze_observers_after_n_steps need a PT2E recipe",
                fix="leave them unset, or use xnnpack_int8_dynamic / xnnpack_int4w_dynamic",
            )
    check_layer_units(
        loaded,
        layerwise,
        activation_checkpointing,
        "trainer.strategy fsdp_layers" if strategy == "fsdp_layers" else None,
    )
    if mode == "ptq" and loaded.learns_scales:
        raise UserError(
            f"recipe {recipe!r} learns its weight scales (learn_scales: true), which needs training",
            fix="use mode qat, or a recipe without learn_scales for PTQ",
        )
    if mode == "qat" and loaded.rounds_with_gptq and not loaded.learns_scales:
        raise UserError(
            f"recipe {recipe!r} rounds by GPTQ (rounding: gptq) without learned scales: QAT's min-max fake quantization "
            "would re-round GPTQ's weights onto another grid",
            fix="use mode ptq, or a recipe with learn_scales: true as well (e.g. xnnpack_8da3w_lsq_gptq)",
        )
    return loaded


def check_layer_units(
    recipe: Recipe, layerwise: bool, activation_checkpointing: bool = False, sharded_by: str | None = None
) -> None:
    """Activation checkpointing and per-layer sharding (``sharded_by``: what shards, e.g. ``trainer.strategy
    fsdp_layers``) need per-layer units: a PT2E recipe's graph must be ``layerwise`` (torchao source-level recipes
    keep eager layers)."""
    if recipe.kind == "source" or layerwise:
        return
    if activation_checkpointing:
        raise UserError(
            "model.activation_checkpointing recomputes decoder layers, which needs one graph per layer",
            fix="add --model.layerwise true",
        )
    if sharded_by:
        raise UserError(
            f"{sharded_by} shards per decoder layer, which needs one graph per layer",
            fix="add --model.layerwise true (or train with --trainer.strategy ddp)",
        )


# trainer.precision values a fake-quant graph trains with: float32 weights, optionally autocast to 16 bits.
# "*-true" half precisions fail inside the fake-quant kernels ("Scale must be Float", dtype asserts).
PRECISIONS_OK = {"32", "32-true", "bf16", "bf16-mixed", "16", "16-mixed"}


def check_precision(precision, recipe, mode: str) -> None:
    """Refuse a ``trainer.precision`` the recipe's QAT graph cannot train with (UserError, exit 2).

    Checked on CPU with torch 2.13 / torchao 0.18: PT2E recipes train with ``32-true``, ``bf16-mixed`` and
    ``16-mixed`` (the unfused ``FakeQuantize`` runs under autocast); torchao source-level recipes (8da4w) only
    with ``32-true`` ("Tensor dtype mismatch! Expected: Float, Got: BFloat16" in torchao's fake quantizer).
    """
    p = str(precision) if precision is not None else "32-true"
    if mode != "qat" or p in ("32", "32-true"):
        return
    if p not in PRECISIONS_OK:
        raise UserError(
            f"trainer.precision={p} does not work with fake quantization (weights, scales and observers must stay float32)",
            fix="use 32-true, or bf16-mixed / 16-mixed (autocast) with a PT2E recipe",
        )
    if recipe.kind == "source":
        raise UserError(
            f"trainer.precision={p} does not work with recipe {recipe.name!r} (torchao's fake quantizer needs float32 inputs)",
            fix="use trainer.precision 32-true with this recipe, or a PT2E recipe (xnnpack_int8_dynamic, xnnpack_int4w_dynamic) for mixed precision",
        )


@dataclasses.dataclass(frozen=True)
class Distill:
    """Knowledge distillation (QAT only): the fake-quantized student also learns the FP model's logits.

    Hinton et al.'s form. The teacher is the model of ``model.checkpoint`` as loaded (or ``teacher``), frozen, on the
    student's device; it is rebuilt from that source on every rank and on resume, never saved in checkpoints.
    Validation loss stays plain cross-entropy.

    Loss per token: ``ce(student, labels) (if hard_loss) + kl_weight * T^2 * KL(softmax(teacher/T) || softmax(student/T))``.

    Example (YAML): ``model: {distill: {kl_weight: 1.0, temperature: 2.0, hard_loss: false}}``; from an FP model
    fine-tuned on the same data first: ``model: {distill: {teacher: runs/fp32_finetune-qat}}``.

    Args:
        kl_weight: Weight of the KL term (> 0).
        temperature: Softmax temperature T of both distributions (> 0); the KL is scaled by T^2.
        hard_loss: Keep the cross-entropy against the data's next tokens beside the KL term.
        teacher: The model to learn from, if not the student's own starting model: a ``model.checkpoint`` value (a
            ``save_pretrained`` directory, hub id, torchtune builder) with the same vocabulary, or the run directory
            of a ``qharness fit`` with an FP recipe (e.g. ``xnnpack_fp32_finetune``: its ``checkpoints/last.ckpt``).
    """

    kl_weight: float = 1.0
    temperature: float = 1.0
    hard_loss: bool = True
    teacher: str | None = None

    def __post_init__(self):
        for name in ("kl_weight", "temperature"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise UserError(
                    f"model.distill.{name} must be a positive number (got {value!r})",
                    fix=f"set model.distill.{name} > 0, or leave model.distill unset to train without the teacher",
                )
        if not isinstance(self.hard_loss, bool):
            raise UserError(f"model.distill.hard_loss must be true or false (got {self.hard_loss!r})")
        if self.teacher is not None:
            check_teacher(self.teacher)


def check_teacher(teacher) -> None:
    """``model.distill.teacher``: a run directory with ``checkpoints/last.ckpt`` or a ``model.checkpoint`` value
    (a local directory is checked here, torch-free)."""
    from qharness.sources.models import check_local_checkpoint

    if not isinstance(teacher, str) or not teacher.strip():
        raise UserError(
            f"model.distill.teacher must be a model directory or a qharness run directory (got {teacher!r})",
            fix="leave it unset to distill from model.checkpoint",
        )
    path = Path(teacher).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        if teacher_run_checkpoint(teacher) is None:
            raise UserError(
                f"model.distill.teacher {path} is neither a save_pretrained directory (config.json) nor a finished "
                "qharness run (checkpoints/last.ckpt)",
                fix="point it at a model directory, or at the run directory of a qharness fit with an FP recipe",
            )
        return
    try:
        check_local_checkpoint(teacher)
    except UserError as e:
        raise UserError(e.what.replace("model.checkpoint", "model.distill.teacher", 1), fix=e.fix) from None


def teacher_run_checkpoint(teacher: str) -> Path | None:
    """The ``checkpoints/last.ckpt`` of a ``model.distill.teacher`` that names a qharness run directory; None for a
    model source (a ``save_pretrained`` directory, which has ``config.json``, a hub id, a torchtune builder)."""
    path = Path(teacher).expanduser()
    ckpt = path / "checkpoints" / "last.ckpt"
    return ckpt if ckpt.is_file() and not (path / "config.json").is_file() else None


# HF names of the attention and MLP projections (Llama, Mistral, Qwen2/3, Gemma, OLMo2, ...): LoRA's default targets.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRA:
    """LoRA-QAT (QAT only): train low-rank adapters on top of the frozen base weights; only the adapters learn.

    Each target linear layer computes ``linear(x, fake_quant(W + (alpha/rank) * B @ A))``: the recipe's weight
    fake quantization sees the *merged* weight, the one deployment quantizes, so what trains is what ships
    (torchtune's QAT+LoRA fake-quantizes ``W`` alone and adds ``B @ A x`` in float, which the deployed, merged and
    quantized weight does not compute). ``A`` starts random (Kaiming uniform), ``B`` at zero: step 0 is plain QAT.
    Before deployment the adapters are merged into the weights, so the ``.pte`` has the program shape of full QAT.
    Embeddings, norms and untargeted layers stay frozen. No dropout: in the merged form there is no separate
    adapter path for it to act on.

    Example (YAML): ``model: {lora: {rank: 8, alpha: 16, targets: [q_proj, v_proj]}}``.

    Args:
        rank: Rank r of each adapter (``B: [out, r]``, ``A: [r, in]``), >= 1.
        alpha: Scale numerator: the update is ``(alpha / rank) * B @ A`` (> 0).
        targets: Which linear layers get adapters: glob patterns matched against a layer's name in the HF model
            (``model.layers.0.self_attn.q_proj``) or its last part (``q_proj``). Default: the attention and MLP
            projections. Given patterns must each match a linear layer.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise UserError(
                f"model.lora.rank must be an integer >= 1 (got {self.rank!r})", fix="e.g. model.lora.rank: 8"
            )
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise UserError(
                f"model.lora.alpha must be a positive number (got {alpha!r})",
                fix="e.g. model.lora.alpha: 16 (the update is scaled by alpha / rank)",
            )
        targets = self.targets
        if isinstance(targets, str) or not isinstance(targets, (list, tuple)) or not targets:
            raise UserError(
                f"model.lora.targets must be a non-empty list of layer-name patterns (got {targets!r})",
                fix="e.g. model.lora.targets: [q_proj, v_proj]",
            )
        if not all(isinstance(t, str) and t.strip() for t in targets):
            raise UserError(
                f"model.lora.targets must hold non-empty names or glob patterns (got {list(targets)!r})",
                fix="e.g. model.lora.targets: [q_proj, 'model.layers.*.mlp.*']",
            )
        object.__setattr__(self, "targets", tuple(targets))
        object.__setattr__(self, "alpha", float(alpha))

    @property
    def scale(self) -> float:
        """``alpha / rank``, the factor of ``B @ A`` in the merged weight."""
        return self.alpha / self.rank

    def record(self) -> dict:
        """Plain data (checkpoint hyperparameters, ``summary.json``): targets as a list."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}
