"""Smoothing the gated MLPs' ``down_proj`` inputs (``quantizer: {smoothing: α}``, ``recipes/smoothing.py``): the same
function, the same weight codes, a smaller int8 activation error where the inputs have outlier groups, refused where
it cannot work."""

import copy
import dataclasses

import pytest
import torch
from conftest import tiny_spec

from qharness.errors import UserError
from qharness.recipes.registry import load_recipe
from qharness.recipes.rounding import round_weights
from qharness.recipes.smoothing import gated_mlps, smoothed, smoothing_factors
from qharness.sources.embedded import new_llama


def _model_with_outliers(layers=2):
    """A tiny Llama (MLP width 128: 4 groups of 32) whose MLPs' products have two channels of one group 50x the
    others (what real models' ``down_proj`` inputs look like)."""
    torch.manual_seed(0)
    model = new_llama(dataclasses.replace(tiny_spec(), num_hidden_layers=layers), 128).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[[3, 7]] *= 50.0
    return model


def _int8_per_token(x):
    """int8 per token, asymmetric (the 8da recipes' activations), as the test's own reference."""
    low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((high - low) / 255).clamp(min=1e-9)
    zero = (-128 - torch.round(low / scale)).clamp(-128, 127)
    return (torch.clamp(torch.round(x / scale) + zero, -128, 127) - zero) * scale


def _recipe(tmp_path, text):
    (tmp_path / "r.yaml").write_text(text)
    return load_recipe(str(tmp_path / "r.yaml"))


@pytest.mark.fast
def test_smoothing_keeps_the_function_and_the_weight_codes(tmp_path):
    model = _model_with_outliers()
    blocks = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    mlps = gated_mlps(model, {n for n, _ in model.named_modules()})
    assert mlps == ["model.layers.0.mlp", "model.layers.1.mlp"]
    factors = smoothing_factors(model, mlps, blocks, alpha=0.5, group=32)
    s = factors["model.layers.0.mlp"]
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    assert torch.equal(s.reshape(-1, 32), s.reshape(-1, 32)[:, :1].expand(-1, 32))  # constant over each group
    assert s.max() / s.min() >= 4  # the outlier groups are divided
    # the smoothed MLP computes the same (powers of two: exactly, up to the order of float sums)
    mlp = model.model.layers[0].mlp
    x = torch.randn(5, mlp.up_proj.in_features)
    ref = mlp(x)
    up, down = smoothed(mlp.up_proj.weight, mlp.down_proj.weight, s)
    smooth = copy.deepcopy(mlp)
    smooth.up_proj.weight.data, smooth.down_proj.weight.data = up, down
    assert torch.allclose(smooth(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())

    # rounded with and without smoothing (zero points on down, weighted scales elsewhere): the same codes, the
    # scales and offsets scaled by exactly the factors
    zp = "base: xnnpack_8da4w_tied8\nmodes: [ptq]\nquantizer: {rounding: weighted, zero_points: ['*.down_proj']"
    plain, with_s = _recipe(tmp_path, zp + "}\n"), _recipe(tmp_path, zp + ", smoothing: 0.5}\n")
    assert plain.settings.smoothing is None and with_s.settings.smoothing == 0.5
    a = round_weights(model, plain.make_quantizer(is_qat=False), blocks, weighted=True)
    b = round_weights(model, with_s.make_quantizer(is_qat=False), blocks, True, with_s.settings.smoothing)
    for i in range(2):
        s = factors[f"model.layers.{i}.mlp"]
        name = f"model.layers.{i}.mlp"
        assert torch.equal(b.weights[f"{name}.up_proj.weight"], a.weights[f"{name}.up_proj.weight"] / s[:, None])
        assert torch.equal(b.qparams[f"{name}.up_proj.weight"][0] * s[:, None], a.qparams[f"{name}.up_proj.weight"][0])
        (main_a, off_a), (main_b, off_b) = a.parts[f"{name}.down_proj"], b.parts[f"{name}.down_proj"]
        assert torch.equal(main_b, main_a * s[None, :])
        assert torch.allclose(off_b, off_a * s[::32][None, :], rtol=1e-6)
        for other in ("mlp.gate_proj", "self_attn.q_proj"):  # untouched
            key = f"model.layers.{i}.{other}.weight"
            assert torch.equal(b.weights[key], a.weights[key])


@pytest.mark.fast
def test_smoothing_makes_the_int8_activation_error_smaller_where_inputs_have_outliers():
    model = _model_with_outliers(layers=1)
    blocks = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(2))
    mlp = model.model.layers[0].mlp
    xs = []
    hook = mlp.down_proj.register_forward_hook(lambda m, i, o: xs.append(i[0].reshape(-1, i[0].shape[-1])))
    with torch.no_grad():
        model(input_ids=blocks)
    hook.remove()
    x, w = xs[0], mlp.down_proj.weight.detach()
    s = smoothing_factors(model, ["model.layers.0.mlp"], blocks, alpha=0.5, group=32)["model.layers.0.mlp"]
    _, down = smoothed(mlp.up_proj.weight, mlp.down_proj.weight, s)
    exact = x @ w.T
    plain = ((_int8_per_token(x) @ w.T) - exact).pow(2).sum()
    smooth = ((_int8_per_token(x / s) @ down.T) - exact).pow(2).sum()
    assert smooth < 0.5 * plain, (smooth, plain)


