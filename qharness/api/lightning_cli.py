"""The LightningCLI behind run configs (``qharness fit|calibrate|validate|test|export|evaluate|sensitivity|autotune``
and ``qharness.api.run_job``): typed config groups and hooks; the jobs themselves are ``run/workflows.py`` and
``run/tuning.py``, which ``QTrainer``'s methods call.

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

from qharness.config import (
    BenchConfig,
    CalibrationConfig,
    EvalConfig,
    ExportConfig,
    ParityConfig,
)
from qharness.data.datamodule import TextDataModule
from qharness.errors import UserError, usage_error
from qharness.io.locks import hold_run_lock
from qharness.progress import lightning_progress_bar
from qharness.run import tuning, workflows
from qharness.run.summary import RunSummary
from qharness.run.workflows import RunSettings
from qharness.schema import CheckpointConfig, RunConfig, TrainerConfig
from qharness.schema.fields import field_docs
from qharness.training import sharding  # noqa: F401  (registers --trainer.strategy fsdp_layers)
from qharness.training.checkpoints import (
    AtomicCheckpointIO,
    SaveOnSigterm,
    check_resume_data,
    checkpoint_dir,
    read_checkpoint,
    resolve_ckpt,
)
from qharness.training.module import QuantLM


def check_strategy_and_accelerator(strategy, accelerator) -> None:
    """``trainer.strategy`` and ``trainer.accelerator`` named in Lightning's registries (what it checks only when
    the Trainer is built), and the accelerator present on this machine."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    strategies = StrategyRegistry.available_strategies()
    if isinstance(strategy, str) and strategy.lower() != "auto" and strategy.lower() not in strategies:
        raise UserError(
            f"trainer.strategy {strategy!r} is not a Lightning strategy",
            fix="use auto, ddp, fsdp_layers or another name of Lightning's StrategyRegistry "
            f"({', '.join(sorted(n for n in strategies if 'unused' not in n)[:8])}, ...)",
        )
    if not isinstance(accelerator, str) or accelerator == "auto":
        return
    known = AcceleratorRegistry.available_accelerators()
    if accelerator not in ("gpu", *known):
        raise UserError(
            f"trainer.accelerator {accelerator!r} is not a Lightning accelerator",
            fix=f"use auto, gpu or one of {', '.join(known)}",
        )
    kinds = [k for k in ("cuda", "mps") if k in known] if accelerator == "gpu" else [accelerator]
    if not any(AcceleratorRegistry[k]["accelerator"].is_available() for k in kinds):
        raise UserError(
            f"trainer.accelerator {accelerator} was asked for, but this machine has no such device",
            fix="use trainer.accelerator: cpu, or auto (the best device present)",
        )


def run_config(cfg) -> RunConfig:
    """The parsed config (a jsonargparse namespace) as the schema's ``RunConfig``, each section built and checked
    (``checkpoint.dirpath`` left out: qharness links it to the run directory)."""
    values = cfg.as_dict()
    values["checkpoint"] = {k: v for k, v in (values.get("checkpoint") or {}).items() if k != "dirpath"}
    return RunConfig.from_dict(values)


