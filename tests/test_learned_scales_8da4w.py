"""Learned weight scales for the torchao source-level recipe (``xnnpack_8da4w_lsq``: torchao's range learning on
eager ``FakeQuantizedLinear`` modules): trainable from build time, kept in checkpoints, and carried into the converted
program exactly through torchao's own range-learning convert (not min-max of the final weights)."""

import functools

import pytest
import torch
from test_learned_scales import _build as build_qat
from test_learned_scales import _train

from qharness.errors import UserError
from qharness.recipes.learned_scales import use_source_scales
from qharness.recipes.registry import load_recipe
from qharness.training.module import QuantLM

RECIPE = "xnnpack_8da4w_lsq"
W = "model.layers.0.self_attn.q_proj.weight"
N_LINEARS = 15  # q/k/v/o + 3 MLP projections per layer, 2 layers, lm_head
_build = functools.partial(build_qat, recipe=RECIPE)  # the torchao recipe by default


def _fake_quantizers(m):
    """The linear weights' fake quantizers (the recipe's 4-bit embedding table has its own, with min-max scales)."""
    return {
        n: mod for n, mod in m.graph.named_modules() if n.endswith("weight_fake_quantizer") and "embed_tokens" not in n
    }


def _minmax_converted(m, weights_from=None):
    """An FP model with ``m``'s weights quantized for deployment without learned scales (min-max of the weights)."""
    fp, _ = m.load_fp()
    (weights_from or m).load_into(fp)
    m.recipe.make_quantizer(is_qat=False).convert(fp)
    return fp


@pytest.fixture(scope="module")
def trained(tiny_llama):
    """A learned-scale 8da4w QAT model: its scales at the start, then after 4 AdamW steps (lr 1e-2) and mode switches."""
    m = _build(tiny_llama)
    start = m.learned_qparams()
    _train(m, 4)
    m.to_eval()
    m.to_train()
    m.to_eval()
    return m, start


@pytest.mark.fast
def test_scales_start_at_min_max_and_are_parameters_without_weight_decay(tiny_llama):
    m = _build(tiny_llama, weight_decay=0.1)
    q = m.learned_qparams()
    assert len(q) == N_LINEARS and q[W][0].shape == (64, 2)  # one scale per group of 32 input weights
    minmax = _minmax_converted(m)
    for name, (scale, zero_point) in q.items():  # the deploy-time min-max scale (torchao floors learned ones at 1e-9)
        want = minmax.get_parameter(name).scale.reshape(scale.shape).clamp(min=1e-9)
        assert torch.equal(scale, want), name
        assert not zero_point.any()
    scales = {id(fq.scale) for fq in _fake_quantizers(m).values()}
    assert len(scales) == N_LINEARS
    table = dict(m.graph.named_modules())["model.model.embed_tokens.weight_fake_quantizer"]
    assert not isinstance(table.scale, torch.nn.Parameter)  # the embedding table keeps min-max scales: none learned
    assert all(
        isinstance(fq.scale, torch.nn.Parameter) and fq.scale.requires_grad for fq in _fake_quantizers(m).values()
    )
    groups = m.configure_optimizers()["optimizer"].param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert groups[0]["weight_decay"] == 0.1 and not scales & decayed
    assert scales <= {id(p) for g in groups for p in g["params"]}  # trained, without decay
    assert not any("fake_quantizer" in k for k in m.trained_weights())  # scales are no model weights
    m.load_into(m.load_fp()[0])  # raises on names the HF model lacks


@pytest.mark.fast
def test_scales_train_and_mode_switches_keep_them(trained):
    m, start = trained
    now = m.learned_qparams()
    assert [k for k in now if not torch.equal(now[k][0], start[k][0])] == list(now)  # every scale moved
    assert all(not zp.any() for _, zp in now.values())  # symmetric: zero point stays 0
    final_minmax = _minmax_converted(m).get_parameter(W).scale.reshape(now[W][0].shape)
    assert (now[W][0] - final_minmax).abs().max() > 1e-4  # learned, not min-max of the final weights


