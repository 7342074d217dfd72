"""Faults planted in a ``.pte`` fail the parity gate; the same program without them passes it.

Each fault is planted in the weights (or the recipe) the ``.pte`` is built from, while the gate's reference, the
converted model, is built from the right ones: what a lowering bug would ship. The model is the tests' tiny Llama with
a random untied head of spread 1 (decisive logits: few near ties), through the pipeline's own stages.
"""

import dataclasses

import pytest
import torch
from conftest import make_tiny_llama, runner_safe_head

from qharness.config import CalibrationConfig, ParityConfig
from qharness.data.datamodule import TextDataModule
from qharness.deploy.lower import lower_to_pte, runner_metadata
from qharness.recipes.layers import LayerRule
from qharness.run.from_lightning import held_out, trained
from qharness.run.gate import check_parity
from qharness.run.stages import Lowered
from qharness.run.summary import Timings
from qharness.run.trained import deploy_graph
from qharness.training.module import QuantLM

MAX_SEQ_LEN = 64
LAYER = "model.layers.1"


def _transposed(model):
    w = model.get_submodule(f"{LAYER}.self_attn.o_proj").weight  # 64 x 64
    w.data = w.data.T.contiguous()


def _shuffled(model):
    w = model.get_submodule(f"{LAYER}.mlp.up_proj").weight
    w.data = w.data[torch.randperm(w.shape[0], generator=torch.Generator().manual_seed(0))]


def _wrong_scale(model):  # every scale of one projection twice what its weights need: weights twice as large
    w = model.get_submodule(f"{LAYER}.mlp.down_proj").weight
    w.data = w.data * 2


def _nan(model):  # in a weight the program keeps in float (XNNPACK refuses to load a NaN scale: another failure)
    model.get_submodule(f"{LAYER}.post_attention_layernorm").weight.data[5] = float("nan")


def _nan_scale(model):  # a NaN weight quantizes to a NaN group scale, which XNNPACK refuses when the program loads
    model.get_submodule(f"{LAYER}.self_attn.v_proj").weight.data[3, 5] = float("nan")


FAULTS = {
    "transposed weight": _transposed,
    "shuffled weight": _shuffled,
    "wrong scale": _wrong_scale,
    "NaN": _nan,
    "NaN scale": _nan_scale,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, corpus):
    """The tiny Llama with a decisive head, its 8da4w PTQ ``Trained``, held-out data and the converted reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_tiny_llama(tmp_path_factory.mktemp("decisive"), corpus.read_text()[:200_000])
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    runner_safe_head(model, tok)
    model.save_pretrained(out)
    dm = TextDataModule(source=str(corpus), tokenizer=str(out), seq_len=32, batch_size=4)
    dm.setup()
    module = QuantLM(checkpoint=str(out), recipe="xnnpack_8da4w", mode="ptq")
    parity = ParityConfig(eval_blocks=8, prompts=4, prompt_len=24, decode_steps=8)
    data = held_out(dm, parity, CalibrationConfig(blocks=4))
    t = trained(module)
    reference = deploy_graph(t, data.calibration, MAX_SEQ_LEN)
    meta = runner_metadata(MAX_SEQ_LEN, model.config.vocab_size, tok.bos_token_id, [tok.eos_token_id])
    return t, data, reference, parity, meta


def _gate(setup, tmp_path, plant=None, recipe=None):
    """The parity figures of a ``.pte`` built with ``plant`` applied to its FP weights (and ``recipe``), gated against
    the right converted model."""
    t, data, reference, parity, meta = setup
    faulty = dataclasses.replace(t, load_trained=plant, recipe=recipe or t.recipe)
    graph = deploy_graph(faulty, data.calibration, MAX_SEQ_LEN)
    path = tmp_path / "model.pending.pte"
    path.write_bytes(lower_to_pte(graph, faulty.recipe, MAX_SEQ_LEN, meta))
    return check_parity(t, Lowered(reference, b"", path), data, parity, {}, Timings()).parity


@pytest.fixture(scope="module")
def clean_pte(setup, tmp_path_factory):
    """The ``.pte`` of the setup's program, no fault planted: lowered once for the tests that gate it."""
    t, data, reference, parity, meta = setup
    path = tmp_path_factory.mktemp("clean") / "model.pending.pte"
    path.write_bytes(lower_to_pte(deploy_graph(t, data.calibration, MAX_SEQ_LEN), t.recipe, MAX_SEQ_LEN, meta))
    return path


