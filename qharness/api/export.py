"""Export a prepared model (QAT-trained or calibrated), or an FP model with a recipe, to a checked ``.pte``.

The CLI's own tail runs: ``run/pipeline.deploy_and_check`` (static-KV-cache export, the recipe's quantization,
lowering, runner metadata, the parity gate of the ``.pte`` against the converted model) on the ``Trained``/``HeldOut``
objects built here from your model and data, so the program is the one ``qharness fit``/``calibrate`` writes.

Example::

    result = qharness.export(qm, "out/", calibration=train_text, validation=val_text)
    result.pte_path, result.size_bytes, result.parity.passed, result.coverage, result.summary.metrics["pte"].ppl
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from qharness.api.arguments import (
    EXPORT_LOCK,
    check_path,
    check_preparable,
    check_tokens,
    unwrap_compiled,
    vocab_size,
)
from qharness.api.blocks import Data, calibration_blocks, validation_blocks
from qharness.api.prepare import (
    QuantizedModel,
    calibrate,
    check_causal_lm,
    check_shape,
    context_of,
    model_label,
    prepare,
)
from qharness.api.recipes import Recipe, load_recipe
from qharness.config import ExportConfig, ParityConfig
from qharness.errors import UserError
from qharness.run.summary import Parity, RunSummary

__all__ = ["ExportResult", "export"]

DEFAULT_MAX_SEQ_LEN = ExportConfig().max_seq_len


@dataclass(frozen=True)
class ExportResult:
    """What ``export`` wrote and measured.

    Args:
        pte_path: The ``.pte`` (``<out_dir>/model.pte``; the tokenizer is in ``<out_dir>/tokenizer``).
        size_bytes: Its size.
        parity: The parity gate (``Parity``): ``passed`` (True; a failed gate raises ``ParityError``, None where the backend cannot
            run here), ``max_abs_diff``, ``argmax_agreement``, ``ppl_rel_diff``, ``reasons``, ...
        coverage: The quantized fraction of the linear weights' bytes (0 for an FP recipe; None if not measured).
        summary: The typed run summary (``summary.json``): metrics per model (fp, fake_quant, converted, pte),
            timings per stage, the ``.pte`` record, coverage per recipe rule.
    """

    pte_path: Path
    size_bytes: int
    parity: Parity
    coverage: float | None
    summary: RunSummary


def export(
    model: torch.nn.Module,
    out_dir: str | Path,
    *,
    recipe: str | Path | Recipe | None = None,
    tokenizer=None,
    calibration: Data | None = None,
    validation: Data | None = None,
    max_seq_len: int | None = None,
    parity: ParityConfig | dict | None = None,
    seq_len: int = 128,
    batch_size: int = 1,
) -> ExportResult:
    """Write ``<out_dir>/model.pte`` (static KV cache of ``max_seq_len`` positions; default 256 or the model's context),
    ``tokenizer/`` and ``summary.json``; the ``.pte`` must pass the parity gate (``parity``: ``ParityConfig`` or its
    fields; else ``ParityError``, the file kept as ``model.FAILED_PARITY.pte``).

    ``model``: a ``QuantizedModel`` (QAT-trained, or PTQ after ``calibrate``), or a plain FP transformers model with
    ``recipe`` (plain PTQ: calibrated on ``calibration``, cut into ``seq_len`` blocks). ``validation``: held-out data
    that every model is scored on and whose prefixes are the parity prompts: text, a 1-D token tensor, or
    ``[n, seq_len + 1]`` blocks (up to ``parity.eval_blocks`` blocks are used). ``calibration`` (text or a 1-D token
    tensor: its first 32 blocks, as the CLI's ``calibration.blocks``; or ``[m, seq_len]`` blocks, all used) sets the deploy graph's ranges (for QAT recipes with dynamic activations, only
    the weights'); a PTQ model's default is what ``calibrate`` gave. Bad input is one ``UserError`` line before any
    long work. The model itself is left as it was (the deployment works on a copy of the FP model).

    Example::

        result = qharness.export(qm, "out/", calibration=train_text, validation=val_text)
        assert result.parity.passed
        plain = qharness.export(fp_model, "out_ptq/", recipe="xnnpack_8da4w", tokenizer=tok,
                                calibration=train_text, validation=val_text, seq_len=64)
    """
    from qharness.io.names import check_output_dir

    check_path(out_dir, "out_dir")
    check_shape(batch_size, seq_len, None)
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 3
    ):
        raise UserError(f"max_seq_len must be a whole number >= 3 (got {max_seq_len!r})", fix="e.g. max_seq_len=256")
    model = unwrap_compiled(model)
    parity_cfg = _parity_config(parity)  # default: ParityConfig's, its prompts cut to seq_len (below)
    qm, calibration = _quantized_model(model, recipe, tokenizer, calibration, seq_len, batch_size)
    tokenizer = _tokenizer(qm, tokenizer)
    if parity is None and parity_cfg.prompt_len > qm.seq_len:
        parity_cfg = ParityConfig(prompt_len=qm.seq_len)
    x, y = _validation(qm, validation, tokenizer, parity_cfg)
    calib = _calibration(qm, calibration, tokenizer)
    export_cfg = _export_config(qm, max_seq_len, parity_cfg)
    out_dir = check_output_dir(out_dir, "out_dir")
    return _deploy(qm, tokenizer, x, y, calib, Path(out_dir), export_cfg, parity_cfg)


def _quantized_model(
    model: torch.nn.Module, recipe, tokenizer, calibration: Data | None, seq_len: int, batch_size: int
) -> tuple[QuantizedModel, Data | None]:
    """``model`` as a ``QuantizedModel`` and the calibration data still to use: a plain FP model is prepared and
    calibrated on ``calibration`` (plain PTQ, as ``qharness calibrate``; nothing left to use); a prepared one keeps its
    recipe (another ``recipe`` is refused)."""
    if not isinstance(model, QuantizedModel):  # plain PTQ: prepare + calibrate, as qharness calibrate
        if recipe is None:
            raise UserError(
                f"export got a {type(model).__name__} without a recipe",
                fix="pass recipe= (e.g. recipe='xnnpack_8da4w') for plain PTQ, or a model from qharness.prepare",
            )
        check_causal_lm(model)
        recipe = load_recipe(recipe)
        check_preparable(model, "ptq", recipe)  # before the data is cut: a quantized or hooked model said first
        if calibration is None:
            raise UserError("plain PTQ needs calibration data", fix="pass calibration= (text or token blocks)")
        blocks = calibration_blocks(calibration, tokenizer, seq_len)
        prepared = prepare(
            model,
            recipe,
            mode="ptq",
            batch_size=batch_size,
            seq_len=seq_len,
            tokenizer=tokenizer,
            check_architecture=False,  # the deployment below is the check
        )
        return calibrate(prepared, [blocks]), None
    if recipe is not None and load_recipe(recipe).name != model.recipe.name:
        raise UserError(
            f"export got recipe={load_recipe(recipe).name!r} for a model prepared with {model.recipe.name!r}",
            fix="leave recipe out (the prepared model's is used)",
        )
    return model, calibration


def _tokenizer(qm: QuantizedModel, tokenizer):
    """The transformers tokenizer written beside the ``.pte``: ``tokenizer`` or the prepared model's."""
    tokenizer = tokenizer if tokenizer is not None else qm.tokenizer
    if tokenizer is None or not hasattr(tokenizer, "save_pretrained"):
        raise UserError(
            "export needs the model's transformers tokenizer (it is written beside the .pte for the runner)",
            fix="pass tokenizer= to qharness.prepare or to export",
        )
    return tokenizer


def _validation(
    qm: QuantizedModel, validation: Data | None, tokenizer, parity_cfg: ParityConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The validation blocks ``x``, ``y`` scored and gated on: whole batches, up to ``parity.eval_blocks``."""
    if validation is None:
        raise UserError(
            "export needs validation data (the parity gate scores the .pte on it)",
            fix="pass validation= held-out text (or [n, seq_len + 1] token blocks)",
        )
    x, y = validation_blocks(validation, tokenizer, qm.seq_len)
    check_tokens(torch.cat([x, y[:, -1:]], dim=1), vocab_size(qm.fp_model), "validation")
    n = min(parity_cfg.eval_blocks, len(x)) // qm.batch_size * qm.batch_size
    if n == 0:
        raise UserError(
            f"validation holds {len(x)} block(s) of {qm.seq_len} tokens, fewer than one batch of {qm.batch_size}",
            fix=f"give at least {qm.batch_size * (qm.seq_len + 1)} tokens of validation text",
        )
    return x[:n], y[:n]


def _calibration(qm: QuantizedModel, calibration: Data | None, tokenizer) -> torch.Tensor:
    """The deploy graph's calibration blocks: ``calibration`` cut into blocks, else what ``calibrate`` gave."""
    if calibration is not None:
        blocks = calibration_blocks(calibration, tokenizer, qm.seq_len)
        check_tokens(blocks, vocab_size(qm.fp_model), "calibration")
        return blocks
    if qm.calibration is not None:
        return qm.calibration
    raise UserError(
        "export needs calibration data for the deploy graph's ranges",
        fix="pass calibration= (training text or [m, seq_len] token blocks), or qharness.calibrate a PTQ model first",
    )


def _export_config(qm: QuantizedModel, max_seq_len: int | None, parity_cfg: ParityConfig) -> ExportConfig:
    """The static KV cache's length (default 256 or the model's context), checked against the blocks and the parity
    prompts; a QAT model that trained no step is refused."""
    context = context_of(qm.fp_model)
    export_cfg = ExportConfig(max_seq_len=max_seq_len or min(DEFAULT_MAX_SEQ_LEN, context or DEFAULT_MAX_SEQ_LEN))
    check_lengths(qm.seq_len, qm.batch_size, export_cfg.max_seq_len, parity_cfg, context)
    if qm.mode == "qat" and int(qm.trained_batches) == 0:
        raise UserError(
            "the QAT model trained 0 steps: its .pte would be labelled QAT without any quantization-aware training",
            fix="train it first (a loop of qm(x, labels=x).loss.backward()), or use mode='ptq' and qharness.calibrate",
        )
    return export_cfg


def _parity_config(parity: ParityConfig | dict | None) -> ParityConfig:
    if parity is None or isinstance(parity, ParityConfig):
        return parity or ParityConfig()
    if not isinstance(parity, dict):
        raise UserError(f"parity is a {type(parity).__name__}", fix="pass a ParityConfig or a dict of its fields")
    try:
        return ParityConfig(**parity)
    except TypeError as e:
        raise UserError(f"parity: {e}", fix="use the fields of qharness.config.ParityConfig") from e


def check_lengths(seq_len: int, batch_size: int, max_seq_len: int, parity: ParityConfig, context: int | None) -> None:
    """The cross-section rules of a run config on the API's values: the schema's ``check_across_sections`` (the
    messages name the config fields: ``data.seq_len`` is ``seq_len`` here) and the model's context
    (``run/pipeline.check_export_config``), the same functions the CLI runs."""
    from qharness.run.pipeline import check_export_config
    from qharness.schema.run import check_across_sections

    check_across_sections(seq_len, batch_size, max_seq_len, parity.eval_blocks, parity.prompt_len, parity.decode_steps)
    check_export_config(ExportConfig(max_seq_len=max_seq_len), seq_len, context)


def _deploy(qm: QuantizedModel, tokenizer, x, y, calib, out_dir: Path, export_cfg, parity_cfg) -> ExportResult:
    """``deploy_and_check`` on the ``Trained``/``HeldOut`` of ``qm`` (the CLI's ``run/from_lightning`` builds the same
    from a ``QuantLM``), then the typed result."""
    from qharness.run.pipeline import deploy_and_check
    from qharness.run.trained import HeldOut, Trained
    from qharness.training.weights import load_weights_into

    qat = qm.graph is not None
    was_training = qm.training
    fake_quant = qm.cpu_fake_quant() if qat else None
    weights = qm.trained_weights() if qat else None
    trained = Trained(
        fp_model=copy.deepcopy(qm.fp_model),  # deployment puts the trained weights into it and quantizes it in place
        tokenizer=tokenizer,
        recipe=qm.recipe,
        mode=qm.mode,
        checkpoint=model_label(qm.fp_model),
        model_dir=model_label(qm.fp_model),
        fake_quant=fake_quant,
        load_trained=(lambda hf_model: load_weights_into(weights, hf_model)) if qat else None,
        weight_qparams=qm.deploy_qparams() if qat else None,
    )
    held = HeldOut(x=x, y=y, batch_size=qm.batch_size, calibration=calib, texts=lambda: [])
    try:
        with EXPORT_LOCK:
            summary = deploy_and_check(trained, held, out_dir, export_cfg, parity_cfg)
    finally:
        if was_training:
            qm.train(True)
    pte_path = Path(summary.pte.path)
    return ExportResult(
        pte_path=pte_path,
        size_bytes=int(summary.pte.size_bytes),
        parity=summary.parity,
        coverage=summary.coverage.fraction if summary.coverage else None,
        summary=summary,
    )
