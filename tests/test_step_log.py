"""training/step_log.py: per-step progress in the run's train.log as training goes; training threads fitted to the
cores other processes leave free; io/cpu.py's load measurement."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from qharness.io.cpu import OtherLoad, ticks
from qharness.training.step_log import LOG_NAME, StepLog, fitted_threads

pytestmark = pytest.mark.fast


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    gen = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen)), batch_size=4)


def test_every_optimizer_step_is_a_line_of_train_log(tmp_path):
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        accumulate_grad_batches=2,  # a line per optimizer step, not per micro-batch
        val_check_interval=2,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[log := StepLog(fit_threads=False)],
    )
    trainer.fit(_Tiny(), _loader(), _loader())
    lines = (tmp_path / LOG_NAME).read_text().splitlines()
    assert lines[0].startswith("training from step 0 to 3, ")
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"]
    pattern = r"step \d/3  loss \d+\.\d{4}  \d+\.\d\d s/step  cpu \d+\.\d\d s  \d+ threads"
    assert all(re.fullmatch(pattern, line) for line in steps), steps
    assert lines[-1].startswith("training ended at step 3 after ")
    got = log.summary()  # what summary.json's timings take: the logged steps' median, the first left out
    assert got["train_steps"] == 3 and got["train_device"] == f"cpu ({torch.get_num_threads()} threads)", got
    assert 0 < got["train_step_s_range"][0] <= got["train_step_s"] <= got["train_step_s_range"][1], got


def test_the_summary_leaves_the_first_step_out():
    log = StepLog(fit_threads=False)
    assert log.summary() is None  # no step ran
    log.seconds, log.device = [5.0, 1.0, 1.5], "NVIDIA H200 (cuda)"
    assert log.summary() == {
        "train_steps": 3,
        "train_step_s": 1.25,
        "train_step_s_range": [1.0, 1.5],
        "train_device": "NVIDIA H200 (cuda)",
    }


def test_threads_follow_the_free_cores_once_two_measurements_agree():
    assert [fitted_threads(2, o, 2) for o in (0.0, 0.4, 0.6, 1.4, 2.0)] == [2, 2, 1, 1, 1]
    assert fitted_threads(16, 2.0, 8) == 8  # never more than training started with

    log = StepLog()
    log._threads_on, log._cores, log._most = True, 2, 2
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        log._refit(1.3)
        assert torch.get_num_threads() == 2  # one measurement: a passing spike
        log._refit(1.2)
        assert torch.get_num_threads() == 1
        log._refit(0.1)
        log._refit(None)  # no /proc/stat: nothing changes
        assert torch.get_num_threads() == 1
        log._refit(0.2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_fixed_thread_counts_are_left_alone(monkeypatch):
    from types import SimpleNamespace

    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    monkeypatch.delenv("QHARNESS_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert StepLog._fits(trainer)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a sweep's runs get their share of the cores so
    assert not StepLog._fits(trainer)


def test_other_load_is_the_cores_busy_time_less_this_process():
    stat = "cpu  1 0 1 1 0 0 0 0 0 0\ncpu0 {} 0 0 {} 0 0 0 0 0 0\ncpu1 {} 0 0 {} 0 0 0 0 0 0\n"
    samples = iter([stat.format(0, 0, 0, 0), stat.format(10**6, 0, 10**6, 0)])
    load = OtherLoad(cpus=[0, 1], read=lambda: ticks([0, 1], next(samples)))
    assert load.update() == 2.0  # both cores fully busy (this process: a fraction of that), at most the 2 cores
    assert ticks([1], stat.format(5, 6, 7, 8)) == {1: (8, 15)}