def test_the_program_itself_passes(setup, clean_pte):
    t, data, reference, parity, meta = setup
    p = check_parity(t, Lowered(reference, b"", clean_pte), data, parity, {}, Timings()).parity
    assert p.passed, p.reasons
    assert p.near_ties < p.positions // 4  # decisive logits: the argmax check compares most positions
    assert p.noise is not None and p.kl <= ParityConfig().max_noise_ratio * p.noise.kl or p.kl <= 1e-6
    blocks = setup[1].x.numel()  # the KL is judged over the validation blocks' positions and the decoding's
    assert p.kl_positions == p.positions + blocks and p.noise.kl_positions == p.positions + p.noise.twins * blocks


@pytest.mark.parametrize(
    "fault",
    [
        # ~10 s each (a lowering): the slow tier plants the twins of the default suite's faults, a shuffled weight
        # (a transposed one stays), a NaN weight and a NaN scale (a wrong scale stays; a NaN program failing the gate
        # through the run: test_non_finite)
        pytest.param(name, marks=pytest.mark.slow) if name in ("NaN", "NaN scale", "shuffled weight") else name
        for name in FAULTS
    ],
)
def test_a_planted_fault_fails_the_gate(setup, tmp_path, fault):
    p = _gate(setup, tmp_path, FAULTS[fault])
    assert p.passed is False, (fault, p)
    assert any(why in r for r in p.reasons for why in ("KL divergence", "NaN/inf", "does not load")), p.reasons


def test_a_layer_left_float_fails_the_gate(setup, tmp_path):
    """A decoder layer whose projections the program computes in float. (One projection left float moves the logits
    about as far as rounding does on this model: the coverage check (``deploy/coverage.py``) is what refuses a
    projection the recipe meant to quantize.)"""
    t = setup[0]
    fp_layer = dataclasses.replace(t.recipe, layers=(LayerRule(f"{LAYER}.*", None, {"quant": "fp"}),))
    p = _gate(setup, tmp_path, recipe=fp_layer)
    assert p.passed is False, p
    assert any("KL divergence" in r for r in p.reasons), p.reasons


def _as_trained(graph):
    """A converted graph called as a trained fake-quant model is: ``model(x[B, T]) -> logits[B, T, V]``."""
    from qharness.checks.parity import fold_constants
    from qharness.deploy.fastpath.twin import all_logits_twin

    every = all_logits_twin(fold_constants(graph))
    return lambda x: torch.cat([every(row[None], torch.tensor([0])) for row in x])


def test_a_qat_program_is_held_to_the_model_it_trained(setup, clean_pte):
    """QAT, whatever the recipe (here one without learned scales): the ``.pte`` is gated against the trained
    fake-quant model too. A program that computes it passes; the same program against a "trained" model that has
    one projection's weights doubled (what a deployment that lost the trained weights would ship) fails."""
    from qharness.checks.parity import score_batched

    t, data, reference, parity, meta = setup
    assert not t.recipe.learns_scales
    path = clean_pte
    other = deploy_graph(dataclasses.replace(t, load_trained=_wrong_scale), data.calibration, MAX_SEQ_LEN)
    verdicts = {}
    for name, graph in (("itself", reference), ("another model", other)):
        model = _as_trained(graph)
        scores = {"fake_quant": score_batched(model, data.x, data.y, data.batch_size, desc="scoring")}
        qat = dataclasses.replace(t, mode="qat", fake_quant=model)
        verdicts[name] = check_parity(qat, Lowered(reference, b"", path), data, parity, scores, Timings()).parity
    assert verdicts["itself"].passed and verdicts["itself"].fake_quant.passed, verdicts["itself"].reasons
    assert verdicts["itself"].fake_quant.gated
    failed = verdicts["another model"]
    assert failed.passed is False and failed.reasons, failed
    assert all(r.startswith(".pte vs trained fake-quant: ") for r in failed.reasons), failed.reasons
