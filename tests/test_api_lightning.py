"""``qharness.QuantizationCallback`` in the user's own LightningModule: the example run verbatim (slow); in the default
suite the callback's preparing at setup, training through validation, SIGTERM save, atomic checkpoints,
``fit(ckpt_path=...)`` resume, the export call after fit, and its one-line errors before training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import lightning as L
import pytest
import torch
from conftest import ROOT
from torch.utils.data import DataLoader

BATCH, SEQ = 2, 16
RECIPE = "xnnpack_int8_dynamic"


class CausalLM(L.LightningModule):
    """A user's module: an HF causal LM trained on token blocks."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.model(input_ids=batch, labels=batch).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)


def tiny(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def loaders(tok, corpus, batch_size: int = BATCH):
    from qharness.sources.text import tokenize_stream

    stream = tokenize_stream([corpus.read_text()[:40_000]], tok)
    blocks = stream[: 48 * SEQ].view(48, SEQ)
    train = DataLoader(blocks[:40], batch_size=batch_size, shuffle=True, drop_last=True)
    return train, DataLoader(blocks[40:], batch_size=batch_size, drop_last=True)


def trainer(root, max_steps: int, callbacks, **kw) -> L.Trainer:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return L.Trainer(
        default_root_dir=root,
        max_steps=max_steps,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=100, save_last=True)],
        **kw,
    )


def static_observers_on(graph) -> list[bool]:
    from qharness.upstream import imports

    fq = imports.pt2e().FakeQuantizeBase
    return [
        bool(m.observer_enabled[0])
        for m in graph.modules()
        if isinstance(m, fq) and not getattr(m, "is_dynamic", False) and hasattr(m, "observer_enabled")
    ]


def test_callback_trains_saves_on_sigterm_and_resumes(tmp_path, tiny_llama, corpus):
    """The callback prepares ``module.model`` at setup (the optimizer trains the graph), training after validation
    runs the training form (static observers back on), SIGTERM at step 3 saves ``last.ckpt`` through the atomic
    checkpoint writer, and ``fit(ckpt_path=...)`` with a fresh module and callback resumes from step 3 holding the
    checkpoint's state exactly, then trains on to max_steps; resuming with another shape is one line."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    import qharness
    from qharness.api.prepare import QuantizedModel
    from qharness.errors import UserError
    from qharness.training.checkpoints import AtomicCheckpointIO

    model, tok = tiny(tiny_llama)
    train, val = loaders(tok, corpus)
    seen = {"observers": []}

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["observers"].append(all(static_observers_on(pl_module.model.graph)))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 3:  # a scheduler's pre-emption, after step 3
                assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)
                os.kill(os.getpid(), signal.SIGTERM)

    module = CausalLM(model)
    cb = qharness.QuantizationCallback(RECIPE, batch_size=BATCH, seq_len=SEQ, tokenizer=tok, export=False)
    first = trainer(tmp_path, 6, [cb, Watch()])
    with pytest.raises(SIGTERMException):
        first.fit(module, train, val)
    assert isinstance(module.model, QuantizedModel)
    assert isinstance(first.strategy.checkpoint_io, AtomicCheckpointIO)
    assert seen["observers"] == [True] * 3  # batches 0-2; validation after step 2 froze them, training on again
    last = tmp_path / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 3
    assert ckpt["callbacks"]["QuantizationCallback"] == {"recipe": RECIPE, "shape": [BATCH, SEQ]}
    assert int(ckpt["state_dict"]["model.trained_batches"]) == 3

    at_start = {}

    class AtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            at_start["step"] = trainer.global_step
            at_start["state"] = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    fresh, _ = tiny(tiny_llama)
    cb2 = qharness.QuantizationCallback(RECIPE, batch_size=BATCH, seq_len=SEQ, tokenizer=tok, export=False)
    second = trainer(tmp_path, 6, [cb2, AtStart()])
    second.fit(CausalLM(fresh), train, val, ckpt_path=last)
    assert at_start["step"] == 3
    assert at_start["state"].keys() == ckpt["state_dict"].keys()
    assert [k for k, v in ckpt["state_dict"].items() if not torch.equal(at_start["state"][k], v)] == []
    assert second.global_step == 6

    other = qharness.QuantizationCallback(RECIPE, batch_size=1, seq_len=SEQ, tokenizer=tok, export=False)
    with pytest.raises(
        UserError, match=r"trained with QuantizationCallback shape=\[2, 16\], this callback has \[1, 16\]"
    ):
        trainer(tmp_path, 8, [other]).fit(CausalLM(tiny(tiny_llama)[0]), train, val, ckpt_path=last)


def test_callback_exports_after_fit_with_the_dataloaders_blocks(tmp_path, tiny_llama, corpus, monkeypatch):
    """After fit the callback hands ``qharness.export`` the trained model, calibration blocks from the training
    dataloader and the validation dataloader's tokens, into ``default_root_dir``; its result is ``cb.result``."""
    import qharness
    import qharness.api.export as api_export

    calls = []
    monkeypatch.setattr(api_export, "export", lambda model, out_dir, **kw: calls.append((model, out_dir, kw)) or "R")
    model, tok = tiny(tiny_llama)
    train, val = loaders(tok, corpus)
    module = CausalLM(model)
    cb = qharness.QuantizationCallback(RECIPE, batch_size=BATCH, seq_len=SEQ, tokenizer=tok, calibration_blocks=5)
    trainer(tmp_path, 2, [cb]).fit(module, train, val)
    (model_arg, out_dir, kw) = calls[0]
    assert len(calls) == 1 and cb.result == "R"
    assert model_arg is module.model and int(model_arg.trained_batches) == 2 and not model_arg.training
    assert str(out_dir) == str(tmp_path)
    assert kw["calibration"].shape == (5, SEQ)
    assert torch.equal(kw["validation"], torch.cat(list(val)).flatten()[: 8 * SEQ])  # validation_blocks=8
    assert kw["tokenizer"] is tok


