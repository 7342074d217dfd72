"""The LightningCLI behind run configs (``qharness fit|calibrate|validate|test|export|evaluate|sensitivity|autotune``
and ``qharness.api.run_job``): typed config groups and hooks; the config checked by ``api/preflight.py`` before any
long work; the jobs themselves are ``run/workflows.py`` and ``run/tuning.py``, which ``QTrainer``'s methods
(``api/trainer.py``) call.

Config groups: ``model`` (QuantLM), ``data`` (TextDataModule), ``trainer`` (Lightning), ``checkpoint``
(ModelCheckpoint, written to ``<trainer.default_root_dir>/checkpoints``), ``deploy`` (ExportConfig),
``parity`` (ParityConfig), ``calibration`` (CalibrationConfig), ``bench`` (BenchConfig), ``eval`` (EvalConfig) and
``wandb`` (WandbConfig). The run directory is ``trainer.default_root_dir``. With ``trainer.logger`` unset, runs log
to CSV and to wandb (offline unless you have logged in; ``qharness.reporting.tracking``), and every ``.pte`` adds its final
row to the wandb run.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins import CheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from qharness.api.preflight import preflight
from qharness.api.trainer import QTrainer
from qharness.data.datamodule import TextDataModule
from qharness.errors import UserError, usage_error
from qharness.progress import lightning_progress_bar
from qharness.schema import CheckpointConfig, RunConfig, TrainerConfig
from qharness.schema.fields import field_docs
from qharness.schema.trainer import checkpoint_dir, resolve_ckpt
from qharness.training.checkpoints import AtomicCheckpointIO, SaveOnSigterm, check_resume_data, read_checkpoint
from qharness.training.module import QuantLM
from qharness.training.step_log import StepLog


class QArgumentParser(LightningArgumentParser):
    """Lightning's parser, refusing in one line with a fix (``errors.usage_error``) instead of a usage dump."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # a refusal jsonargparse catches itself (an inner parser, a union member)
            return super().error(message, ex)
        prog = getattr(getattr(ex, "subcommand_parser", None), "prog", None) or self.prog
        raise usage_error(message, prog.replace("[options]", "")) from ex


class QHarnessCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        base = LightningCLI.subcommands()
        return {k: base[k] for k in ("fit", "validate", "test")} | {
            "export": {"model", "datamodule"},
            "calibrate": {"model", "datamodule"},
            "evaluate": {"model", "datamodule"},
            "sensitivity": {"model", "datamodule"},
            "autotune": {"model", "datamodule"},
        }

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # the sections after training, from the schema (model and data: QuantLM's and TextDataModule's fields are the
        # schema's ModelConfig and DataConfig; trainer and checkpoint: Lightning's classes, with qharness's defaults)
        docs = field_docs(RunConfig)
        for name, section in RunConfig.sections().items():
            if name not in ("model", "data", "trainer", "checkpoint"):
                parser.add_class_arguments(section, name, help=docs[name])
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        defaults = {f"trainer.{k}": v for k, v in dataclasses.asdict(TrainerConfig()).items()}
        defaults |= {f"checkpoint.{k}": v for k, v in dataclasses.asdict(CheckpointConfig()).items() if k != "dirpath"}
        parser.set_defaults(defaults)  # TextDataModule shards training batches itself: use_distributed_sampler off
        parser.link_arguments("trainer.default_root_dir", "checkpoint.dirpath", compute_fn=checkpoint_dir)
        parser.link_arguments("model.checkpoint", "data.tokenizer")
        parser.link_arguments("model.trust_remote_code", "data.trust_remote_code")

    def before_instantiate_classes(self) -> None:
        """Check the config before any long work (model loading, pretraining, tokenization) starts."""
        cfg = self.config[self.subcommand]
        if self.subcommand == "evaluate":
            overrides = {
                "tasks": cfg.get("tasks"),
                "limit": cfg.get("limit"),
                "num_fewshot": cfg.get("num_fewshot"),
                "models": cfg.get("models"),
            }
            for key, value in overrides.items():
                if value is not None:
                    cfg.eval[key] = [t for t in value.split(",") if t] if key in ("tasks", "models") else value
        if self.subcommand == "sensitivity":  # its options, before the model loads
            from qharness.evaluation.sensitivity import check_options
            from qharness.recipes.registry import load_recipe

            check_options(load_recipe(cfg.model.recipe), cfg.get("candidates"), cfg.get("unit"), cfg.get("against"))
        if self.subcommand == "autotune":
            from qharness.evaluation.autotune import check_budget
            from qharness.evaluation.sensitivity import check_options
            from qharness.recipes.registry import load_recipe

            check_budget(cfg.get("max_size_mb"), cfg.get("max_latency_ms"))
            check_options(load_recipe(cfg.model.recipe), cfg.get("candidates"), cfg.get("unit"), "fp")
        preflight(cfg, self.subcommand)

    def instantiate_trainer(self, **kwargs) -> Trainer:
        """``trainer.logger`` unset: Lightning's CSV logs plus, with ``wandb.enabled``, a WandbLogger, both in the run dir."""
        cfg = self.config[self.subcommand]
        if cfg.trainer.get("logger") in (None, True) and "logger" not in kwargs:
            from lightning.pytorch.loggers import CSVLogger

            root = cfg.trainer.get("default_root_dir") or os.getcwd()
            kwargs["logger"] = [CSVLogger(save_dir=root)]
            if cfg.wandb.enabled:
                from qharness.reporting.tracking import make_wandb_logger, run_config

                name = f"{Path(cfg.model.recipe).stem}-{cfg.model.mode}"
                kwargs["logger"].append(
                    make_wandb_logger(root, cfg.wandb, name, run_config(cfg.as_dict()), job_type=self.subcommand)
                )
        trainer_cfg = self.config_init[self.subcommand]["trainer"]
        given = trainer_cfg.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        extra = [] if any(isinstance(c, StepLog) for c in given) else [StepLog()]  # train.log, fitted threads
        if trainer_cfg.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in given
        ):
            extra.append(lightning_progress_bar())  # no "Epoch 0/-2" (see qharness.progress)
        kwargs["callbacks"] = [*given, *extra]
        plugins = trainer_cfg.get("plugins") or []
        plugins = plugins if isinstance(plugins, list) else [plugins]
        if "plugins" not in kwargs and not any(isinstance(p, CheckpointIO) for p in plugins):
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]  # a kill or a full disk never truncates last.ckpt
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError) as e:  # a trainer value the checks before did not foresee
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"Lightning refused the trainer config: {first}", fix="correct that trainer field (qharness fit --help)"
            ) from e

    def _attach_configs(self) -> None:
        cfg = self.config_init[self.subcommand]
        self.trainer.export_config = cfg["deploy"]
        self.trainer.parity_config = cfg["parity"]
        self.trainer.calibration_config = cfg["calibration"]
        self.trainer.bench_config = cfg["bench"]
        self.trainer.eval_config = cfg["eval"]

    def _check_eval_text(self) -> None:
        """The run's own validation text gives the offline eval tasks their documents, and the chat settings have
        their template and conversations: checked once the data is read, before training or calibration
        (``eval.source`` was read in ``preflight``)."""
        cfg = self.trainer.eval_config
        if cfg.enabled and cfg.source is None:
            from qharness.evaluation.harness import check_eval_text

            self.datamodule.setup("fit")
            check_eval_text(cfg, self.datamodule)
        if cfg.enabled:
            from qharness.evaluation.harness import check_chat_eval

            self.datamodule.setup("fit")
            check_chat_eval(cfg, self.datamodule)

    def before_fit(self) -> None:
        self._attach_configs()
        self._check_eval_text()
        self.trainer.callbacks.append(SaveOnSigterm(Path(checkpoint_dir(self.trainer.default_root_dir)) / "last.ckpt"))
        self._default_weights_only()

    def after_fit(self) -> None:
        if self.trainer.interrupted:
            return
        self.model.steps_trained = self.trainer.global_step  # 0: nothing trained, and deploy says so
        final = Path(checkpoint_dir(self.trainer.default_root_dir)) / "last.ckpt"
        self.trainer.save_checkpoint(
            final, weights_only=False
        )  # the finished run, resumable, is safe before export starts
        self.model.gather()  # sharded training: rank 0 takes the whole graph (every process takes part)
        if self.trainer.export_config.enabled and self.trainer.is_global_zero:
            self.trainer.deploy(self.model, self.datamodule)

    def before_export(self) -> None:
        self._attach_configs()

    def before_calibrate(self) -> None:
        self._attach_configs()
        self._check_eval_text()

    def before_evaluate(self) -> None:
        self._attach_configs()

    before_sensitivity = before_evaluate

    def before_autotune(self) -> None:
        self._attach_configs()
        self._check_eval_text()
        if self.model.hparams.mode == "qat":  # it trains: as fit does
            self.trainer.callbacks.append(
                SaveOnSigterm(Path(checkpoint_dir(self.trainer.default_root_dir)) / "last.ckpt")
            )

    def before_validate(self) -> None:
        self._default_weights_only()

    before_test = before_validate

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        """Then ``--ckpt_path last`` names the run's own last.ckpt; a checkpoint of another model/recipe/mode, or an
        unreadable one, is a clear error before LightningCLI takes the checkpoint's hyperparameters."""
        super().parse_arguments(parser, args)
        sub = self.config.get("subcommand")
        if sub and self.config[sub].get("ckpt_path"):
            cfg = self.config[sub]
            cfg.ckpt_path = resolve_ckpt(cfg.ckpt_path, cfg.trainer.default_root_dir)
            ckpt = read_checkpoint(cfg.ckpt_path, cfg.model)
            if sub == "fit":  # resuming training: the same batches as before
                check_resume_data(ckpt, cfg.ckpt_path, cfg.data)

    def _default_weights_only(self) -> None:
        """Checkpoints load with ``weights_only=True`` unless the user says otherwise."""
        cfg = self.config_init[self.subcommand]
        if cfg.get("weights_only") is None:
            cfg["weights_only"] = True


def run_lightning_cli(argv: list[str]) -> QHarnessCLI:
    """Run ``argv`` (``[subcommand, --config, PATH, --field, value, ...]``) and return the CLI (its ``trainer``'s
    ``summary``: the run's summary when it deployed). ``sys.argv`` is the command's while it runs."""
    saved = sys.argv
    sys.argv = [sys.argv[0], *argv]  # LightningCLI reads sys.argv (passing args= as well makes it warn)
    try:
        return _cli()
    finally:
        sys.argv = saved


def _cli() -> QHarnessCLI:
    return QHarnessCLI(
        QuantLM,
        TextDataModule,
        trainer_class=QTrainer,
        parser_class=QArgumentParser,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": False},
        auto_configure_optimizers=False,
        seed_everything_default=1234,
    )
