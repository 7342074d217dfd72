"""Zero points on XNNPACK's symmetric 4-bit kernels (``zero_points``, ``recipes/zero_points.py``) and scales chosen
for the activations they meet (``rounding: weighted``, ``recipes/scale_search.py``): exact where they must be, better
where they claim to be, refused where they cannot work, and deployed through the CLI within the parity gate."""

import dataclasses
import json

import pytest
import torch
from conftest import run_cli, tiny_spec, write_config

from qharness.errors import UserError
from qharness.recipes.registry import load_recipe
from qharness.recipes.scale_search import round_to, search_scales
from qharness.recipes.zero_points import ALPHA, ZeroPointLinear, attach, group_means, split


def _asymmetric_grid(out, n, group, g):
    """A weight whose groups hold 16 levels ``low + d*k`` reaching both ends (a Q4_1 block), ``d`` in bf16."""
    low = torch.randn(out, n // group, 1, generator=g) * 0.1
    d = (torch.rand(out, n // group, 1, generator=g) * 0.02 + 0.01).bfloat16().float()
    k = torch.randint(0, 16, (out, n // group, group), generator=g).float()
    k[..., 0], k[..., 1] = 0, 15
    return (low + d * k).reshape(out, n)


@pytest.mark.fast
def test_a_zero_point_layer_computes_an_asymmetric_grid_weight_exactly():
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 16, bias=True)
    linear.weight.data = _asymmetric_grid(16, 64, 32, g)
    main, scales, offsets = split(linear.weight, 32)
    codes = main.reshape(16, 2, 32) / scales[..., None]
    assert torch.equal(codes, codes.round()) and codes.min() >= -8 and codes.max() <= 7  # symmetric 4-bit codes
    holder = torch.nn.Module()
    holder.add_module("proj", torch.nn.Linear(64, 16))
    holder.proj.load_state_dict(linear.state_dict())
    attach(holder, {"proj": (main, offsets)})
    assert isinstance(holder.proj, ZeroPointLinear)
    x = torch.randn(3, 5, 64, generator=g)
    assert torch.allclose(holder.proj(x), linear(x), atol=1e-5)
    # the group means are a 4-D mean over the inner dimensions (what XNNPACK lowers), scaled by ALPHA in forward
    assert torch.allclose(group_means(x, 32), x.reshape(3, 5, 2, 32).mean(-1))
    assert ALPHA > 1
    # a symmetric grid of the same scales cannot hold it: the offsets carry what it would round away
    assert (main - linear.weight).abs().max() > scales.max()


@pytest.mark.fast
def test_weighted_scales_round_the_weights_that_meet_large_inputs_closer():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g)
    power = torch.ones(128)
    power[::8] = 100.0  # one input in eight is large (an outlier channel)
    base = torch.maximum(w.reshape(64, 4, 32).amin(-1) / -8, w.reshape(64, 4, 32).amax(-1) / 7)
    base = base.to(torch.bfloat16).float()
    searched = search_scales(w, power, -8, 7, 32)

    def weighted_error(scales):
        return (power * (w - round_to(w, scales, -8, 7, 32)) ** 2).sum().item()

    assert weighted_error(searched) < 0.8 * weighted_error(base)
    assert torch.equal(searched, searched.to(torch.bfloat16).float())  # scales as XNNPACK keeps them


@pytest.mark.fast
def test_weighted_scales_refit_each_candidate_to_its_codes():
    """Each group's scale is at least as good as the best shrink of its clip-nothing scale, and better for some: the
    least-squares scale of a candidate's codes (llama.cpp's ``make_qx_quants``) is a candidate too."""
    from qharness.recipes.scale_search import SHRINKS

    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=g)
    power = torch.rand(128, generator=g) * 10

    def group_errors(scales):
        return (power * (w - round_to(w, scales, -8, 7, 32)) ** 2).reshape(64, 4, 32).sum(-1)

    base = torch.maximum(w.reshape(64, 4, 32).amin(-1) / -8, w.reshape(64, 4, 32).amax(-1) / 7)
    shrink_only = torch.stack([group_errors((base * k).to(torch.bfloat16).float()) for k in SHRINKS]).amin(0)
    searched = group_errors(search_scales(w, power, -8, 7, 32))
    assert (searched <= shrink_only).all()
    assert (searched < shrink_only).float().mean() > 0.2, (searched < shrink_only).float().mean()


@pytest.mark.fast
def test_zero_points_and_weighted_scales_are_refused_where_they_cannot_work(tmp_path):
    with pytest.raises(UserError, match="does not support mode 'qat'"):
        load_recipe("xnnpack_8da4w_zp").check_mode("qat")
    (tmp_path / "qat.yaml").write_text("base: xnnpack_8da4w_zp\nmodes: [qat, ptq]\n")
    with pytest.raises(UserError, match="PTQ"):
        load_recipe(str(tmp_path / "qat.yaml")).make_quantizer(is_qat=True)
    (tmp_path / "hqq.yaml").write_text("base: xnnpack_8da4w_hqq\nquantizer: {zero_points: ['*']}\n")
    with pytest.raises(UserError, match="zero_points with choose_qparams: hqq_scale_only"):
        load_recipe(str(tmp_path / "hqq.yaml"))
    (tmp_path / "lsq.yaml").write_text("base: xnnpack_8da4w\nquantizer: {zero_points: ['*'], learn_scales: true}\n")
    assert load_recipe(str(tmp_path / "lsq.yaml")).starts_from_rounding  # QAT starts from what PTQ would deploy
    (tmp_path / "empty.yaml").write_text("base: xnnpack_8da4w\nquantizer: {zero_points: []}\n")
    with pytest.raises(UserError, match="non-empty list"):
        load_recipe(str(tmp_path / "empty.yaml"))
    (tmp_path / "none.yaml").write_text("base: xnnpack_8da4w\nquantizer: {zero_points: ['*.qkv']}\n")
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    with pytest.raises(UserError, match=r"zero_points \['\*.qkv'\] match no linear"):
        load_recipe(str(tmp_path / "none.yaml")).make_quantizer(is_qat=False).check(model)
    # a recipe with layers: rules (the zero-point built-ins keep an 8-bit lm_head by one) checks them too
    from qharness.sources.embedded import EmbeddedSpec, new_llama

    (tmp_path / "rules.yaml").write_text("base: xnnpack_8da4w_zp\nquantizer: {zero_points: ['*.qkv']}\n")
    llama = new_llama(
        EmbeddedSpec(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2), 128
    )
    with pytest.raises(UserError, match=r"zero_points \['\*.qkv'\] match no linear of LlamaForCausalLM"):
        load_recipe(str(tmp_path / "rules.yaml")).make_quantizer(is_qat=False).check(llama)


def check_zero_point_program(r, run, mode: str) -> dict:
    """What every zero-point program shows after ``qharness calibrate`` or ``fit`` on the tiny Llama: the four
    zero-point layers of each block (key, value, up, down) split, the MLPs' inputs smoothed, every 4-bit weight
    deployed with the scale rounding (or training) chose, bit for bit, the offsets 8-bit layers of the program, the
    gate passed; PTQ times its rounding, QAT its steps. Returns the run's summary (``test_split_input.py`` calls it for
    ``xnnpack_8da4w_zp_split``, whose base is ``xnnpack_8da4w_zp``: one calibration checks both)."""
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "parity PASSED" in r.stdout and "(8 with zero points)" in out, out[-3000:]
    assert "smoothing the inputs of 2 down projections" in out, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity"]["learned_scales"] == {"weights": 14, "exact": 14}
    schemes = summary["layers"]["schemes"]
    assert sum(s == "8da8w-pc" for n, s in schemes.items() if n.endswith(".offsets")) == 8, schemes
    t = summary["timings"]
    if mode == "ptq":
        assert t["rounding_s"] > 0 and "train_steps" not in t and "training:" not in r.stdout
    else:  # seconds per step, where they ran, printed with the table
        assert t["train_steps"] == 6 and t["train_device"].startswith("cpu (") and t["train_step_s"] > 0, t
        assert t["train_step_s_range"][0] <= t["train_step_s"] <= t["train_step_s_range"][1], t
        assert "training: 6 steps on cpu (" in r.stdout, r.stdout[-2000:]
    return summary


@pytest.mark.parametrize(
    "command, recipe, mode",
    [
        pytest.param("calibrate", "xnnpack_8da4w_zp", "ptq", marks=pytest.mark.slow),
        ("fit", "xnnpack_8da4w_zp_lsq", "qat"),
    ],
)
def test_zero_point_programs_through_the_cli_pass_the_gate_with_their_scales_exact(
    tmp_path, tiny_llama, corpus, command, recipe, mode
):
    """``qharness calibrate --model.recipe xnnpack_8da4w_zp`` on the tiny Llama (slow tier: the default tier checks
    the same on ``xnnpack_8da4w_zp_split``, this recipe with the split head input, test_split_input.py):
    ``check_zero_point_program``. ``qharness fit --model.recipe xnnpack_8da4w_zp_lsq``: QAT starts from that
    program, learns its 4-bit scales, and the ``.pte`` quantizes with the trained ones, bit for bit (the 8-bit head
    and its table keep min-max scales)."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, run, model={"recipe": recipe, "mode": mode})
    check_zero_point_program(run_cli(command, "--config", cfg), run, mode)


@pytest.mark.fast
def test_a_tied_head_with_zero_points_is_untied_and_stays_so(tmp_path):
    """``zero_points: ['*']`` on a 4-bit head tied to the table: the head becomes a zero-point layer, the table keeps
    its FP values, the config no longer ties them (so ``tie_weights`` leaves the head alone)."""
    import copy

    from qharness.recipes.rounding import round_weights
    from qharness.sources.embedded import new_llama
    from qharness.sources.models import tied

    torch.manual_seed(0)
    spec = dataclasses.replace(tiny_spec(), num_hidden_layers=1)
    model = new_llama(spec, 128).eval()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    (tmp_path / "r.yaml").write_text("base: xnnpack_8da4w\nmodes: [ptq]\nquantizer: {zero_points: ['*']}\n")
    quantizer = load_recipe(str(tmp_path / "r.yaml")).make_quantizer(is_qat=False)
    rounded = round_weights(model, quantizer, torch.randint(0, 128, (2, 16)), weighted=False)
    assert "lm_head" in rounded.parts and len(rounded.parts) == 8
    deploy = copy.deepcopy(model)
    rounded.load(deploy)
    deploy.tie_weights()
    assert isinstance(deploy.lm_head, ZeroPointLinear) and not tied(deploy)
    assert not deploy.config.tie_word_embeddings
    assert torch.equal(deploy.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.fast
def test_qat_starts_from_the_program_ptq_would_deploy(tiny_llama):
    """``xnnpack_8da4w_zp_lsq``: the QAT graph holds the zero-point layers, the smoothed and rounded weights and the
    scales that the zp recipe's PTQ deploys on the same blocks (every 4-bit weight already on its grid, so training
    starts at PTQ's program); the head and table stay tied and min-max; the trained weights load into a fresh FP
    model (its zero-point layers attached first), and a rebuild for a checkpoint's state has the same structure."""
    from test_learned_scales import FakeTrainer

    from qharness.recipes.rounding import round_weights
    from qharness.sources.models import tied
    from qharness.training.module import QuantLM

    blocks = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    ptq = load_recipe("xnnpack_8da4w_zp")
    m = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w_zp_lsq", mode="qat")
    fp, _ = m.load_fp()
    rounded = round_weights(fp, ptq.make_quantizer(is_qat=False), blocks, True, ptq.settings.smoothing)
    m.build(2, 16, warm_start=blocks)
    m.trainer = FakeTrainer()
    model = m.graph.model
    assert sum(isinstance(x, ZeroPointLinear) for x in model.modules()) == 8 and tied(model)
    starts = {**rounded.weights, **{f"{n}.main.weight": main for n, (main, _) in rounded.parts.items()}}
    learned = m.learned_qparams()
    assert set(learned) == set(rounded.qparams) == set(starts) and len(learned) == 14
    for name, w in starts.items():
        assert torch.equal(model.get_parameter(name), w), name
        assert torch.equal(learned[name][0], rounded.qparams[name][0]), name
        fq = model.get_submodule(name.rpartition(".")[0]).weight_fake_quantizer
        assert torch.equal(fq(w), w), name  # on its grid: the fake quantization changes nothing
    for name, (_, offsets) in rounded.parts.items():
        assert torch.equal(model.get_parameter(f"{name}.offsets.weight"), offsets), name
    fresh, _ = m.load_fp()
    m.load_into(fresh)
    assert isinstance(fresh.model.layers[0].mlp.down_proj, ZeroPointLinear) and tied(fresh)
    assert torch.equal(fresh.model.layers[1].mlp.up_proj.main.weight, starts["model.layers.1.mlp.up_proj.main.weight"])
    cold = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w_zp_lsq", mode="qat")
    cold.build(2, 16)
    assert set(cold.graph.state_dict()) == set(m.graph.state_dict())
