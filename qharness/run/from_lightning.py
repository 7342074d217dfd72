"""The Lightning side of a run handed to the plain stages: ``QuantLM`` -> ``Trained``, ``TextDataModule`` -> ``HeldOut``.

Example::

    summary = deploy_and_check(trained(module), held_out(dm, parity_cfg, calib_cfg), run_dir, export_cfg, parity_cfg)
"""

from __future__ import annotations

from qharness.config import CalibrationConfig, EvalConfig, ParityConfig
from qharness.run.trained import HeldOut, Trained


def trained(module) -> Trained:
    """The FP model, the recipe and (QAT) the trained fake-quant graph of a ``QuantLM``, on CPU, in eval mode."""
    fp_model, tokenizer = module.load_fp()
    fake_quant = None
    if module.graph is not None:
        module.graph_to_cpu()  # trained on a GPU: deployment and its checks run on CPU
        module.to_eval()
        fake_quant = module.graph
    return Trained(
        fp_model=fp_model,
        tokenizer=tokenizer,
        recipe=module.recipe,
        mode=module.hparams.mode,
        checkpoint=module.hparams.checkpoint,
        model_dir=module.model_source(),
        fake_quant=fake_quant,
        load_trained=module.load_into if fake_quant is not None else None,
        weight_qparams=module.deploy_qparams() if fake_quant is not None else None,
        distill=module.hparams.get("distill"),
        lora=module.lora_summary(),
        train_time=training_time(module),
    )


def training_time(module) -> dict | None:
    """Seconds per step of the training this process ran (``StepLog.summary``: the trainer's ``train.log`` lines);
    None without a trainer, a ``StepLog`` or a step."""
    from qharness.training.step_log import StepLog

    trainer = getattr(module, "_trainer", None)
    logs = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, StepLog)]
    return logs[0].summary() if logs else None


def held_out(dm, parity_cfg: ParityConfig, calib_cfg: CalibrationConfig, eval_cfg: EvalConfig | None = None) -> HeldOut:
    """``parity.eval_blocks`` validation blocks (whole batches), the calibration blocks and the lm-eval text of a
    set-up ``TextDataModule``."""
    from qharness.evaluation.harness import eval_texts
    from qharness.training.calibration import calibration_blocks

    n = min(parity_cfg.eval_blocks, len(dm.val_x)) // dm.batch_size * dm.batch_size
    cfg = eval_cfg or EvalConfig(enabled=False)
    return HeldOut(
        x=dm.val_x[:n],
        y=dm.val_y[:n],
        batch_size=dm.batch_size,
        calibration=calibration_blocks(calib_cfg, dm),
        texts=lambda: eval_texts(cfg, dm),
        end_of_turn=dm.end_of_turn_ids(),
        chat_data=dm.format is not None,
        chat_template=dm.format.template if dm.format is not None else None,
        conversations=dm.conversations,
    )
