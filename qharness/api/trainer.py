"""``QTrainer``: Lightning's Trainer plus the run config's jobs after training, one method per subcommand, each one
call into ``run/workflows.py`` or ``run/tuning.py``."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch import Trainer

from qharness.config import BenchConfig, CalibrationConfig, EvalConfig, ExportConfig, ParityConfig
from qharness.data.datamodule import TextDataModule
from qharness.run import tuning, workflows
from qharness.run.summary import RunSummary
from qharness.run.workflows import RunSettings
from qharness.schema.trainer import checkpoint_dir
from qharness.training.module import QuantLM


class QTrainer(Trainer):
    """Lightning's Trainer plus the run config's jobs after training (``run/workflows.py``, ``run/tuning.py``): each
    method is its subcommand (LightningCLI calls it with the module and the datamodule). The CLI hands it the
    deploy, parity, calibration, bench and eval configs."""

    export_config: ExportConfig = ExportConfig()
    parity_config: ParityConfig = ParityConfig()
    calibration_config: CalibrationConfig = CalibrationConfig()
    bench_config: BenchConfig = BenchConfig()
    eval_config: EvalConfig = EvalConfig()
    summary: RunSummary | None = None  # the last summary this trainer's jobs wrote

    def settings(self) -> RunSettings:
        """The run directory and the sections the jobs read."""
        return RunSettings(
            Path(self.default_root_dir),
            self.export_config,
            self.parity_config,
            self.calibration_config,
            self.bench_config,
            self.eval_config,
        )

    def log_summary(self, summary: RunSummary) -> None:
        """Keep ``summary`` and log the run's final row to wandb (a failed parity gate's row too)."""
        from qharness.reporting.tracking import log_final_row

        self.summary = summary
        log_final_row(self.loggers, summary)

    def train_tuned(self, model: QuantLM, datamodule: TextDataModule) -> None:
        """QAT autotune: fit ``model``, keep the finished run as ``last.ckpt``, gather its graph (as ``after_fit``)."""
        self.fit(model, datamodule)
        model.steps_trained = self.global_step
        self.save_checkpoint(Path(checkpoint_dir(self.default_root_dir)) / "last.ckpt", weights_only=False)
        model.gather()

    def deploy(self, model: QuantLM, datamodule: TextDataModule) -> RunSummary:
        """``.pte``, parity gate, benchmark and evaluation of the trained or calibrated module; writes summary.json."""
        return workflows.deploy(model, datamodule, self.settings(), self.log_summary)

    def export(self, model: QuantLM, datamodule: TextDataModule, ckpt_path: str = "last") -> RunSummary:
        """Export a trained checkpoint to ``.pte`` (static KV cache), run the parity gate, write summary.json.

        Args:
            ckpt_path: Checkpoint to export: ``last`` (the run's latest) or a path.
        """
        return workflows.export(model, datamodule, self.settings(), ckpt_path, self.log_summary)

    def evaluate(
        self,
        model: QuantLM,
        datamodule: TextDataModule,
        pte: str | None = None,
        ckpt_path: str | None = None,
        tasks: str | None = None,
        limit: int | None = None,
        num_fewshot: int | None = None,
        models: str | None = None,
    ) -> dict:
        """lm-eval of a finished run: the FP model, the fake-quant model (QAT: the trained checkpoint; PTQ: the
        converted model, re-calibrated as at export) and the ``.pte``. Prints the table, writes ``eval-<UTC time>.json``
        and appends it to summary.json's ``evaluations`` (the run's own ``eval.json`` and ``eval`` stay). ``eval.*`` in the config sets the defaults of the options below.

        Args:
            pte: The ``.pte`` to evaluate (default: ``deploy.filename`` in the run directory).
            ckpt_path: QAT checkpoint for the fake-quant model: ``last`` (default) or a path (also ``--ckpt``).
            tasks: Comma-separated task names (overrides eval.tasks), e.g. ``qharness_ppl,hellaswag``.
            limit: Documents per task (overrides eval.limit).
            num_fewshot: Few-shot examples (overrides eval.num_fewshot).
            models: Comma-separated models among fp, fake_quant, converted, pte (overrides eval.models).
        """
        return workflows.evaluate(model, datamodule, self.settings(), pte, ckpt_path)  # options: in eval_config

    def sensitivity(
        self,
        model: QuantLM,
        datamodule: TextDataModule,
        candidates: str | None = None,
        unit: str = "layer",
        against: str = "fp",
    ) -> dict:
        """Per-layer quantization cost: the validation perplexity change (converted model, ``parity.eval_blocks``
        blocks, paired 95% band) of each layer or decoder block at each candidate precision. Writes sensitivity.json,
        sensitivity.md (the table) and sensitivity.png (the heat map) into the run directory; prints the table.

        Args:
            candidates: Comma-separated schemes (default: fp, 8da8w-pc, 8da4w-pc, 8da4w-g<recipe group size>).
            unit: ``layer`` (every linear) or ``block`` (a decoder layer's linears together; others alone).
            against: ``fp``: each unit quantized alone, the rest FP; ``recipe``: each unit changed alone in the
                recipe's quantized model (``fp`` = leaving it alone in floating point).
        """
        return tuning.sensitivity(model, datamodule, self.settings(), candidates, unit, against)

    def autotune(
        self,
        model: QuantLM,
        datamodule: TextDataModule,
        max_size_mb: float | None = None,
        sensitivity: str | None = None,
        candidates: str | None = None,
        unit: str = "layer",
        max_latency_ms: float | None = None,
    ) -> dict:
        """Per-layer precision under a ``.pte`` size budget and/or a decode latency budget: measure (or reuse) the
        sensitivity table against FP (and, with a latency budget, the per-layer latency table: latency.json, from
        one program per scheme timed jointly), pick each layer's scheme (exact knapsack: least summed perplexity cost
        within the budgets), write it as a recipe (``autotuned.yaml`` in the run directory), then run it like
        ``calibrate`` (``model.mode: ptq``) or ``fit`` (``qat``): ``.pte``, parity gate, summary.json; ``autotune.json``
        has the plan, predicted vs measured size (and decode latency, timed in fresh processes, with its spread).

        Args:
            max_size_mb: Budget for the ``.pte`` file, MB (1 MB = 1e6 bytes).
            max_latency_ms: Budget for decode latency, ms per token (the median over fresh processes of the
                ExecuTorch runtime, this machine; ``qharness bench --pte X.pte`` shows a program's).
            sensitivity: A ``sensitivity.json`` to use (default: the run directory's when it was measured on this
                model and these validation blocks against FP, else measured now and written there).
            candidates: Comma-separated schemes besides fp (default: 8da8w-pc, 8da4w-pc, 8da4w-g<recipe group size>).
            unit: ``layer`` (one rule per linear) or ``block`` (one per decoder block; other layers alone).
        """
        command = "qharness " + " ".join(sys.argv[1:])
        return tuning.autotune(
            model,
            datamodule,
            self.settings(),
            max_size_mb=max_size_mb,
            sensitivity=sensitivity,
            candidates=candidates,
            unit=unit,
            train=self.train_tuned,
            on_summary=self.log_summary,
            command=command,
            max_latency_ms=max_latency_ms,
        )

    def calibrate(self, model: QuantLM, datamodule: TextDataModule) -> RunSummary:
        """PTQ: calibrate the recipe's observers (``calibration.*``: blocks of training or other data), convert,
        export, lower and check the ``.pte``; writes summary.json. Needs ``model.mode: ptq``."""
        return workflows.calibrate(model, datamodule, self.settings(), self.log_summary)
