"""QAT with ``transformers.Trainer`` training ``qharness.prepare``'s model: the example run verbatim (slow), and in the
default suite the Trainer's own training, checkpointing and ``resume_from_checkpoint`` on a prepared model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

BATCH, SEQ = 2, 16


def tiny(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def blocks(tok, corpus, n: int = 64) -> torch.Tensor:
    from qharness.sources.text import tokenize_stream

    stream = tokenize_stream([corpus.read_text()[:40_000]], tok)
    return stream[: n * SEQ].view(n, SEQ)


def trainer_for(qm, out, data, max_steps: int, callbacks=()):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=max_steps,
        save_steps=2,
        per_device_train_batch_size=BATCH,
        dataloader_drop_last=True,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return Trainer(model=qm, args=args, train_dataset=data, callbacks=list(callbacks))


def test_trainer_resumes_a_prepared_model_from_its_checkpoint(tmp_path, tiny_llama, corpus):
    """Trainer trains the QuantizedModel (the fake-quant graph's weights move), saves it (safetensors: tied
    embeddings and all) and ``train(resume_from_checkpoint=...)`` puts the saved state (weights, observers, the
    trained-batch count) into a freshly prepared model and continues from the saved step to max_steps."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    import qharness

    model, tok = tiny(tiny_llama)
    data = [{"input_ids": b, "labels": b} for b in blocks(tok, corpus)]

    class StopAt(TrainerCallback):  # an interruption after step 2 (its checkpoint saved)
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                control.should_training_stop = True

    qm = qharness.prepare(model, "xnnpack_int8_dynamic", batch_size=BATCH, seq_len=SEQ, tokenizer=tok)
    before = {k: v.clone() for k, v in qm.state_dict().items()}
    trainer_for(qm, tmp_path, data, max_steps=4, callbacks=[StopAt()]).train()
    ckpt = tmp_path / "checkpoint-2"
    saved = load_file(ckpt / "model.safetensors")
    assert saved.keys() == qm.state_dict().keys()
    assert int(saved["trained_batches"]) == 2
    moved = [k for k, v in saved.items() if "weight" in k and not torch.equal(v, before[k])]
    assert moved  # training changed the graph's weights

    seen = {}

    class AtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            seen["step"] = state.global_step
            seen["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    fresh, _ = tiny(tiny_llama)
    qm2 = qharness.prepare(fresh, "xnnpack_int8_dynamic", batch_size=BATCH, seq_len=SEQ, tokenizer=tok)
    resumed = trainer_for(qm2, tmp_path, data, max_steps=4, callbacks=[AtStart()])
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert seen["step"] == 2
    differ = [k for k, v in saved.items() if not torch.equal(seen["state"][k], v)]
    # the resumed model holds the checkpoint's state exactly: the observers' eps buffers (2**-12 for XNNPACK's
    # dynamic activations) too, though safetensors keeps no module versions (torchao resets eps on version-less loads)
    assert differ == []
    assert resumed.state.global_step == 4
    assert int(qm2.trained_batches) == 4


def test_trainer_gradient_accumulation_averages_the_micro_batches(tmp_path, tiny_llama, corpus):
    """With ``gradient_accumulation_steps=2`` one Trainer step (plain SGD) moves the weights by the mean of the two
    micro-batches' gradients, as for an HF model: the Trainer must not take the QuantizedModel's ``**ignored`` for a
    loss normalized by ``num_items_in_batch`` (it would then skip the division: twice the step)."""
    from transformers import Trainer, TrainingArguments

    import qharness

    model, tok = tiny(tiny_llama)
    data = blocks(tok, corpus, 2 * BATCH)
    qm = qharness.prepare(model, "xnnpack_int8_dynamic", batch_size=BATCH, seq_len=SEQ, tokenizer=tok)
    for half in (data[:BATCH], data[BATCH:]):  # the mean gradient of the two micro-batches (order does not matter)
        (qm(half, labels=half).loss / 2).backward()
    params = dict(qm.named_parameters())
    mean_grad = {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
    before = {k: p.detach().clone() for k, p in params.items()}
    qm.zero_grad(set_to_none=True)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=2,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(model=qm, args=args, train_dataset=[{"input_ids": b, "labels": b} for b in data]).train()
    name = max(mean_grad, key=lambda k: mean_grad[k].abs().max())  # the weight with the largest gradient
    step = before[name] - params[name].detach()
    torch.testing.assert_close(step, 0.5 * mean_grad[name], rtol=1e-3, atol=1e-6)


def test_trainer_batch_of_another_shape_is_one_line(tmp_path, tiny_llama, corpus):
    """A Trainer batch size other than the prepared one fails on the first step with the shape error, not a graph
    guard traceback."""
    import qharness
    from qharness.errors import UserError

    model, tok = tiny(tiny_llama)
    data = [{"input_ids": b, "labels": b} for b in blocks(tok, corpus, 8)]
    qm = qharness.prepare(model, "xnnpack_int8_dynamic", batch_size=BATCH + 1, seq_len=SEQ, tokenizer=tok)
    with pytest.raises(UserError, match=r"batch of shape \(2, 16\).*static shape \[3, 16\].*drop_last=True"):
        trainer_for(qm, tmp_path, data, max_steps=1).train()


@pytest.mark.slow
def test_example_qat_hf_trainer_runs_verbatim(tmp_path):
    """examples/qat_hf_trainer.py as a user runs it, in a fresh process: Trainer training, checkpoints, a .pte that
    passed the parity gate (summary.json) and generates."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-P", str(ROOT / "examples" / "qat_hf_trainer.py"), str(out)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["parity"]["passed"] is True and summary["mode"] == "qat"
    assert (out / "model.pte").is_file() and (out / "trainer" / "checkpoint-8").is_dir()
    lines = run.stdout.strip().splitlines()
    assert "trained to step 8" in run.stdout and "parity passed: True" in run.stdout
    assert lines[-1].strip()  # the generated text
