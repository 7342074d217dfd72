"""Per-step progress of training, written as it goes, and the training threads fitted to the free cores.

``StepLog`` appends one line per optimizer step to ``<run dir>/train.log`` (flushed at once, so ``tail -f`` follows a
run) and, where stderr is no terminal (a sweep's ``sweep.log``, a batch job), to stderr:

    step 3/20  loss 2.4512  41.2 s/step  cpu 38.1 s  2 threads

(wall time per step without validation, the process's CPU time over it: below the wall time x threads, the process
waited for cores). ``StepLog.summary()``: those steps' median and range and the device (the summary's ``timings``).
On CPU, unless ``QHARNESS_THREADS`` or ``OMP_NUM_THREADS`` fixes the count, it also fits torch's threads to the
cores other processes leave free (``io/cpu.OtherLoad``, measured over the steps): on a shared 2-core
machine each parallel op of 2 threads waits for a descheduled thread, which made a QAT step of SmolLM2-135M (many
element-wise fake-quantization ops) ~2x slower than with 1 thread while another job ran. The count never rises above
what training started with, and changes only after two measurements agree (each over at least ``min_window_s``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

from qharness.progress import format_seconds

LOG_NAME = "train.log"
FIXED_THREADS = ("QHARNESS_THREADS", "OMP_NUM_THREADS")  # a count the user (or a sweep) chose: left as it is


def device_name(device: torch.device) -> str:
    """``NVIDIA H200 (cuda)``, ``cpu (2 threads)``: where the steps ran."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} threads)"
    return device.type


def fitted_threads(cores: int, others: float, most: int) -> int:
    """The thread count for ``cores`` of which other processes keep ``others`` busy: the free cores, 1 to ``most``.

    >>> fitted_threads(2, 1.2, 2), fitted_threads(2, 0.3, 2), fitted_threads(16, 3.0, 8)
    (1, 2, 8)
    """
    return max(1, min(most, cores - round(others)))


class StepLog(L.Callback):
    """Per-step progress (step, loss, s/step, CPU time, threads) in ``<default_root_dir>/train.log``; the training
    threads fitted to the free cores (this module's docstring). ``fit_threads``: False leaves the thread count alone;
    ``min_window_s``: the shortest time a load measurement averages over."""

    def __init__(self, fit_threads: bool = True, min_window_s: float = 2.0, load=None):
        self.fit_threads, self.min_window_s, self._load = fit_threads, min_window_s, load
        self._file = None
        self._threads_on = False
        self._proposed: int | None = None
        self._wall: float | None = None  # set when training starts (validation before it is not counted)
        self.seconds: list[float] = []  # each optimizer step's wall time, in order (this process's steps)
        self.device: str | None = None  # where they ran (``device_name``)

    # --- the log ------------------------------------------------------------------------------
    def _write(self, text: str) -> None:
        if self._file is None:  # not global rank 0 (or not training): the other processes stay quiet
            return
        self._file.write(text + "\n")
        self._file.flush()
        if not sys.stderr.isatty():
            print(f"[qharness] {text}", file=sys.stderr, flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            root = Path(trainer.default_root_dir)
            root.mkdir(parents=True, exist_ok=True)
            self._file = open(root / LOG_NAME, "a", encoding="utf-8")  # noqa: SIM115 (closed at on_train_end)
        self._threads_on = self.fit_threads and self._fits(trainer)
        if self._threads_on:
            from qharness.io.cpu import OtherLoad, affinity

            self._cores = len(affinity())
            self._most = torch.get_num_threads()
            self._load = self._load or OtherLoad()
            self._window = time.perf_counter()
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "?"
        self._write(
            f"training from step {trainer.global_step} to {total}, {torch.get_num_threads()} threads"
            f"{' (fitted to the free cores as it goes)' if self._threads_on else ''} ({time.strftime('%Y-%m-%d %H:%M:%S')})"
        )
        self._step, self._total = trainer.global_step, total
        self.device = self.device or device_name(trainer.strategy.root_device)
        self._wall, self._cpu, self._paused = time.perf_counter(), time.process_time(), 0.0
        self._started = self._wall

    @staticmethod
    def _fits(trainer) -> bool:
        return trainer.strategy.root_device.type == "cpu" and not any(os.environ.get(k) for k in FIXED_THREADS)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._wall is not None:  # validation between steps: not a step's time
            self._paused += time.perf_counter() - self._val_start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step:  # a micro-batch of gradient accumulation: no optimizer step yet
            return
        now, cpu = time.perf_counter(), time.process_time()
        wall = now - self._wall - self._paused
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss_text = f"  loss {float(loss):.4f}" if isinstance(loss, torch.Tensor) else ""
        steps = trainer.global_step - self._step
        self.seconds += [wall / steps] * steps
        self._write(
            f"step {trainer.global_step}/{self._total}{loss_text}  {wall / steps:.2f} s/step  "
            f"cpu {(cpu - self._cpu) / steps:.2f} s  {torch.get_num_threads()} threads"
        )
        self._step, self._wall, self._cpu, self._paused = trainer.global_step, now, cpu, 0.0
        if self._threads_on and now - self._window >= self.min_window_s:
            self._window = now
            self._refit(self._load.update())

    def summary(self) -> dict | None:
        """``train_steps`` logged, ``train_step_s``: their median wall time with the first step left out (its kernels,
        allocations and caches warm up), ``train_step_s_range`` (the fastest and slowest of those), ``train_device``;
        None when no step ran. (A step's time is wall time between optimizer steps: a GPU's queued kernels are in it,
        the loss being read each step.)"""
        if not self.seconds:
            return None
        steady = self.seconds[1:] or self.seconds
        return {
            "train_steps": len(self.seconds),
            "train_step_s": statistics.median(steady),
            "train_step_s_range": [min(steady), max(steady)],
            "train_device": self.device,
        }

    def _refit(self, others: float | None) -> None:
        if others is None:
            return
        want = fitted_threads(self._cores, others, self._most)
        if want == torch.get_num_threads():
            self._proposed = None
        elif want == self._proposed:  # twice in a row: the load held
            self._write(
                f"threads {torch.get_num_threads()} -> {want}: other processes keep {others:.1f} of {self._cores} "
                "cores busy"
            )
            torch.set_num_threads(want)
            self._proposed = None
        else:
            self._proposed = want

    def on_train_end(self, trainer, pl_module) -> None:
        elapsed = format_seconds(time.perf_counter() - self._started)
        self._write(f"training ended at step {trainer.global_step} after {elapsed}")
        self._close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._write(f"training stopped at step {trainer.global_step}: {type(exception).__name__}")
        self._close()

    def _close(self) -> None:
        if self._threads_on and torch.get_num_threads() != self._most:
            torch.set_num_threads(self._most)  # what follows training (deployment) chooses its own
        self._threads_on, self._wall = False, None
        if self._file is not None:
            self._file.close()
            self._file = None