def preflight(cfg, subcommand: str | None = None) -> None:
    """Bad input found from the config alone: one clear error (exit 2) instead of a failure hours later."""
    run_config(cfg).validate(subcommand)  # every rule of the schema, as the pre-check ran them before torch loaded
    seq_len, deploy = cfg.data.seq_len, cfg.deploy
    check_strategy_and_accelerator(cfg.trainer.get("strategy"), cfg.trainer.get("accelerator"))
    if cfg.calibration.source is not None:  # a missing path, a FIFO, empty files: now, not after training
        from qharness.sources.text import local_files

        local_files(cfg.calibration.source, "calibration.source")
    if cfg.eval.enabled or subcommand == "evaluate":
        from qharness.evaluation.harness import check_eval_config

        check_eval_config(cfg.eval, seq_len, deploy.max_seq_len)
    if subcommand in (
        "fit",
        "calibrate",
        "export",
        "evaluate",
        "sensitivity",
        "autotune",
    ):  # they write into the run directory
        hold_run_lock(cfg.trainer.default_root_dir)
    from qharness.deploy.architectures import check_architecture, load_config
    from qharness.deploy.memory import check_deploy_memory, check_training_memory
    from qharness.recipes.registry import load_recipe
    from qharness.sources.embedded import embedded_config
    from qharness.sources.models import EMBEDDED, resolve_checkpoint

    # a model that cannot be exported, quantized by the recipe (every projection) and lowered fails here, before any
    # training or calibration (a one-layer copy deployed as the run will deploy it; cached per model and recipe)
    embedded = cfg.model.checkpoint == EMBEDDED  # its config is known before it is pretrained
    deploys = subcommand == "export" or (subcommand in ("fit", "calibrate", None) and deploy.enabled)
    recipe = load_recipe(cfg.model.recipe) if deploys else None
    source = None if embedded else resolve_checkpoint(cfg.model.checkpoint)
    config = embedded_config() if embedded else load_config(source, cfg.model.trust_remote_code)
    if not embedded and cfg.deploy.enabled:  # the .pte's KV cache within the model's context: now, not after training
        from qharness.run.pipeline import check_export_config

        check_export_config(cfg.deploy, seq_len, _context(source))
    if cfg.deploy.enabled or subcommand == "export":  # a KV cache the machine cannot hold, before any work
        check_deploy_memory(config, cfg.deploy.max_seq_len)
    if subcommand == "fit" or (subcommand == "autotune" and cfg.model.mode == "qat"):  # a step it cannot hold
        check_training_memory(config, cfg.data.batch_size, seq_len)
    if not embedded or recipe is not None:  # the embedded Llama itself always exports
        check_architecture(
            EMBEDDED if embedded else source,
            cfg.model.trust_remote_code,
            recipe=recipe,
            max_seq_len=deploy.max_seq_len,
            config=embedded_config() if embedded else None,
        )


def _context(model_dir: str) -> int | None:
    """``max_position_embeddings`` from a local model's config.json (its text config's for a multimodal model);
    None for a hub id or when it is not there."""
    import json

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    value = text.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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
    ) -> dict:
        """Per-layer precision under a ``.pte`` size budget: measure (or reuse) the sensitivity table against FP, pick
        each layer's scheme (exact knapsack: least summed perplexity cost within the budget), write it as a recipe
        (``autotuned.yaml`` in the run directory), then run it like ``calibrate`` (``model.mode: ptq``) or ``fit``
        (``qat``): ``.pte``, parity gate, summary.json; ``autotune.json`` has the plan, predicted vs measured size.

        Args:
            max_size_mb: Budget for the ``.pte`` file, MB (1 MB = 1e6 bytes).
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
            max_size_mb,
            sensitivity,
            candidates,
            unit,
            self.train_tuned,
            self.log_summary,
            command,
        )

    def calibrate(self, model: QuantLM, datamodule: TextDataModule) -> RunSummary:
        """PTQ: calibrate the recipe's observers (``calibration.*``: blocks of training or other data), convert,
        export, lower and check the ``.pte``; writes summary.json. Needs ``model.mode: ptq``."""
        return workflows.calibrate(model, datamodule, self.settings(), self.log_summary)


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

            check_budget(cfg.get("max_size_mb"))
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
        if trainer_cfg.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in given
        ):
            kwargs["callbacks"] = [*given, lightning_progress_bar()]  # no "Epoch 0/-2" (see qharness.progress)
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
        """The run's own validation text gives the offline eval tasks their documents: checked once the data is
        read, before training or calibration (``eval.source`` was read in ``preflight``)."""
        cfg = self.trainer.eval_config
        if cfg.enabled and cfg.source is None:
            from qharness.evaluation.harness import check_eval_text

            self.datamodule.setup("fit")
            check_eval_text(cfg, self.datamodule)

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
