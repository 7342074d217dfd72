"""The ``trainer`` and ``checkpoint`` fields qharness reads or sets, their qharness defaults and their rules, torch-free.

The CLI's ``trainer`` and ``checkpoint`` groups are Lightning's own ``Trainer`` and ``ModelCheckpoint``: their other
fields go to Lightning as they are (its parser checks them once it is imported). The fields here are the ones
qharness sets a default for (``QHarnessCLI`` takes them from these classes) or checks before any work: values that
Lightning takes and then refuses only when it builds the Trainer (a traceback after the model has loaded).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qharness.errors import UserError
from qharness.io.names import check_name
from qharness.schema.fields import typed

# What ``trainer.max_time`` takes as a mapping: ``datetime.timedelta``'s arguments.
_TIMEDELTA = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


@dataclass
class TrainerConfig:
    """Lightning's Trainer: the fields qharness sets a default for or checks before any work (every other field of
    ``lightning.pytorch.Trainer`` is taken as well: ``qharness fit --help``).

    Args:
        default_root_dir: The run directory: checkpoints, logs, the ``.pte``, ``summary.json``.
        max_steps: Optimizer steps to train (-1: ``max_epochs`` decides).
        max_epochs: Passes over the training split (null: as many as ``max_steps`` needs; -1: no limit).
        max_time: Stop training after this time: ``DD:HH:MM:SS`` or a mapping such as ``{hours: 12}``.
        devices: Devices per node: ``auto``, a count (-1: all) or a list of device indices.
        num_nodes: Machines taking part in distributed training.
        accelerator: ``auto``, ``cpu``, ``gpu``, ``cuda``, ``mps``.
        strategy: ``auto``, ``ddp``, ``fsdp_layers`` (FSDP2 per decoder layer; needs ``model.layerwise``), ...
        precision: ``32-true``; ``bf16-mixed`` / ``16-mixed`` (autocast; PT2E recipes only with QAT).
        accumulate_grad_batches: Batches whose gradients add up to one optimizer step.
        gradient_clip_val: Clip gradients to this norm (null: no clipping).
        val_check_interval: Validate every N training batches (an int) or fraction of an epoch (a float).
        check_val_every_n_epoch: Validate every N epochs (null: count ``val_check_interval`` across epochs).
        limit_train_batches: Training batches per epoch: a fraction or a count (null: all).
        limit_val_batches: Validation batches per check: a fraction or a count.
        limit_test_batches: Test batches: a fraction or a count (null: all).
        limit_predict_batches: Prediction batches: a fraction or a count (null: all).
        overfit_batches: Train and validate on this fraction or count of training batches (0: off).
        reload_dataloaders_every_n_epochs: Rebuild the dataloaders every N epochs (0: never).
        num_sanity_val_steps: Validation batches run before training starts.
        log_every_n_steps: Log training metrics every N steps.
        deterministic: Deterministic algorithms (``warn``: warn where there are none).
        use_distributed_sampler: Lightning's distributed sampler; off: qharness's data shards batches across ranks
            itself, resumable.
    """

    default_root_dir: str | None = "runs/default"
    max_steps: int = 100
    max_epochs: int | None = None
    max_time: str | dict | None = None
    devices: int | str | list[int] = "auto"
    num_nodes: int = 1
    accelerator: str | dict = "auto"
    strategy: str | dict = "auto"
    precision: int | str | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    val_check_interval: int | float | str | dict | None = 50
    check_val_every_n_epoch: int | None = 1
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = 8
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    overfit_batches: int | float = 0.0
    reload_dataloaders_every_n_epochs: int = 0
    num_sanity_val_steps: int | None = 0
    log_every_n_steps: int | None = 10
    deterministic: bool | Literal["warn"] | None = True
    use_distributed_sampler: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """The values Lightning would take and then fail on (late, as a traceback) or misuse, and a run directory
        that cannot be written."""
        typed(self, "trainer")
        for name, least in (("num_nodes", 1), ("accumulate_grad_batches", 1), ("reload_dataloaders_every_n_epochs", 0)):
            if getattr(self, name) < least:
                raise UserError(
                    f"trainer.{name} must be >= {least} (got {getattr(self, name):g})",
                    fix=f"e.g. trainer.{name}: {least}",
                )
        if self.max_steps == 0 or self.max_steps < -1:
            raise UserError(
                f"trainer.max_steps must be positive, or -1 to use trainer.max_epochs (got {self.max_steps:g})",
                fix="e.g. trainer.max_steps: 100",
            )
        if self.max_epochs is not None and (self.max_epochs == 0 or self.max_epochs < -1):
            raise UserError(
                f"trainer.max_epochs must be positive, or -1 for no limit (got {self.max_epochs:g})",
                fix="e.g. trainer.max_epochs: 1, or leave it out (trainer.max_steps decides)",
            )
        self._check_devices()
        self._check_max_time()
        if self.check_val_every_n_epoch is not None and self.check_val_every_n_epoch < 1:
            raise UserError(
                f"trainer.check_val_every_n_epoch must be >= 1 or null (got {self.check_val_every_n_epoch})",
                fix="e.g. trainer.check_val_every_n_epoch: 1",
            )
        for name in (
            "val_check_interval",
            "limit_train_batches",
            "limit_val_batches",
            "limit_test_batches",
            "limit_predict_batches",
            "overfit_batches",
        ):
            value, limit = getattr(self, name), name.startswith(("limit", "overfit"))
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # null, or a time interval (Lightning reads those)
            if not math.isfinite(value) or value < 0 or (not limit and value == 0) or (value > 1 and value % 1):
                raise UserError(
                    f"trainer.{name} must be a fraction in {'[0' if limit else '(0'}, 1] or a whole number of batches "
                    f"(got {value})",
                    fix=f"e.g. trainer.{name}: {'1.0' if limit else '50'}",
                )
        clip = self.gradient_clip_val
        if clip is not None and (not math.isfinite(clip) or clip < 0):
            raise UserError(
                f"trainer.gradient_clip_val must be a finite number >= 0 (got {clip})",
                fix="e.g. trainer.gradient_clip_val: 1.0",
            )
        check_run_dir(self.default_root_dir)

    def _check_devices(self) -> None:
        """``devices``: ``auto``, a count >= 1 (-1: all), or a non-empty list or comma-separated text of device
        indices; Lightning refuses 0, ``"0"`` and ``[]`` only when it builds the Trainer."""
        devices = self.devices
        if (
            devices == []
            or (isinstance(devices, int) and (devices == 0 or devices < -1))
            or (isinstance(devices, str) and not devices.strip())
        ):
            raise UserError(
                f"trainer.devices must be auto, a number of devices >= 1 (-1: all) or a list of device indices "
                f"(got {devices!r})",
                fix="e.g. trainer.devices: 1, or leave it out (auto)",
            )

    def _check_max_time(self) -> None:
        """``max_time``: ``DD:HH:MM:SS`` text or a mapping of ``datetime.timedelta`` arguments (as Lightning's
        ``Timer`` reads it, which fails only once the Trainer is built)."""
        max_time = self.max_time
        if max_time is None:
            return
        if isinstance(max_time, str):
            ok = re.fullmatch(r"\s*\d+:\d+:\d+:\d+\s*", max_time) is not None
        else:
            ok = isinstance(max_time, dict) and bool(max_time)
            for k, v in max_time.items() if ok else ():
                number = None if isinstance(v, bool) else _float(v)
                ok = ok and k in _TIMEDELTA and number is not None and math.isfinite(number) and number >= 0
        if not ok:
            raise UserError(
                f"trainer.max_time must be DD:HH:MM:SS or a mapping of {', '.join(_TIMEDELTA)} (got {max_time!r})",
                fix="e.g. trainer.max_time: 00:12:00:00 (12 hours), or {hours: 12}",
            )


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@dataclass
class CheckpointConfig:
    """Lightning's ModelCheckpoint, writing into ``<trainer.default_root_dir>/checkpoints``: the fields qharness sets
    a default for or checks (its other fields are taken as well: ``qharness fit --help``).

    Args:
        dirpath: Set by qharness to ``<trainer.default_root_dir>/checkpoints``; leave it out.
        filename: Checkpoint file name pattern (one plain name, e.g. ``step{step}``).
        save_last: Keep ``last.ckpt``, which ``--ckpt_path last`` resumes and exports from.
        save_top_k: Best checkpoints kept by the monitored metric (0: none besides last.ckpt, -1: all).
        every_n_train_steps: Save every N optimizer steps (0: only at the end).
    """

    dirpath: str | None = None
    filename: str | None = None
    save_last: bool | Literal["link"] | None = True
    save_top_k: int = 0
    every_n_train_steps: int | None = 50

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Values ModelCheckpoint fails on when built, and ``dirpath``, which qharness sets."""
        typed(self, "checkpoint")
        if self.dirpath is not None:
            raise UserError(
                f"checkpoint.dirpath is set by qharness to <trainer.default_root_dir>/checkpoints (got {self.dirpath!r})",
                fix="leave checkpoint.dirpath out and set trainer.default_root_dir",
            )
        if self.save_top_k < -1:
            raise UserError(
                f"checkpoint.save_top_k must be >= -1 (got {self.save_top_k}; -1 keeps every checkpoint, 0 none)",
                fix="e.g. checkpoint.save_top_k: 0",
            )
        if self.every_n_train_steps is not None and self.every_n_train_steps < 0:
            raise UserError(
                f"checkpoint.every_n_train_steps must be >= 0 (got {self.every_n_train_steps})",
                fix="e.g. checkpoint.every_n_train_steps: 50 (0: only at the end)",
            )
        if self.filename is not None:  # one plain name: checkpoints stay in the run's checkpoints/
            check_name(self.filename, "checkpoint.filename", "step{step}")


