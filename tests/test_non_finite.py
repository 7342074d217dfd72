"""Numbers that cannot lie: NaN never passes the parity gate, a non-finite weight, loss or score stops the run
with one line naming the step or stage, and nothing non-finite is published as ``model.pte``."""

import json
import re
import shutil

import pytest
import torch
from conftest import run_cli, write_config

from qharness.checks.parity import compare_decoding, gate
from qharness.config import ExportConfig, ParityConfig
from qharness.errors import ParityError, UserError


def _nan_model_dir(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "nan_model"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")  # one value is enough
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / f, out)
    return out


# --- the gate -----------------------------------------------------------------------------------------------------
@pytest.mark.fast
def test_nan_figures_fail_every_check_of_the_gate():
    cfg = ParityConfig(max_abs_diff=1.0)
    good = {"ppl_rel_diff": 0.0, "argmax_agreement": 1.0, "max_abs_diff": 0.0, "positions": 8}
    assert gate(good, cfg) == []
    nan = float("nan")
    for key in ("ppl_rel_diff", "argmax_agreement", "max_abs_diff"):
        assert len(gate({**good, key: nan}, cfg)) == 1, key  # NaN > tol is False: a `>` check would pass it
    assert gate({**good, "ppl_rel_diff": nan}, cfg, prefix="fake_quant_")


@pytest.mark.fast
def test_nan_logits_are_counted_and_fail_the_gate():
    """Two all-NaN models: argmax of NaN is the same index in both (agreement 1.0), max(0.0, nan) is 0.0, and
    NaN - NaN is NaN: every figure said "identical" before."""

    def nan_model(tokens, start):
        return torch.full((1, tokens.shape[1], 16), float("nan"))

    figures = compare_decoding(nan_model, nan_model, torch.zeros(2, 4, dtype=torch.long), decode_steps=2)
    assert figures["non_finite_positions"] == figures["positions"] == 2 * (4 + 2)
    assert figures["max_abs_diff"] != figures["max_abs_diff"]  # NaN kept
    reasons = gate({**figures, "ppl_rel_diff": float("nan")}, ParityConfig(max_abs_diff=1.0))
    assert reasons[0] == "logits are NaN/inf at 12 of 12 compared positions"
    assert reasons[1].startswith("perplexity differs by nan%") and reasons[2].startswith("max abs logit diff nan")


# --- the pipeline -------------------------------------------------------------------------------------------------
def _held_out(vocab):
    from qharness.run.trained import HeldOut

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (4, 16), generator=g)
    return HeldOut(x=x, y=x.roll(-1, 1), batch_size=2, calibration=x[:2], texts=lambda: [])


def _trained(model, tokenizer, recipe="xnnpack_fp32"):
    from qharness.recipes.registry import load_recipe
    from qharness.run.trained import Trained

    return Trained(model.eval(), tokenizer, load_recipe(recipe), "ptq", "test", "test")


@pytest.mark.fast
def test_a_nan_fp_model_stops_before_export_naming_the_stage(tmp_path, tiny_llama):
    """The issue's all-NaN model reached the .pte, passed parity and was written as model.pte (load now refuses its
    weights first; this is the pipeline's own check, for a model that overflows to NaN)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qharness.run.pipeline import deploy_and_check

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    trained = _trained(model, AutoTokenizer.from_pretrained(tiny_llama))
    with pytest.raises(UserError, match=r"gives a nan validation loss \(stage: scoring the FP model\)"):
        deploy_and_check(trained, _held_out(384), tmp_path, ExportConfig(max_seq_len=32), ParityConfig(prompt_len=8))
    assert not list(tmp_path.glob("*.pte"))


def test_a_nan_pte_fails_the_gate_and_is_not_published(tmp_path, tiny_llama, monkeypatch):
    """A .pte scoring NaN (simulated: the runtime's scores replaced by NaN) fails the gate, keeps its FAILED_PARITY
    name, and the summary table prints instead of ending in a TypeError (NaN is null in summary.json)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import qharness.run.gate as gate
    import qharness.run.pipeline as pipeline

    real = gate.score_jointly

    def score(ref, others, x, y, desc=None):
        out = real(ref, others, x, y, desc)
        if "pte" in out:  # (the gate's further rounding twins are scored alone)
            out["pte"] = {**out["pte"], "loss": float("nan"), "ppl": float("nan")}
        return out

    monkeypatch.setattr(gate, "score_jointly", score)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    trained = _trained(model, AutoTokenizer.from_pretrained(tiny_llama))
    with pytest.raises(ParityError, match=r"the \.pte's validation loss is nan \(stage: scoring the \.pte\)"):
        pipeline.deploy_and_check(
            trained, _held_out(384), tmp_path, ExportConfig(max_seq_len=32), ParityConfig(prompt_len=8)
        )
    assert not (tmp_path / "model.pte").exists() and (tmp_path / "model.FAILED_PARITY.pte").is_file()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["parity"]["passed"] is False and summary["metrics"]["pte"]["ppl"] is None


# --- the CLI ------------------------------------------------------------------------------------------------------
def test_nan_weights_in_the_model_directory_are_refused_at_load(tmp_path, tiny_llama, corpus):
    model = _nan_model_dir(tmp_path, tiny_llama)
    cfg = write_config(
        tmp_path / "c.yaml", model, corpus, tmp_path / "run", model={"recipe": "xnnpack_fp32", "mode": "ptq"}
    )
    r = run_cli("calibrate", cfg)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: model.checkpoint {model}: model.layers.0.mlp.up_proj.weight holds 1 NaN/inf value(s) of 8192. "
        "fix: use weights that are all finite (a checkpoint saved before training diverged, or the original)"
    )
    assert not list((tmp_path / "run").glob("*.pte"))


def test_activations_that_overflow_in_a_training_step_stop_it_with_one_line(tiny_llama):
    """Weights of +-1e10 (what a step of model.lr 1e10 leaves): finite, but the forward overflows to NaN. An activation
    observer asserts on it (`min nan should be less than max nan`, caught by ``forward_checked``); the per-token
    dynamic activations of this recipe observe nothing, so the NaN reaches the loss, which is checked."""
    from qharness.training.module import QuantLM

    module = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_int8_dynamic", mode="qat", lr=1e-3, warmup_steps=2)
    module.build(2, 16)
    module.to_train()
    with torch.no_grad():
        for name, p in module.graph.named_parameters():
            if name.endswith("weight"):
                p.copy_(torch.randn_like(p).sign() * 1e10)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(FloatingPointError) as e:
        module.training_step((x, x.roll(-1, 1)), 0)
    assert re.match(
        r"training diverged at step 0: the (activations became NaN/inf|training loss became nan)", str(e.value)
    )
    assert str(e.value).endswith(
        ". fix: lower model.lr (or check the data) and resume from the last checkpoint or start again"
    )


@pytest.mark.slow  # the CLI of the test above (about 50 s)
def test_divergence_stops_training_at_that_step_with_one_line(tmp_path, tiny_llama, corpus):
    """model.lr 1e10: the weights stay finite after the first step, but the next forward overflows: once a traceback
    (torchao's observer asserted `min nan should be less than max nan`), now one line."""
    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, tmp_path / "run", model={"lr": 1e10})
    r = run_cli("fit", cfg)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    assert re.match(
        r"error: training diverged at step 1: the (activations became NaN/inf|training loss became nan)", line
    )
    assert line.endswith("fix: lower model.lr (or check the data) and resume from the last checkpoint or start again")
    assert not list((tmp_path / "run").glob("*.pte"))