def test_the_converted_program_uses_the_trained_scales_exactly(trained):
    from qharness.checks.parity import learned_scales_carried
    from qharness.deploy.lower import quantize_for_deploy

    m, _ = trained
    q = {k: (s * 0.9 if k == W else s, zp) for k, (s, zp) in m.learned_qparams().items()}  # far from min-max

    fp, _ = m.load_fp()
    m.load_into(fp)
    m.recipe.make_quantizer(is_qat=False).convert(fp, q)
    # the given scale, as XNNPACK's group-wise kernels compute with it (bf16: upstream/fixes/xnnpack_bf16_scales.py)
    assert fp.get_parameter(W).scale.dtype == torch.bfloat16
    assert torch.equal(fp.get_parameter(W).scale, q[W][0].to(torch.bfloat16))
    # what ships is what trained: with the trained scales the deployed weights are the fake-quantized ones, bit for bit
    q_trained = m.learned_qparams()
    fp, _ = m.load_fp()
    m.load_into(fp)
    m.recipe.make_quantizer(is_qat=False).convert(fp, q_trained)
    fqs = _fake_quantizers(m)
    with torch.no_grad():
        for name in q_trained:
            layer = name[: -len(".weight")]
            fake = fqs[f"model.{layer}.weight_fake_quantizer"](m.graph.get_parameter(f"model.{name}"))
            assert torch.equal(fp.get_parameter(name).dequantize(), fake), name

    def calibrate(g):
        g(torch.zeros(1, 8, dtype=torch.long), torch.tensor([0]))

    fp, _ = m.load_fp()
    m.load_into(fp)
    converted = quantize_for_deploy(fp, m.recipe, 64, calibrate, weight_qparams=q)
    assert learned_scales_carried(converted, q) == {"weights": N_LINEARS, "exact": N_LINEARS}  # the pipeline's check
    # without weight_qparams deployment computes min-max of the final weights: the case the check tells apart
    plain = quantize_for_deploy(m.load_fp()[0], m.recipe, 64, calibrate)
    assert learned_scales_carried(plain, q) == {"weights": N_LINEARS, "exact": 0}


@pytest.mark.fast
def test_learned_scales_must_cover_the_deploy_model_exactly(trained):
    m, _ = trained
    q = m.learned_qparams()
    quantizer = m.recipe.make_quantizer(is_qat=False)
    with pytest.raises(RuntimeError, match="unused .*nope"):
        quantizer.convert(m.load_fp()[0], {**q, "nope.weight": q[W]})
    with pytest.raises(RuntimeError, match="no scale for .*q_proj"):
        quantizer.convert(m.load_fp()[0], {k: v for k, v in q.items() if k != W})
    fp, _ = m.load_fp()
    quantizer.prepare_qat(fp)  # what convert does first: fake quantizers to hold the trained scales
    with pytest.raises(RuntimeError, match="has shape"):
        use_source_scales(fp, {**q, W: (q[W][0][:, :1], q[W][1])})
    with pytest.raises(ValueError, match="neither learns nor GPTQ-rounds any"):
        load_recipe("xnnpack_8da4w").make_quantizer(is_qat=False).convert(m.load_fp()[0], q)


@pytest.mark.fast
def test_a_checkpoint_restores_the_learned_scales(tiny_llama, trained):
    m, _ = trained
    fresh = _build(tiny_llama)
    before = fresh.learned_qparams()
    fresh.load_state_dict(m.state_dict())  # what resuming from a checkpoint does, after configure_model's build
    after, want = fresh.learned_qparams(), m.learned_qparams()
    assert all(torch.equal(after[k][0], want[k][0]) for k in want)
    assert not torch.equal(before[W][0], want[W][0])
    assert sum(k.endswith("weight_fake_quantizer.scale") for k in m.state_dict()) == N_LINEARS