def test_callback_errors_are_one_line_before_training(tmp_path, tiny_llama, corpus):
    """A missing attribute, a model that is not a causal LM, batches of another shape, a precision the recipe's
    fake quantization cannot train with: one UserError line each, before any optimizer step."""
    import qharness
    from qharness.errors import UserError

    model, tok = tiny(tiny_llama)
    train, val = loaders(tok, corpus)

    def fit(module, loader=train, **kw):
        t = trainer(tmp_path, 2, [qharness.QuantizationCallback(RECIPE, batch_size=BATCH, seq_len=SEQ, **kw)])
        with pytest.raises(UserError) as e:
            t.fit(module, loader, val)
        assert t.global_step == 0
        return str(e.value)

    msg = fit(CausalLM(model), attr="net")
    assert "CausalLM has no attribute 'net'" in msg and "fix: " in msg and "\n" not in msg
    msg = fit(CausalLM(torch.nn.Linear(4, 4)))
    assert "CausalLM.model is a Linear, not a transformers causal LM" in msg and "\n" not in msg
    wrong, _ = loaders(tok, corpus, batch_size=BATCH + 1)
    msg = fit(CausalLM(model), loader=wrong)
    assert f"static shape [{BATCH}, {SEQ}]" in msg and "drop_last=True" in msg and "\n" not in msg
    t = trainer(tmp_path, 2, [qharness.QuantizationCallback("xnnpack_8da4w", BATCH, SEQ)], precision="bf16-mixed")
    with pytest.raises(UserError, match="trainer.precision=bf16-mixed does not work with recipe 'xnnpack_8da4w'"):
        t.fit(CausalLM(model), train, val)
    with pytest.raises(UserError, match="batch_size=0 must be a positive integer"):
        qharness.QuantizationCallback(RECIPE, batch_size=0, seq_len=SEQ)


@pytest.mark.slow
def test_example_qat_lightning_runs_verbatim(tmp_path):
    """examples/qat_lightning.py as a user runs it, in a fresh process: the user's module with the callback, a .pte
    that passed the parity gate (summary.json) and generates."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-P", str(ROOT / "examples" / "qat_lightning.py"), str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity"]["passed"] is True and summary["mode"] == "qat"
    assert (out / "model.pte").is_file() and (out / "checkpoints" / "last.ckpt").is_file()
    assert "trained to step 8" in run.stdout and "parity passed: True" in run.stdout
    assert run.stdout.strip().splitlines()[-1].strip()  # the generated text
