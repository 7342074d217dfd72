"""The LightningCLI behind ``qharness fit|validate|test|export``: typed config groups and hooks.

Config groups: ``model`` (QuantLM), ``data`` (TextDataModule), ``trainer`` (Lightning), ``checkpoint``
(ModelCheckpoint, written to ``<trainer.default_root_dir>/checkpoints``), ``deploy`` (ExportConfig),
``parity`` (ParityConfig), ``calibration`` (CalibrationConfig), ``bench`` (BenchConfig), ``eval`` (EvalConfig) and
``wandb`` (WandbConfig). The run directory is ``trainer.default_root_dir``. With ``trainer.logger`` unset, runs log
to CSV and to wandb (offline unless you have logged in; ``qharness.reporting.tracking``), and every ``.pte`` adds its final
row to the wandb run.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from qharness.cli.args import usage_error
from qharness.cli.precheck import check_across_sections, check_checkpoint, check_run_dir, check_trainer
from qharness.config import (
    BenchConfig,
    CalibrationConfig,
    EvalConfig,
    ExportConfig,
    ParityConfig,
    WandbConfig,
    check_lengths,
)
from qharness.data.datamodule import TextDataModule
from qharness.errors import UserError
from qharness.io import hold_run_lock, torch_save_atomic
from qharness.progress import lightning_progress_bar
from qharness.training import sharding  # noqa: F401  (registers --trainer.strategy fsdp_layers)
from qharness.training.module import QuantLM
from qharness.training.weights import check_finite_state

log = logging.getLogger("qharness")


def checkpoint_dir(run_dir: str | os.PathLike) -> str:
    return os.path.join(run_dir, "checkpoints")


def resolve_ckpt(ckpt_path: str | None, run_dir: str) -> str | None:
    """``last`` -> ``<run_dir>/checkpoints/last.ckpt``; a missing file is a clear error."""
    if ckpt_path is None:
        return None
    path = Path(checkpoint_dir(run_dir)) / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist", fix="train first (qharness fit) or pass --ckpt_path PATH")
    return str(path)


def read_checkpoint(ckpt_path: str, model_cfg) -> dict:
    """Load a checkpoint (``weights_only=True``) and check it was trained for this model, recipe and mode
    (``model_cfg``: the ``model`` config group, or a module's ``hparams``)."""
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise UserError(
            f"checkpoint {ckpt_path} cannot be read ({type(e).__name__})",
            fix="pass a Lightning .ckpt written by qharness",
        ) from e
    saved = ckpt.get("hyper_parameters", {}) if isinstance(ckpt, dict) else {}
    if "state_dict" not in ckpt or not saved:
        raise UserError(f"checkpoint {ckpt_path} is not a qharness training checkpoint")
    for key in ("checkpoint", "recipe", "mode"):
        if key in saved and saved[key] != model_cfg[key]:
            raise UserError(
                f"checkpoint {ckpt_path} was trained with model.{key}={saved[key]!r}, this config has {model_cfg[key]!r}",
                fix="use the config the checkpoint was trained with",
            )
    if _lora(saved.get("lora")) != _lora(model_cfg.get("lora")):  # adapters are part of the trained state
        raise UserError(
            f"checkpoint {ckpt_path} was trained with model.lora={saved.get('lora')!r}, this config has "
            f"{_lora(model_cfg.get('lora'))!r}",
            fix="use the model.lora the checkpoint was trained with",
        )
    check_finite_state(ckpt["state_dict"], f"checkpoint {ckpt_path}")
    return ckpt


# the data settings that decide a resumed run's batches (``ResumableShuffle``): they must be the checkpoint's
RESUME_DATA = ("seq_len", "batch_size")


def check_resume_data(ckpt: dict, ckpt_path: str, data_cfg) -> None:
    """Resuming training (``fit --ckpt_path``) from ``ckpt``: ``data.seq_len``/``data.batch_size`` must be the ones it
    was trained with (Lightning stores them as ``datamodule_hyper_parameters``), else one line before training; a
    checkpoint without them is resumed with a warning that they cannot be checked."""
    saved = ckpt.get("datamodule_hyper_parameters")
    if not isinstance(saved, dict) or not all(k in saved for k in RESUME_DATA):
        log.warning(
            "checkpoint %s does not record its data layout (data.%s): resuming without checking it",
            ckpt_path,
            ", data.".join(RESUME_DATA),
        )
        return
    for key in RESUME_DATA:
        if saved[key] != data_cfg[key]:
            raise UserError(
                f"checkpoint {ckpt_path} was trained with data.{key}={saved[key]!r}, this config has {data_cfg[key]!r}"
                " (a resumed run must see the batches it was trained on)",
                fix=f"resume with data.{key}: {saved[key]!r}, or start a new run (another trainer.default_root_dir, "
                "no --ckpt_path)",
            )


def _lora(value) -> dict | None:
    """``model.lora`` as plain data (a config group, a dict, a ``LoRA`` or None), for comparing."""
    from qharness.training.model_args import LoRA

    if value is None:
        return None
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    return (value if isinstance(value, LoRA) else LoRA(**dict(value))).record()


def load_checkpoint(module: QuantLM, dm: TextDataModule, ckpt_path: str) -> None:
    """Rebuild the prepared graph and load trained weights/observer state (``weights_only=True``)."""
    ckpt = read_checkpoint(ckpt_path, module.hparams)
    module.build(dm.batch_size, dm.seq_len)
    module.load_trained_state(ckpt["state_dict"], f"checkpoint {ckpt_path}")
    module.steps_trained = ckpt.get("global_step")


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


def preflight(cfg, subcommand: str | None = None) -> None:
    """Bad input found from the config alone: one clear error (exit 2) instead of a failure hours later."""
    if cfg.data.seq_len < 2 or cfg.data.batch_size < 1:
        raise UserError(
            f"data.seq_len must be at least 2 and data.batch_size positive (got {cfg.data.seq_len}, {cfg.data.batch_size})"
        )
    seq_len, deploy, par = cfg.data.seq_len, cfg.deploy, cfg.parity
    check_across_sections(  # each section checked its own fields when it was built (qharness/config.py)
        seq_len,
        cfg.data.batch_size,
        deploy.max_seq_len,
        par.eval_blocks,
        par.prompt_len,
        par.decode_steps,
    )
    check_trainer(cfg.trainer.as_dict())  # the pre-check's checks, on the parsed sections
    check_checkpoint({k: v for k, v in cfg.checkpoint.as_dict().items() if k != "dirpath"})  # dirpath: linked
    check_strategy_and_accelerator(cfg.trainer.get("strategy"), cfg.trainer.get("accelerator"))
    if subcommand == "fit" or (subcommand == "autotune" and cfg.model.mode == "qat"):
        check_trains(cfg.trainer)
    check_run_dir(cfg.trainer.default_root_dir)
    if cfg.deploy.enabled and cfg.bench.enabled:
        check_lengths(cfg.bench.prompt_len, cfg.bench.decode_tokens, cfg.bench.reps, cfg.deploy.max_seq_len)
    if cfg.trainer.get("strategy") == "fsdp_layers":
        from qharness.training.model_args import check_model_args

        m = cfg.model
        check_model_args(
            m.recipe,
            m.mode,
            m.lr,
            m.warmup_steps,
            layerwise=m.layerwise,
            strategy="fsdp_layers",
            weight_decay=m.weight_decay,
        )
    if cfg.model.get("distill") is not None:
        from qharness.training.model_args import Distill

        Distill(**cfg.model.distill.as_dict())  # its own field checks, as one line (jsonargparse would wrap them)
    if cfg.model.get("lora") is not None:
        from qharness.training.model_args import LoRA

        LoRA(**cfg.model.lora.as_dict())
    if cfg.model.mode == "qat" and str(cfg.trainer.precision or "32-true") not in ("32", "32-true"):
        from qharness.recipes.registry import load_recipe
        from qharness.training.model_args import check_precision

        check_precision(cfg.trainer.precision, load_recipe(cfg.model.recipe), cfg.model.mode)
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


def check_trains(trainer) -> None:
    """A training run whose trainer settings alone train no step (``limit_train_batches: 0``; ``max_epochs: 0`` is
    the pre-check's, ``precheck.check_trainer``): one line before anything loads, instead of a run reported and
    shipped as trained."""
    value = trainer.get("limit_train_batches")
    if value is not None and not isinstance(value, bool) and value == 0:
        raise UserError(
            f"trainer.limit_train_batches={value} trains no step: the run would be reported and shipped as trained",
            fix="leave trainer.limit_train_batches out or make it positive; for a .pte without training use qharness "
            "calibrate with model.mode: ptq",
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


def init_args(module: QuantLM) -> dict:
    """The arguments ``module`` was made with (its hyperparameters, without what Lightning adds)."""
    import inspect

    names = set(inspect.signature(QuantLM.__init__).parameters) - {"self"}
    return {k: v for k, v in module.hparams.items() if k in names}


class SaveOnSigterm(Callback):
    """On SIGTERM (a scheduler's pre-emption), save ``last.ckpt`` at the batch boundary where Lightning stops,
    so nothing since the last periodic checkpoint is lost; ``--ckpt_path last`` resumes from it."""

    def __init__(self, path: Path):
        self.path = path

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, SIGTERMException) and trainer.global_step > 0:
            if trainer.fit_loop.epoch_loop.batch_progress.current.completed % trainer.accumulate_grad_batches:
                # mid gradient accumulation: a checkpoint here would resume out of step; keep the last one
                log.warning("SIGTERM during gradient accumulation: keeping the last step-boundary checkpoint")
                return
            trainer.save_checkpoint(self.path, weights_only=False)  # the full state (optimizer, loops): resumable


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written as every qharness output is (``qharness.io.torch_save_atomic``): under a temporary name
    beside ``last.ckpt``, fsynced, then renamed. Lightning's own writer stages the file in the system temp dir and
    copies it over the old one when that is another device, so a full disk there truncated the last good checkpoint;
    here a failed write leaves it whole and ends in one ``DiskFullError`` line."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's fsspec writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        torch_save_atomic(checkpoint, path)


class QTrainer(Trainer):
    """Lightning's Trainer plus ``export`` and ``calibrate``. The CLI hands it the export, parity and bench configs."""

    export_config: ExportConfig = ExportConfig()
    parity_config: ParityConfig = ParityConfig()
    calibration_config: CalibrationConfig = CalibrationConfig()
    bench_config: BenchConfig = BenchConfig()
    eval_config: EvalConfig = EvalConfig()

    def deploy(self, model: QuantLM, datamodule: TextDataModule) -> dict:
        """``deploy_and_check``, then the run's final row to wandb (a failed parity gate's row too)."""

        from qharness.errors import ParityError
        from qharness.reporting.tracking import log_final_row
        from qharness.run.from_lightning import held_out, trained
        from qharness.run.pipeline import deploy_and_check

        run_dir = Path(self.default_root_dir)
        if model.hparams.mode == "qat" and model.steps_trained == 0:
            raise UserError(
                "the QAT run trained 0 steps (e.g. trainer.limit_train_batches gave no batches): its .pte would be "
                "labelled QAT without any quantization-aware training; nothing was exported",
                fix="train at least one step (trainer.max_steps, trainer.limit_train_batches), or use qharness calibrate "
                "with model.mode: ptq",
            )
        try:
            summary = deploy_and_check(
                trained(model),
                held_out(datamodule, self.parity_config, self.calibration_config, self.eval_config),
                run_dir,
                self.export_config,
                self.parity_config,
                self.bench_config,
                self.eval_config,
            )
        except ParityError:
            from qharness.run.summary import RunSummary

            log_final_row(self.loggers, RunSummary.read(run_dir / "summary.json").to_dict())
            raise
        log_final_row(self.loggers, summary)
        return summary

    def export(self, model: QuantLM, datamodule: TextDataModule, ckpt_path: str = "last") -> dict:
        """Export a trained checkpoint to ``.pte`` (static KV cache), run the parity gate, write summary.json.

        Args:
            ckpt_path: Checkpoint to export: ``last`` (the run's latest) or a path.
        """
        datamodule.setup("fit")
        load_checkpoint(model, datamodule, resolve_ckpt(ckpt_path, self.default_root_dir))
        return self.deploy(model, datamodule)

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

        from qharness.checks.parity import fold_constants
        from qharness.run.from_lightning import held_out, trained
        from qharness.run.pipeline import deploy_graph, evaluate_run, with_gptq

        cfg = self.eval_config
        run_dir = Path(self.default_root_dir)
        pte_path = Path(pte) if pte else run_dir / self.export_config.filename
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
            load_checkpoint(model, datamodule, resolve_ckpt(ckpt_path or "last", self.default_root_dir))
        run, data = trained(model), held_out(datamodule, self.parity_config, self.calibration_config, cfg)
        converted = None
        if "converted" in cfg.models or (not qat and "fake_quant" in cfg.models):
            run = with_gptq(run, data.calibration)  # PTQ by GPTQ: the deployed weights are GPTQ's, as at export
            converted = fold_constants(deploy_graph(run, data.calibration, self.export_config.max_seq_len))
        # beside the run's own eval.json, never over it: each evaluation has its own file and summary entry
        filename = time.strftime("eval-%Y%m%d-%H%M%S.json", time.gmtime())
        result = evaluate_run(
            run, data, run.fp_model, converted, pte_path if "pte" in cfg.models else None, run_dir, cfg, filename
        )
        summary_path = run_dir / "summary.json"
        if summary_path.is_file():
            from qharness.run.summary import RunSummary

            sha = RunSummary.read(summary_path).pte.get("sha256") if "pte" in cfg.models else None
            RunSummary.update(summary_path, evaluations=[{**result, "file": filename, "pte_sha256": sha}])
        return result

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
        from qharness.evaluation.sensitivity import check_options
        from qharness.run.from_lightning import held_out

        names = check_options(model.recipe, candidates, unit, against)
        datamodule.setup("fit")
        data = held_out(datamodule, self.parity_config, self.calibration_config)
        fp_model, _ = model.load_fp()
        return self._sensitivity_table(model, fp_model, data, names, unit, against)

    def _sensitivity_table(self, model: QuantLM, fp_model, data, names: list[str], unit: str, against: str) -> dict:
        """Measure the sensitivity table of ``fp_model`` on the held-out ``data``, record which model and blocks it
        was measured on, write sensitivity.json/.md/.png into the run directory and print the table."""
        from qharness.evaluation.sensitivity import format_table, measure, write_outputs
        from qharness.run.pipeline import validation_blocks_id

        result = measure(fp_model, model.recipe, data.x, data.y, data.batch_size, names, unit, against)
        result.update(model=model.hparams.checkpoint, val_blocks=validation_blocks_id(data.x, data.y))
        paths = write_outputs(result, Path(self.default_root_dir))
        print(format_table(result))
        print(f"written: {paths['json']}, {paths['table']}, {paths['png']}")
        return result

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
        import json

        from qharness.evaluation import autotune as at
        from qharness.evaluation.sensitivity import check_options, scheme_recipe, unit_sizes
        from qharness.run.from_lightning import held_out
        from qharness.run.pipeline import validation_blocks_id

        budget = at.check_budget(max_size_mb)
        names = check_options(model.recipe, candidates, unit, "fp")
        run_dir = Path(self.default_root_dir)
        scheme = scheme_recipe(model.recipe, "fp")
        datamodule.setup("fit")
        data = held_out(datamodule, self.parity_config, self.calibration_config)
        fp_model, _ = model.load_fp()
        settings, seq = scheme.settings, self.export_config.max_seq_len
        sizes = {"units": unit_sizes(fp_model, model.recipe, names, unit)}
        rest = at.rest_bytes(fp_model, sizes, seq, settings.embedding_bits, settings.group_size)
        at.check_fits(sizes, budget, rest)  # before any measuring: a budget nothing fits fails now
        val = validation_blocks_id(data.x, data.y)
        path = Path(sensitivity) if sensitivity else run_dir / "sensitivity.json"
        table = None
        if path.is_file():
            table = json.loads(path.read_text())
            why = at.table_matches(table, model.hparams.checkpoint, len(data.x), data.seq_len, val, unit)
            if why and sensitivity:
                raise UserError(
                    f"--sensitivity {path} does not fit this config: {why}",
                    fix="leave --sensitivity out (autotune measures the table), or measure it with this config",
                )
            print(f"[autotune] {path}: " + (f"not reused ({why}); measuring again" if why else "reused"), flush=True)
            table = None if why else table
        elif sensitivity:
            raise UserError(f"--sensitivity {path} does not exist", fix="run qharness sensitivity CONFIG first")
        if table is None:
            table = self._sensitivity_table(model, fp_model, data, names, unit, "fp")
        del fp_model
        command = "qharness " + " ".join(sys.argv[1:])
        recipe_path = run_dir / at.RECIPE_FILE
        base = model.hparams.recipe if scheme is model.recipe else scheme.name
        base = str(Path(base).resolve()) if Path(base).suffix in (".yaml", ".yml") else base
        correction, plan, summary = 0, None, None
        for attempt in (1, 2):
            plan = at.choose(table, budget, rest + correction)
            at.check_not_all_fp(plan)
            print(at.format_plan(plan, table), flush=True)
            at.write_recipe(plan, recipe_path, base, command)
            print(f"[autotune] recipe written: {recipe_path}", flush=True)
            tuned = QuantLM(**{**init_args(model), "recipe": str(recipe_path)})
            if tuned.hparams.mode == "qat":
                self.fit(tuned, datamodule)
                tuned.steps_trained = self.global_step
                self.save_checkpoint(Path(checkpoint_dir(run_dir)) / "last.ckpt", weights_only=False)
                tuned.gather()
            summary = self.deploy(tuned, datamodule)
            measured = summary["pte"]["size_bytes"]
            print(
                f"[autotune] .pte size: predicted {plan.predicted_bytes:,} bytes, measured {measured:,} "
                f"({(measured - plan.predicted_bytes) / plan.predicted_bytes:+.2%}); budget {budget:,}",
                flush=True,
            )
            if measured <= budget or attempt == 2 or tuned.hparams.mode == "qat":
                break
            correction = measured - plan.predicted_bytes
            print(f"[autotune] over the budget: planning again with the rest corrected by {correction:+,} bytes")
        ppl = summary["metrics"]["pte"]["ppl"]
        record = {
            **plan.to_dict(),
            "command": command,
            "recipe": str(recipe_path),
            "sensitivity": str(path) if sensitivity or (run_dir / "sensitivity.json").is_file() else None,
            "measured_size_bytes": measured,
            "measured_ppl_pte": ppl,
            "rest_correction_bytes": correction,
            "within_budget": measured <= budget,
        }
        from qharness.io import write_json_atomic

        write_json_atomic(run_dir / at.PLAN_FILE, record)
        print(
            f"[autotune] .pte ppl {ppl:.3f} (predicted {plan.predicted_ppl:.3f}); plan: {run_dir / at.PLAN_FILE}; "
            f"run it again: qharness {'fit' if model.hparams.mode == 'qat' else 'calibrate'} CONFIG --model.recipe {recipe_path}"
        )
        if measured > budget:
            raise UserError(
                f"the .pte is {measured:,} bytes, over --max_size_mb {budget / 1e6:g} (predicted {plan.predicted_bytes:,})",
                fix=f"lower --max_size_mb by about {(measured - budget) / 1e6:.3f}, or edit {recipe_path} and run it "
                "with qharness calibrate",
            )
        return record

    def calibrate(self, model: QuantLM, datamodule: TextDataModule) -> dict:
        """PTQ: calibrate the recipe's observers (``calibration.*``: blocks of training or other data), convert,
        export, lower and check the ``.pte``; writes summary.json. Needs ``model.mode: ptq``."""
        if model.hparams.mode != "ptq":
            raise UserError(
                f"calibrate needs model.mode: ptq (got {model.hparams.mode!r})",
                fix="set --model.mode ptq, or use qharness fit for QAT",
            )
        datamodule.setup("fit")
        return self.deploy(model, datamodule)


class QArgumentParser(LightningArgumentParser):
    """Lightning's parser, refusing in one line with a fix (``cli.args.usage_error``) instead of a usage dump."""

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
        parser.add_class_arguments(ExportConfig, "deploy", help="Deployment to .pte")
        parser.add_class_arguments(ParityConfig, "parity", help="Parity gate of the .pte")
        parser.add_class_arguments(CalibrationConfig, "calibration", help="Calibration data")
        parser.add_class_arguments(BenchConfig, "bench", help="Benchmark of the .pte vs the eager FP model")
        parser.add_class_arguments(EvalConfig, "eval", help="lm-eval evaluation of the FP, fake-quant and .pte models")
        parser.add_class_arguments(WandbConfig, "wandb", help="Weights & Biases logging (offline by default)")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.save_last": True,
                "checkpoint.every_n_train_steps": 50,
                "checkpoint.save_top_k": 0,
                "trainer.default_root_dir": "runs/default",
                "trainer.max_steps": 100,
                "trainer.val_check_interval": 50,
                "trainer.limit_val_batches": 8,
                "trainer.num_sanity_val_steps": 0,
                "trainer.log_every_n_steps": 10,
                "trainer.deterministic": True,
                # TextDataModule shards training batches across DDP ranks itself (resumable, see data.py)
                "trainer.use_distributed_sampler": False,
            }
        )
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


def run_lightning_cli(argv: list[str]) -> None:
    sys.argv = [sys.argv[0], *argv]  # LightningCLI reads sys.argv (passing args= as well makes it warn)
    QHarnessCLI(
        QuantLM,
        TextDataModule,
        trainer_class=QTrainer,
        parser_class=QArgumentParser,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": False},
        auto_configure_optimizers=False,
        seed_everything_default=1234,
    )
