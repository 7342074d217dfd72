"""GPTQ rounding (``rounding: gptq``, ``recipes/gptq.py``): better than rounding to nearest where the inputs are
correlated, deployed exactly (the ``.pte``'s weights are GPTQ's, through the CLI), and QAT's warm start."""

import json

import pytest
import torch
from conftest import run_cli, write_config
from test_learned_scales import FakeTrainer

from qharness.errors import UserError
from qharness.recipes.gptq import dequantize, gptq_layer, gptq_round, symmetric_scale, untie_layers
from qharness.recipes.registry import load_recipe
from qharness.sources.models import put_weights, tied
from qharness.training.module import QuantLM


def _nearest(w, qmin, qmax, group):
    s = symmetric_scale(w.reshape(-1, group), qmin, qmax).reshape(w.shape[0], -1)
    q = torch.clamp(torch.round(w / s.repeat_interleave(group, dim=1)), qmin, qmax)
    return dequantize(q.to(torch.int8), s)


@pytest.mark.fast
@pytest.mark.parametrize("bits,group", [(4, 32), (3, 32), (4, 128)])
def test_gptq_halves_the_output_error_of_round_to_nearest_on_correlated_inputs(bits, group):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 128, generator=g) @ (torch.randn(128, 128, generator=g) / 128**0.5)
    w = torch.randn(64, 128, generator=g)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    codes, scales = gptq_layer(w, 2 * x.double().T @ x.double() / len(x), qmin, qmax, group)
    assert codes.dtype == torch.int8 and qmin <= codes.min() and codes.max() <= qmax
    assert scales.shape == (64, 128 // group) and (scales > 0).all()
    err = lambda q: ((x @ (w - q).T) ** 2).mean().item()  # noqa: E731
    assert err(dequantize(codes, scales)) < 0.7 * err(_nearest(w, qmin, qmax, group))  # measured: ~0.5


@pytest.mark.fast
def test_a_gptq_layer_is_rounded_onto_its_own_grid_and_inputs_that_never_fire_cost_nothing():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    h = torch.eye(64, dtype=torch.float64)
    h[5, 5] = 0  # input 5 never fires: its weights do not matter and become 0
    codes, scales = gptq_layer(w, h, -8, 7, 32)
    assert (codes[:, 5] == 0).all()
    # with uncorrelated inputs GPTQ has no error to spread: every other weight is rounded to its nearest level
    near = _nearest(torch.cat([w[:, :5], torch.zeros(8, 1), w[:, 6:]], dim=1), -8, 7, 32)
    assert torch.allclose(dequantize(codes, scales), near, atol=1e-6)


@pytest.mark.fast
def test_gptq_with_no_clipping_scales_clips_no_weight():
    """With uncorrelated inputs GPTQ rounds to nearest, so its scales are the mapping's: ``max(min / -8, max / 7)``."""
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    codes, scales = gptq_layer(w, torch.eye(64, dtype=torch.float64), -8, 7, 32, no_clipping=True)
    groups = w.double().view(8, 2, 32)
    want = torch.maximum(groups.amin(-1).clamp(max=0) / -8, groups.amax(-1).clamp(min=0) / 7)
    assert torch.allclose(scales.double(), want, rtol=1e-6)
    err = (dequantize(codes, scales).double().view(8, 2, 32) - groups).abs()
    assert (err <= scales.double()[..., None] / 2 + 1e-6).all()  # nothing clipped: every weight within half a step


@pytest.mark.fast
def test_rounding_is_a_checked_recipe_setting():
    assert load_recipe("xnnpack_8da4w_gptq").rounds_with_gptq and not load_recipe("xnnpack_8da4w").rounds_with_gptq
    with pytest.raises(UserError, match="rounding 'optimal' is unknown"):
        load_recipe("xnnpack_8da4w").settings.__class__(rounding="optimal")
    with pytest.raises(UserError, match="rounding gptq sets its own scales"):
        load_recipe("xnnpack_8da4w").settings.__class__(rounding="gptq", choose_qparams="hqq_scale_only")


@pytest.mark.fast
def test_gptq_weights_and_scales_reach_the_converted_model_exactly(tiny_llama):
    """What the .pte is lowered from: torchao's convert with GPTQ's scales gives back GPTQ's codes, bit for bit,
    for every linear (the tied lm_head untied)."""
    m = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w_gptq", mode="ptq")
    fp, _ = m.load_fp()
    quantizer = m.recipe.make_quantizer(is_qat=False)
    blocks = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    weights, qparams = gptq_round(fp, quantizer, blocks)
    assert set(weights) == set(qparams) and len(weights) == 15 and "lm_head.weight" in weights
    put_weights(fp, weights)
    quantizer.convert(fp, qparams)
    for name, w in weights.items():
        deployed = fp.get_parameter(name).dequantize()
        assert torch.equal(deployed, w), name


@pytest.mark.fast
def test_qat_starts_from_gptq_weights_and_scales(tiny_llama):
    """QAT warm start (``xnnpack_8da3w_lsq_gptq``): every fake-quantized linear holds GPTQ's weights and its trainable
    scales start at GPTQ's; the tied lm_head trains as its own weight (the embedding stays FP), and the trained
    weights load back into a fresh FP model untied. A rebuild for a checkpoint's state (no warm start) keeps the FP
    weights, untied alike."""
    blocks = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    m = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da3w_lsq_gptq", mode="qat")
    fp, _ = m.load_fp()
    assert "lm_head.weight" in tied(fp)
    quantizer = m.recipe.make_quantizer(is_qat=False)
    assert untie_layers(fp, quantizer) == ["lm_head.weight"] and not tied(fp)
    weights, qparams = gptq_round(fp, quantizer, blocks)
    assert len(weights) == 15
    m.build(2, 16, warm_start=blocks)
    m.trainer = FakeTrainer()
    for name, w in weights.items():
        assert torch.equal(m.graph.get_parameter(f"model.{name}"), w), name
    learned = m.learned_qparams()
    assert all(torch.equal(learned[name][0], qparams[name][0]) for name in weights)
    embedding = m.graph.get_parameter("model.model.embed_tokens.weight")
    assert torch.equal(embedding, fp.get_parameter("model.embed_tokens.weight"))
    fresh, _ = m.load_fp()
    m.load_into(fresh)
    assert torch.equal(fresh.lm_head.weight, weights["lm_head.weight"]) and torch.equal(
        fresh.model.embed_tokens.weight, embedding
    )
    cold = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da3w_lsq_gptq", mode="qat")
    cold.build(2, 16)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(cold.graph.get_parameter(f"model.{name}"), fp.get_parameter(name))
    assert cold.graph.get_parameter("model.lm_head.weight") is not cold.graph.get_parameter(
        "model.model.embed_tokens.weight"
    )


@pytest.mark.fast
def test_qat_by_gptq_needs_learned_scales(tmp_path):
    """Plain QAT's min-max fake quantization would re-round GPTQ's weights onto another grid: refused up front."""
    from qharness.schema import ModelConfig

    with pytest.raises(UserError, match="does not support mode 'qat'"):
        load_recipe("xnnpack_8da4w_gptq").check_mode("qat")
    (tmp_path / "r.yaml").write_text("base: xnnpack_8da4w_gptq\nmodes: [qat, ptq]\n")
    with pytest.raises(UserError, match="rounds by GPTQ .* without learned scales"):
        ModelConfig(recipe=str(tmp_path / "r.yaml"), mode="qat")
    assert ModelConfig(recipe="xnnpack_8da3w_lsq_gptq", mode="qat").load_recipe().rounds_with_gptq


def test_ptq_by_rotation_and_gptq_through_the_cli_deploys_gptq_scales_exactly(tmp_path, tiny_llama, corpus):
    """``qharness calibrate`` with ``xnnpack_8da3w_rot_gptq`` (a folded rotation, then GPTQ; 3-bit weights stored as
    int4): the parity gate passes and checks every GPTQ scale is, bit for bit, a scale of the program's weights
    (15: the rotation untied the head), on the fast path; the time GPTQ took is in summary.json."""
    run = tmp_path / "run"
    recipe = {"recipe": "xnnpack_8da3w_rot_gptq", "mode": "ptq"}
    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, run, model=recipe)
    r = run_cli("calibrate", "--config", cfg)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "GPTQ: rounding 15 layers" in r.stdout + r.stderr and "parity PASSED" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity"]["learned_scales"] == {"weights": 15, "exact": 15}
    assert summary["timings"]["rounding_s"] > 0
    assert summary["pte"]["export_path"] == "fast"  # the rotated model still takes the fast path