@pytest.mark.fast
def test_smoothing_is_refused_where_it_cannot_work(tmp_path):
    for bad, match in (("1.5", r"smoothing=1.5 must be a migration strength in \(0, 1\]"), ("true", "smoothing=True")):
        with pytest.raises(UserError, match=match):
            _recipe(tmp_path, f"base: xnnpack_8da4w\nquantizer: {{smoothing: {bad}}}\n")
    with pytest.raises(UserError, match="smoothing with rounding: gptq"):
        _recipe(tmp_path, "base: xnnpack_8da4w\nquantizer: {smoothing: 0.5, rounding: gptq}\n")
    qat = _recipe(tmp_path, "base: xnnpack_8da4w\nmodes: [qat, ptq]\nquantizer: {smoothing: 0.5}\n")
    with pytest.raises(UserError, match="smoothing chooses .* PTQ"):
        qat.make_quantizer(is_qat=True)

    class NotGated(torch.nn.Module):  # has the three projections, but the product is not up's output times a gate
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(32, 64), torch.nn.Linear(32, 64)
            self.down_proj = torch.nn.Linear(64, 32)

        def forward(self, x):
            return self.down_proj(torch.relu(self.up_proj(x)) + self.gate_proj(x))

    holder = torch.nn.Module()
    holder.add_module("mlp", NotGated())
    with pytest.raises(UserError, match="mlp .*NotGated.* is not a gated MLP"):
        gated_mlps(holder, {"mlp.up_proj", "mlp.down_proj"})
    assert gated_mlps(holder, {"mlp.up_proj"}) == []  # not rounded: not smoothed, not checked


@pytest.mark.fast
def test_a_recipe_whose_rules_keep_every_mlp_out_of_the_rounded_layers_smooths_none(tmp_path):
    """``layers:`` rules (autotune's plan) that put every gated MLP at 8 bits per channel leave smoothing nothing to
    smooth: rounding goes on without it (it stopped the run, after autotune's measurements, with "has no gated
    MLP"); a model without a gated MLP is still refused."""
    model = _model_with_outliers()
    blocks = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    rules = _recipe(
        tmp_path,
        "base: xnnpack_8da4w_zp_split\nlayers:\n  - {match: '*.mlp.*', weight_bits: 8, group_size: null}\n",
    )
    rounded = round_weights(model, rules.make_quantizer(is_qat=False), blocks, weighted=False, smoothing=0.5)
    assert set(rounded.parts) == {f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("k_proj", "v_proj")}
    assert not any(".mlp." in n for n in [*rounded.weights, *rounded.parts])

    holder = torch.nn.Module()
    holder.add_module("fc", torch.nn.Linear(64, 64))
    quantizer = load_recipe("xnnpack_8da4w_zp_split").make_quantizer(is_qat=False)
    with pytest.raises(UserError, match="has no gated MLP"):
        round_weights(holder, quantizer, blocks, weighted=False, smoothing=0.5)
