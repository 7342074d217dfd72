"""The jobs a run config names after (or instead of) training, as plain functions of the ``QuantLM`` module, the
``TextDataModule`` and the run's settings: ``deploy`` (and ``calibrate``/``export``, which end in it) and
``evaluate``. ``qharness <subcommand>`` calls them through ``QTrainer``'s methods; so does ``qharness.api.run_job``.

Example::

    settings = RunSettings(Path("runs/ptq"), ExportConfig(), ParityConfig())
    summary = calibrate(QuantLM(checkpoint="embedded", recipe="xnnpack_8da4w", mode="ptq"), datamodule, settings)
    summary.pte.size_bytes, summary.parity.passed
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qharness.config import BenchConfig, CalibrationConfig, EvalConfig, ExportConfig, ParityConfig
from qharness.data.datamodule import TextDataModule
from qharness.errors import ParityError, UserError
from qharness.run.from_lightning import held_out, trained
from qharness.run.summary import RunSummary
from qharness.schema.run import check_calibrates
from qharness.schema.trainer import resolve_ckpt
from qharness.training.checkpoints import load_checkpoint
from qharness.training.module import QuantLM

OnSummary = Callable[[RunSummary], None]


@dataclass
class RunSettings:
    """Where a run writes (``run_dir``: ``trainer.default_root_dir``) and the config sections its stages after
    training read (``deploy``, ``parity``, ``calibration``, ``bench``, ``eval``)."""

    run_dir: Path
    deploy: ExportConfig = field(default_factory=ExportConfig)
    parity: ParityConfig = field(default_factory=ParityConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    bench: BenchConfig = field(default_factory=lambda: BenchConfig(enabled=False))
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(enabled=False))


def deploy(
    model: QuantLM, datamodule: TextDataModule, settings: RunSettings, on_summary: OnSummary | None = None
) -> RunSummary:
    """``deploy_and_check`` of a trained (QAT) or calibrating (PTQ) module; ``on_summary`` gets the summary (a failed
    parity gate's too, before ``ParityError`` propagates): the CLI logs the run's final row to wandb with it."""
    from qharness.run.pipeline import deploy_and_check

    if model.hparams.mode == "qat" and model.steps_trained == 0:
        raise UserError(
            "the QAT run trained 0 steps (e.g. trainer.limit_train_batches gave no batches): its .pte would be "
            "labelled QAT without any quantization-aware training; nothing was exported",
            fix="train at least one step (trainer.max_steps, trainer.limit_train_batches), or use qharness calibrate "
            "with model.mode: ptq",
        )
    s = settings
    try:
        summary = deploy_and_check(
            trained(model),
            held_out(datamodule, s.parity, s.calibration, s.eval),
            Path(s.run_dir),
            s.deploy,
            s.parity,
            s.bench,
            s.eval,
        )
    except ParityError:
        if on_summary is not None:
            on_summary(RunSummary.read(Path(s.run_dir) / "summary.json"))
        raise
    if on_summary is not None:
        on_summary(summary)
    return summary


def export(
    model: QuantLM,
    datamodule: TextDataModule,
    settings: RunSettings,
    ckpt_path: str = "last",
    on_summary: OnSummary | None = None,
) -> RunSummary:
    """Export a trained checkpoint (``last``: the run's latest, or a path) to ``.pte``: ``deploy``."""
    datamodule.setup("fit")
    load_checkpoint(model, datamodule, resolve_ckpt(ckpt_path, settings.run_dir))
    return deploy(model, datamodule, settings, on_summary)


def calibrate(
    model: QuantLM, datamodule: TextDataModule, settings: RunSettings, on_summary: OnSummary | None = None
) -> RunSummary:
    """PTQ: calibrate the recipe's observers (``calibration.*``), convert, export, lower and check the ``.pte``
    (``deploy``). Needs ``model.mode: ptq``."""
    check_calibrates(model.hparams.mode)
    datamodule.setup("fit")
    return deploy(model, datamodule, settings, on_summary)


def evaluate(
    model: QuantLM,
    datamodule: TextDataModule,
    settings: RunSettings,
    pte: str | None = None,
    ckpt_path: str | None = None,
) -> dict:
    """lm-eval of a finished run (``settings.eval``: tasks, limit, models): the FP model, the fake-quant model (QAT:
    the trained checkpoint, ``last`` by default; PTQ: the converted model, re-calibrated as at export) and the
    ``.pte`` (default: ``deploy.filename`` in the run directory). Writes ``eval-<UTC time>.json`` and appends the
    result to summary.json's ``evaluations`` (the run's own ``eval`` stays); returns lm-eval's table."""
    from qharness.checks.parity import fold_constants
    from qharness.run.results import evaluate_run
    from qharness.run.trained import deploy_graph, with_rounding

    cfg, run_dir = settings.eval, Path(settings.run_dir)
    pte_path = Path(pte) if pte else run_dir / settings.deploy.filename
    if "pte" in cfg.models:
        from qharness.runtime.pte import PteModel

        if not pte_path.is_file():
            raise UserError(
                f"no .pte at {pte_path}", fix="run qharness export (or fit/calibrate) first, or pass --pte PATH"
            )
        PteModel(pte_path)  # a corrupt file fails here, before the other models are evaluated
    datamodule.setup("fit")
    qat = model.hparams.mode == "qat"
    if qat and ("fake_quant" in cfg.models or "converted" in cfg.models):
        load_checkpoint(model, datamodule, resolve_ckpt(ckpt_path or "last", run_dir))
    run, data = trained(model), held_out(datamodule, settings.parity, settings.calibration, cfg)
    converted = None
    if "converted" in cfg.models or (not qat and "fake_quant" in cfg.models):
        run = with_rounding(run, data.calibration)  # PTQ that chooses its weights (GPTQ, zero points): as at export
        converted = fold_constants(deploy_graph(run, data.calibration, settings.deploy.max_seq_len))
    # beside the run's own eval.json, never over it: each evaluation has its own file and summary entry
    filename = time.strftime("eval-%Y%m%d-%H%M%S.json", time.gmtime())
    result = evaluate_run(
        run, data, run.fp_model, converted, pte_path if "pte" in cfg.models else None, run_dir, cfg, filename
    )
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        sha = RunSummary.read(summary_path).pte.sha256 if "pte" in cfg.models else None
        RunSummary.update(summary_path, evaluations=[{**result, "file": filename, "pte_sha256": sha}])
    return result
