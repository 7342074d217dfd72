"""Checkpoints read for resume or export: a non-finite one is refused when read, one of another data layout
(``data.seq_len``/``batch_size``) or with a wrongly shaped tensor is one line before training, and a QAT run that
trained zero steps is never trained nor shipped as QAT."""

import pytest
import torch
from conftest import run_cli, write_config

DATA = {"seq_len": 32, "batch_size": 4}  # write_config's


@pytest.fixture(scope="module")
def qat_state(tiny_llama):
    """The state dict and hyperparameters of the tiny Llama's prepared QAT graph (what a checkpoint of it holds)."""
    from qharness.training.module import QuantLM

    module = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_int8_dynamic", mode="qat", lr=1e-3, warmup_steps=2)
    module.build(DATA["batch_size"], DATA["seq_len"])
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, dict(module.hparams)


def _ckpt(path, qat_state, global_step=3, data=DATA, change=None):
    state, hparams = qat_state
    state = dict(state)
    if change:
        state.update(change(state))
    ckpt = {"state_dict": state, "hyper_parameters": hparams, "global_step": global_step}
    ckpt["pytorch-lightning_version"] = __import__("lightning").__version__
    if data is not None:
        ckpt["datamodule_hyper_parameters"] = {"source": "x", **data}
    torch.save(ckpt, path)
    return path


def _last_line(r):
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return r.stderr.strip().splitlines()[-1]


Q = "graph.model.model.layers.0.self_attn.q_proj.weight"


def test_resume_with_another_seq_len_or_batch_size_is_refused_before_training(tmp_path, qat_state, tiny_llama, corpus):
    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, tmp_path / "run")
    ckpt = _ckpt(tmp_path / "a.ckpt", qat_state, data={"seq_len": 16, "batch_size": 4})
    assert _last_line(run_cli("fit", cfg, "--ckpt_path", ckpt)) == (
        f"error: checkpoint {ckpt} was trained with data.seq_len=16, this config has 32 (a resumed run must see the "
        "batches it was trained on). fix: resume with data.seq_len: 16, or start a new run (another "
        "trainer.default_root_dir, no --ckpt_path)"
    )
    # the batch size by the same check (the CLI's path is the one above)
    from qharness.errors import UserError
    from qharness.training.checkpoints import check_resume_data

    ckpt = _ckpt(tmp_path / "b.ckpt", qat_state, data={"seq_len": 32, "batch_size": 8})
    with pytest.raises(UserError, match="was trained with data.batch_size=8, this config has 4"):
        check_resume_data(torch.load(ckpt, weights_only=True), str(ckpt), DATA)


def test_a_resumed_checkpoint_with_a_wrongly_shaped_tensor_is_one_line(tmp_path, qat_state, tiny_llama, corpus):
    """Without a recorded data layout the resume is warned about (unknown), then the tensor of another shape is one
    line (it was a `size mismatch` traceback from Lightning's load)."""
    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, tmp_path / "run")
    ckpt = _ckpt(tmp_path / "a.ckpt", qat_state, data=None, change=lambda s: {Q: s[Q][:32].clone()})
    r = run_cli("fit", cfg, "--ckpt_path", ckpt)
    assert f"checkpoint {ckpt} does not record its data layout (data.seq_len, data.batch_size)" in r.stderr
    line = _last_line(r)
    assert line.startswith(f"error: checkpoint {ckpt} does not fit this model: size mismatch for {Q}: "), line
    assert line.endswith("fix: use the config (model, recipe, data) the checkpoint was trained with")
    assert not (tmp_path / "run" / "model.pte").exists()


@pytest.mark.parametrize("command", ["export", pytest.param("fit", marks=pytest.mark.slow)])  # one reader: both
def test_a_nan_checkpoint_is_refused_when_read(tmp_path, qat_state, tiny_llama, corpus, command):
    def nan(state):
        w = state[Q].clone()
        w[0, 0] = float("nan")
        return {Q: w}

    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, tmp_path / "run")
    ckpt = _ckpt(tmp_path / "nan.ckpt", qat_state, change=nan)
    assert _last_line(run_cli(command, cfg, "--ckpt_path", ckpt)) == (
        f"error: checkpoint {ckpt} holds NaN/inf values in {Q} (1 of 4096): it was saved after training diverged. "
        "fix: use an earlier checkpoint (or train again with a lower model.lr)"
    )


def test_zero_training_steps_are_refused_by_the_config_and_never_shipped_as_qat(
    tmp_path, qat_state, tiny_llama, corpus
):
    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, tmp_path / "run")
    line = _last_line(run_cli("fit", cfg, "--trainer.limit_train_batches", "0"))
    assert line.startswith("error: trainer.limit_train_batches=0 trains no step"), line
    # a checkpoint of a QAT run that trained no step (e.g. a fractional limit that gave no batch)
    ckpt = _ckpt(tmp_path / "zero.ckpt", qat_state, global_step=0)
    line = _last_line(run_cli("export", cfg, "--ckpt_path", ckpt))
    assert line.startswith("error: the QAT run trained 0 steps"), line
    assert not list((tmp_path / "run").glob("*.pte"))