def check_run_dir(root) -> None:
    """``trainer.default_root_dir`` must name a directory that can be created and written."""
    if root is None:
        return
    if not str(root).strip():
        raise UserError(
            "trainer.default_root_dir is empty (the run would write into the current directory)",
            fix="e.g. trainer.default_root_dir: runs/my_run",
        )
    check_writable_dir(Path(str(root)).expanduser(), f"trainer.default_root_dir {root}", "choose a writable directory")


def check_writable_dir(path: Path, what: str, fix: str) -> None:
    """``path`` can be created as a directory and written: its nearest existing parent is a directory where a
    temporary file can be made (``os.access`` says yes to root on a read-only place such as /proc). ``what`` names
    the setting in the error."""
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{what}: {parent} is {'a file' if parent.is_file() else 'not a directory'}", fix=fix)
            try:
                with tempfile.TemporaryFile(dir=parent):
                    pass
            except OSError as e:
                raise UserError(f"{what}: {parent} is not writable ({e.strerror})", fix=fix) from e
            return


def checkpoint_dir(run_dir: str | os.PathLike) -> str:
    """Where a run keeps its checkpoints: ``<trainer.default_root_dir>/checkpoints``."""
    return os.path.join(run_dir, "checkpoints")


def resolve_ckpt(ckpt_path: str | None, run_dir: str) -> str | None:
    """``last`` -> ``<run_dir>/checkpoints/last.ckpt``; a missing file is a clear error."""
    if ckpt_path is None:
        return None
    path = Path(checkpoint_dir(run_dir)) / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist", fix="train first (qharness fit) or pass --ckpt_path PATH")
    return str(path)