@pytest.mark.fast
def test_scales_stay_positive(tiny_llama):
    """An optimizer step may push a scale to zero or below (all-zero weight groups get any sign); the fake quantizer
    and deployment both see it clamped to torchao's floor (a negative scale made the .pte unloadable)."""
    m = _build(tiny_llama)
    fq = _fake_quantizers(m)["model.model.layers.0.self_attn.q_proj.weight_fake_quantizer"]
    with torch.no_grad():
        fq.scale[0, 0] = -0.01
    m.loss((torch.zeros(2, 16, dtype=torch.long),) * 2)
    assert fq.scale[0, 0].item() == pytest.approx(1e-9)
    with torch.no_grad():
        fq.scale[0, 1] = -0.01
    assert m.learned_qparams()[W][0][0, 1].item() == pytest.approx(1e-9, rel=1e-2)  # as bf16, the kernels' scale


@pytest.mark.fast
def test_quantized_embeddings_keep_min_max_scales(tiny_llama, tmp_path):
    recipe = tmp_path / "lsq_emb.yaml"
    recipe.write_text(f"base: {RECIPE}\nquantizer:\n  embedding_bits: 4\n")
    m = _build(tiny_llama, recipe=recipe)
    q = m.learned_qparams()
    assert len(q) == N_LINEARS and "model.embed_tokens.weight" not in q  # linears only
    emb = m.graph.model.model.embed_tokens.weight_fake_quantizer
    assert not emb.config.range_learning
    fp, _ = m.load_fp()
    m.load_into(fp)
    m.recipe.make_quantizer(is_qat=False).convert(fp, q)
    plain = _minmax_converted(m)
    table = "model.embed_tokens.weight"
    assert torch.equal(fp.get_parameter(table).scale, plain.get_parameter(table).scale)


@pytest.mark.fast
def test_learn_scales_settings_are_checked(tiny_llama, tmp_path):
    r = load_recipe(RECIPE)
    assert r.learns_scales and r.kind == "source" and r.modes == ("qat",)
    assert r.settings.group_size == 32 and r.settings.weight_bits == 4  # the rest is xnnpack_8da4w
    hqq = tmp_path / "lsq_hqq.yaml"
    hqq.write_text(f"base: {RECIPE}\nquantizer:\n  choose_qparams: hqq_scale_only\n")
    with pytest.raises(UserError, match="learn_scales trains the scales.*hqq_scale_only"):
        load_recipe(str(hqq))
    ptq = tmp_path / "lsq_ptq.yaml"
    ptq.write_text(f"base: {RECIPE}\nmodes: [qat, ptq]\n")
    with pytest.raises(UserError, match="learns its weight scales.*needs training"):
        QuantLM(checkpoint=str(tiny_llama), recipe=str(ptq), mode="ptq")


@pytest.mark.fast
def test_scale_lr_ratio_sets_the_scales_rate_and_zero_keeps_them(tiny_llama):
    """``model.scale_lr_ratio``: the learned scales train at that fraction of ``lr`` (their own AdamW group); 0 leaves
    them out of the optimizer, so they stay where they started while the weights train; outside [0, 1] refused."""
    tenth = _build(tiny_llama, scale_lr_ratio=0.1)
    tenth.hparams.lr = 1e-2
    groups = tenth.configure_optimizers()["optimizer"].param_groups
    scales = {id(fq.scale) for fq in _fake_quantizers(tenth).values()}
    (group,) = [g for g in groups if {id(p) for p in g["params"]} & scales]
    assert {id(p) for p in group["params"]} == scales and group["initial_lr"] == pytest.approx(1e-3)
    frozen = _build(tiny_llama, scale_lr_ratio=0.0)
    start = frozen.learned_qparams()
    before = frozen.graph.get_parameter(f"model.{W}").detach().clone()
    _train(frozen, 2)
    now = frozen.learned_qparams()
    assert all(torch.equal(now[k][0], start[k][0]) for k in start)
    assert not torch.equal(frozen.graph.get_parameter(f"model.{W}"), before)  # the weights trained
    with pytest.raises(UserError, match=r"model.scale_lr_ratio must lie in \[0, 1\] \(got 2\)"):
        QuantLM(recipe=RECIPE, mode="qat", scale_lr_ratio=2.0)
