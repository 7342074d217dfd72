"""The checks of a parsed run config before any long work (``QHarnessCLI.before_instantiate_classes`` runs them):
the schema's ``RunConfig.validate``, then what needs Lightning or the machine (strategy and accelerator registries,
files, the run lock, memory, the architecture check). Each failure is one ``UserError`` line (exit 2).
"""

from __future__ import annotations

from pathlib import Path

from qharness.errors import UserError
from qharness.io.locks import hold_run_lock
from qharness.schema import RunConfig
from qharness.training import sharding  # noqa: F401  (registers --trainer.strategy fsdp_layers)


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
    from qharness.sources.text import local_files

    # a missing path, a FIFO, empty files, a file type no reader takes: now, not after the model loads and is checked
    local_files(cfg.data.source, "data.source")
    if cfg.calibration.source is not None:
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
    from qharness.sources.models import EMBEDDED, EMBEDDED_MODELS, resolve_checkpoint

    # a model that cannot be exported, quantized by the recipe (every projection) and lowered fails here, before any
    # training or calibration (a one-layer copy deployed as the run will deploy it; cached per model and recipe)
    embedded = cfg.model.checkpoint in EMBEDDED_MODELS  # its config is known before it is built
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
    if subcommand in ("fit", "calibrate", "export", "evaluate", "sensitivity", "autotune"):
        check_data(cfg, subcommand)  # lengths and trainer intervals, from the tokenizer alone: before any model loads
    if not embedded or recipe is not None:  # the embedded Llama itself always exports
        check_architecture(
            EMBEDDED if embedded else source,
            cfg.model.trust_remote_code,
            recipe=recipe,
            max_seq_len=deploy.max_seq_len,
            config=embedded_config() if embedded else None,
        )


def check_data(cfg, subcommand: str | None) -> None:
    """The data read and tokenized as the run will (the token cache makes the run's own reading instant): a split
    shorter than a batch, chat data without trained targets, and (``fit``) a ``trainer.val_check_interval`` beyond an
    epoch's batches are one line now, not after the model has loaded."""
    import types

    from qharness.data.datamodule import TextDataModule, check_val_interval

    dm = TextDataModule(**{**cfg.data.as_dict(), "tokenizer": cfg.model.checkpoint})
    dm.setup()
    if subcommand == "fit":
        t = cfg.trainer
        trainer = types.SimpleNamespace(
            val_check_interval=t.get("val_check_interval"),
            limit_train_batches=t.get("limit_train_batches"),
            check_val_every_n_epoch=t.get("check_val_every_n_epoch", 1),
        )
        check_val_interval(trainer, len(dm.train_x) // dm.batch_size)  # one process's share (DDP: checked again)


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
