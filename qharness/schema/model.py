"""The ``model`` section: ``QuantLM``'s fields (``ModelConfig``, with ``Distill`` and ``LoRA``) and their rules, torch-free.

``QuantLM.__init__`` takes its fields from ``ModelConfig`` (``QuantLM(**fields)`` builds one), so the CLI's ``--model.*``
options, their ``--help`` text, the pre-torch check and ``docs/config-reference.md`` all come from this class.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from qharness.errors import UserError
from qharness.recipes.registry import Recipe, load_recipe
from qharness.schema.fields import typed
from qharness.sources.models import EMBEDDED_MODELS, check_local_checkpoint
from qharness.sources.torchtune import PREFIX as TORCHTUNE


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


@dataclasses.dataclass
class ModelConfig:
    """A causal LM trained with quantization-aware training (or calibrated) for one backend recipe.

    Args:
        checkpoint: ``embedded`` (the built-in small Llama, pretrained on first use), ``embedded-chat`` (it
            fine-tuned on the training split of ``data.source: embedded-chat`` on first use: a chat model whose
            tokenizer carries the ``embedded`` chat template), a local
            ``save_pretrained`` directory of any decoder-only HF causal LM that transformers exports
            with a static KV cache (Llama, Qwen2/3, Mistral, Phi-3, Gemma 1/2/3, ...), a ``.gguf`` file
            (llama.cpp's format, any type transformers reads: Q4_0, Q4_1, Q4_K_M, Q8_0, F16, F32, ...;
            converted once into a cached float32 directory; its weights keep the GGUF's quantization grid,
            so re-quantizing a Q4_1 file onto another 4-bit grid adds that grid's error to Q4_1's), a hub id
            (online only), or a torchtune builder: ``torchtune:llama3_2.llama3_2_1b`` or
            ``torchtune:llama3_2.llama3_2(vocab_size=2048, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=128, max_seq_len=512)``
            (random init; ``tokenizer=DIR`` picks an HF tokenizer; needs the torchtune extra).
        recipe: Backend recipe name (``qharness recipes`` lists them) or a path to a recipe YAML.
        mode: ``qat`` (train with fake quantization) or ``ptq`` (calibrate only).
        lr: Peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up steps before the cosine decay.
        min_lr_ratio: Where the cosine decay ends, as a fraction of ``lr`` (0: down to zero; 1: constant after the
            warm-up).
        scale_lr_ratio: QAT with learned scales (``learn_scales: true``): their learning rate as a fraction of ``lr``
            (AdamW moves every parameter by about the rate a step, and a 4-bit scale is about its group's largest
            weight / 8);
            0 keeps the scales where they start (min-max, GPTQ's or rounding's) and trains the weights alone.
        trust_remote_code: Run model code from the hub (off by default; only for models you trust).
        fake_quant_after_n_steps: QAT: train in floating point for the first N optimizer steps (fake
            quantization off, observers recording), then with fake quantization (torchtune's
            ``fake_quant_after_n_steps``). Validation before step N measures the FP model. PT2E recipes only.
        freeze_observers_after_n_steps: QAT: from step N on, weight (and static-activation) quantization
            ranges stop following the weights; training goes on with the frozen scales, and deployment
            quantizes the final weights with them (the scales the trained graph computes with). None: never.
            PT2E recipes only.
        distill: QAT: also train against the FP model's logits (knowledge distillation; its fields:
            ``qharness fit --model.distill.help``), e.g. ``--model.distill.kl_weight 1.0
            --model.distill.temperature 2.0``. Costs one more FP copy of the model per process. None: plain
            cross-entropy.
        layerwise: Export each decoder layer (and the output head) as its own graph instead of one graph for the
            whole model: the units that ``--trainer.strategy fsdp_layers`` shards and ``activation_checkpointing``
            recomputes. Same numerics as the whole-model graph; checkpoints of one form do not load into the other.
        activation_checkpointing: Recompute each decoder layer in backward instead of keeping its activations
            (less memory, about one more forward of time). PT2E recipes need ``layerwise``.
        lora: QAT: train low-rank adapters on the frozen base weights instead of the weights themselves (LoRA-QAT;
            its fields: ``qharness fit --model.lora.help``), e.g. ``--model.lora.rank 8 --model.lora.alpha 16``. The
            recipe's weight fake quantization sees the merged weight ``W + (alpha/rank) B A``, which deployment
            quantizes: the ``.pte`` is the trained model, with the program shape of full QAT. None: full QAT.
    """

    checkpoint: str = "embedded"
    recipe: str = "xnnpack_int8_dynamic"
    mode: str = "qat"
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    scale_lr_ratio: float = 1.0
    trust_remote_code: bool = False
    fake_quant_after_n_steps: int = 0
    freeze_observers_after_n_steps: int | None = None
    distill: Distill | None = None
    layerwise: bool = False
    activation_checkpointing: bool = False
    lora: LoRA | None = None

    def __post_init__(self):
        self.validate()

    def load_recipe(self) -> Recipe:
        """The recipe of ``recipe`` (a built-in name or a YAML path), loaded and checked."""
        return load_recipe(self.recipe)

    def hparams(self) -> dict:
        """The fields as plain data (checkpoint hyperparameters): ``distill`` and ``lora`` as mappings."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["distill"] = dataclasses.asdict(self.distill) if self.distill is not None else None
        out["lora"] = self.lora.record() if self.lora is not None else None
        return out

    def validate(self) -> None:
        """The model section's rules, each a ``UserError`` naming the field and the fix: the types, the recipe and
        its mode, the optimizer's values, distillation and LoRA against the mode and the recipe, the layer units,
        and a local ``checkpoint`` directory (torch-free: the CLI runs this before it loads anything).

        Example::

            ModelConfig(recipe="xnnpack_int8_dynamic", lr=-1)   # UserError: model.lr must be positive (got -1.0)
        """
        typed(self, "model")
        recipe, mode, loaded = self.recipe, self.mode, self.load_recipe()
        loaded.check_mode(mode)
        if self.distill is not None and mode != "qat":
            raise UserError(
                f"model.distill needs model.mode: qat (got {mode!r}: PTQ trains nothing)",
                fix="set model.mode: qat, or remove model.distill",
            )
        if self.lora is not None and mode != "qat":
            raise UserError(
                f"model.lora needs model.mode: qat (got {mode!r}: PTQ trains nothing)",
                fix="set model.mode: qat, or remove model.lora",
            )
        if self.lora is not None and loaded.learns_scales:
            raise UserError(
                f"model.lora with recipe {recipe!r} (learned weight scales) is not supported yet",
                fix="use its min-max twin (xnnpack_int4w_dynamic, xnnpack_8da4w) with model.lora, or drop model.lora",
            )
        lr, weight_decay = self.lr, self.weight_decay
        if not lr > 0 or lr == float("inf"):
            raise UserError(f"model.lr must be positive (got {lr:g})", fix="e.g. model.lr: 1.0e-4")
        if not math.isfinite(weight_decay) or weight_decay < 0:
            raise UserError(
                f"model.weight_decay must be a finite number >= 0 (got {weight_decay})",
                fix="e.g. model.weight_decay: 0.01",
            )
        if self.warmup_steps < 0:
            raise UserError(
                f"model.warmup_steps must be >= 0 (got {self.warmup_steps})", fix="e.g. model.warmup_steps: 10"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise UserError(
                f"model.min_lr_ratio must lie in [0, 1] (got {self.min_lr_ratio:g})", fix="e.g. model.min_lr_ratio: 0.1"
            )
        if not 0 <= self.scale_lr_ratio <= 1:
            raise UserError(
                f"model.scale_lr_ratio must lie in [0, 1] (got {self.scale_lr_ratio:g})",
                fix="e.g. model.scale_lr_ratio: 0.1 (0: the scales stay where they start)",
            )
        fq, freeze = self.fake_quant_after_n_steps, self.freeze_observers_after_n_steps
        if fq < 0 or (freeze is not None and freeze < 0):
            raise UserError(
                f"model.fake_quant_after_n_steps and model.freeze_observers_after_n_steps must be >= 0 "
                f"(got {fq}, {freeze})",
                fix="set them >= 0 (freeze_observers_after_n_steps: null never freezes)",
            )
        if mode == "qat" and (fq or freeze is not None) and loaded.kind == "source":
            raise UserError(
                f"recipe {recipe!r} fake-quantizes inside its modules at export time: fake_quant_after_n_steps and "
                "freeze_observers_after_n_steps need a PT2E recipe",
                fix="leave them unset, or use xnnpack_int8_dynamic / xnnpack_int4w_dynamic",
            )
        check_layer_units(loaded, self.layerwise, self.activation_checkpointing)
        if mode == "ptq" and loaded.learns_scales:
            raise UserError(
                f"recipe {recipe!r} learns its weight scales (learn_scales: true), which needs training",
                fix="use mode qat, or a recipe without learn_scales for PTQ",
            )
        if mode == "qat" and loaded.rounds_with_gptq and not loaded.learns_scales:
            raise UserError(
                f"recipe {recipe!r} rounds by GPTQ (rounding: gptq) without learned scales: QAT's min-max fake "
                "quantization would re-round GPTQ's weights onto another grid",
                fix="use mode ptq, or a recipe with learn_scales: true as well (e.g. xnnpack_8da3w_lsq_gptq)",
            )
        if self.checkpoint not in EMBEDDED_MODELS and not self.checkpoint.startswith(TORCHTUNE):
            check_local_checkpoint(self.checkpoint)
