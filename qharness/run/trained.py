"""What training hands to deployment, as plain objects (``Trained``, ``HeldOut``: models, recipe, tensors,
tokenizer), and the converted graph built from them (``with_rounding``, ``deploy_graph``). Lightning's side
(``run/from_lightning.py``) builds them from the LightningModule and the DataModule; the Python API from its model.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Trained:
    """What training hands to deployment, as plain objects (no Lightning): build it with ``QuantLM.trained()``.

    Args:
        fp_model: The FP model as loaded (HF causal LM, eval mode, CPU).
        tokenizer: Its tokenizer.
        recipe: The backend recipe.
        mode: ``qat`` or ``ptq``.
        checkpoint: ``model.checkpoint`` as configured (recorded in the summary).
        model_dir: The directory ``fp_model`` was loaded from (the eager benchmark loads it in a fresh process).
        fake_quant: QAT: the trained fake-quant graph, eval mode, CPU: ``fake_quant(x[B, T]) -> logits``.
        load_trained: QAT: ``load_trained(hf_model)`` puts the trained weights into an FP model of the same shape.
        weight_qparams: QAT with learned scales: ``{HF weight name: (scale, zero_point)}`` as trained; the deployed
            program quantizes each weight with these (else with min-max of the trained weights).
        distill: QAT with distillation: its settings (``kl_weight``, ``temperature``, ``hard_loss``; recorded).
        lora: LoRA-QAT: its settings, adapted layers and trained parameter count (recorded; the weights that
            ``load_trained`` puts in are already merged).
        train_time: QAT: seconds per training step on the device that trained (``StepLog.summary``: the
            ``train_*`` fields of the summary's ``timings``); None when no step ran in this process.
    """

    fp_model: torch.nn.Module
    tokenizer: object
    recipe: object
    mode: str
    checkpoint: str
    model_dir: str
    fake_quant: torch.nn.Module | None = None
    load_trained: Callable[[torch.nn.Module], None] | None = None
    weight_qparams: dict | None = None
    distill: dict | None = None
    lora: dict | None = None
    train_time: dict | None = None


@dataclass
class HeldOut:
    """The data deployment checks with, as tensors: validation blocks ``x``/``y`` ``[n, seq_len]`` (scored by every
    model; the parity prompts are their prefixes), calibration blocks ``[m, seq_len]``, and the text lm-eval's offline
    tasks are built from (``texts()``, called only when lm-eval runs). Build it with ``held_out(datamodule, ...)``."""

    x: torch.Tensor
    y: torch.Tensor
    batch_size: int
    calibration: torch.Tensor
    texts: Callable[[], list[str]]
    end_of_turn: list[int] = dataclasses.field(default_factory=list)  # chat data: the template's end-of-turn ids
    chat_data: bool = False  # the run trained on chat/instruction data
    chat_template: str | None = None  # chat data: the template it was rendered with (None: the tokenizer's)
    # ``conversations(source, limit)``: ``(where, turns)`` to answer (``eval.answers``; source None: the held-out split)
    conversations: Callable[[str | None, int], list] | None = None

    @property
    def seq_len(self) -> int:
        return self.x.shape[1]


def with_rounding(trained: Trained, calibration: torch.Tensor) -> Trained:
    """PTQ with a recipe that chooses its deployed weights: ``trained`` whose weights and ``weight_qparams`` are GPTQ's
    rounding of the FP model on the ``calibration`` blocks (``rounding: gptq``), or the weighted scales', zero points'
    and smoothing's (``rounding: weighted``, ``zero_points``, ``smoothing``: ``recipes/rounding.py``), so the ``.pte``
    holds exactly those weights (the parity gate checks that every scale reached it). Anything else: ``trained`` as
    it is."""
    if trained.mode != "ptq":
        return trained
    from qharness.sources.models import put_weights

    quantizer = trained.recipe.make_quantizer(is_qat=False)
    if trained.recipe.rounds_with_gptq:
        from qharness.recipes.gptq import gptq_round

        weights, qparams = gptq_round(trained.fp_model, quantizer, calibration)
        return dataclasses.replace(
            trained, load_trained=lambda model: put_weights(model, weights), weight_qparams=qparams
        )
    from qharness.recipes.rounding import round_weights, rounds_itself

    if not rounds_itself(quantizer):
        return trained
    settings = trained.recipe.settings
    weighted = getattr(settings, "rounding", "nearest") == "weighted"
    rounded = round_weights(trained.fp_model, quantizer, calibration, weighted, getattr(settings, "smoothing", None))
    return dataclasses.replace(trained, load_trained=rounded.load, weight_qparams=rounded.qparams)


def deploy_graph(
    trained: Trained, calibration: torch.Tensor, max_seq_len: int, copy_fp: bool = True
) -> torch.fx.GraphModule:
    """The converted (quantized) static-KV-cache graph of the trained weights: the FP model (a copy unless
    ``copy_fp`` is False), the trained weights loaded into it (QAT), exported and quantized by the recipe with
    ``calibration`` blocks through its observers. What the ``.pte`` is lowered from, and the parity reference."""
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.training.calibration import calibrate

    model = copy.deepcopy(trained.fp_model) if copy_fp else trained.fp_model
    if trained.load_trained is not None:
        trained.load_trained(model)
    return quantize_for_deploy(
        model, trained.recipe, max_seq_len, lambda graph: calibrate(graph, calibration), trained.weight_qparams
    )
