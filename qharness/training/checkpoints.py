"""Training checkpoints: where a run keeps them, reading one back (``weights_only``) only when it was trained for this
model, recipe, mode and data layout, writing them atomically, and saving one on SIGTERM."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from qharness.data.datamodule import TextDataModule
from qharness.errors import UserError
from qharness.io.atomic import torch_save_atomic
from qharness.schema.model import ModelConfig
from qharness.training.module import QuantLM
from qharness.training.weights import check_finite_state

log = logging.getLogger("qharness")


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
    from qharness.schema import LoRA

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


def init_args(module: QuantLM) -> dict:
    """The arguments ``module`` was made with (its hyperparameters, without what Lightning adds)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
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
    """Checkpoints written as every qharness output is (``qharness.io.atomic.torch_save_atomic``): under a temporary name
    beside ``last.ckpt``, fsynced, then renamed. Lightning's own writer stages the file in the system temp dir and
    copies it over the old one when that is another device, so a full disk there truncated the last good checkpoint;
    here a failed write leaves it whole and ends in one ``DiskFullError`` line."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: Lightning's fsspec writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        torch_save_atomic(checkpoint, path)
