"""The lm_head's input rounded as two int8 rows (``split_head_input``, ``recipes/split_input.py``): the rows' sum is the
input at about 16 bits, the quantized head computes it with one GEMM of twice the rows, QAT's fake quantizer computes
the same function, and the recipes deploy through the CLI within the parity gate."""

import pytest
import torch
from conftest import run_cli, write_config
from test_zero_points import check_zero_point_program

from qharness.errors import UserError
from qharness.recipes.registry import load_recipe
from qharness.recipes.split_input import SplitInput, TwiceRounded, on_grid, split_head_input, split_rows
from qharness.upstream.fixes.xnnpack_per_token import fake_quantize_per_token


def _outlier_rows(n=16, d=96, seed=0):
    """Rows like a final norm's output: most channels small, a few far larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, :3] *= 40.0
    return x


class _Tiny(torch.nn.Module):
    """A model with an output projection (``get_output_embeddings``), as HF models have."""

    def __init__(self, d=96, vocab=64):
        super().__init__()
        self.body = torch.nn.Linear(d, d)
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)
        torch.nn.init.normal_(self.lm_head.weight, generator=torch.Generator().manual_seed(1))

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, x):
        return self.lm_head(self.body(x))


@pytest.mark.fast
def test_the_grid_half_is_requantized_exactly_and_the_sum_is_sixteen_bits():
    """``hi`` is on the grid a per-token int8 kernel (XNNPACK's rule) rounds it to, so the kernel leaves it; the
    remainder's own rounding leaves an error ~255x smaller than one int8 rounding's."""
    x = _outlier_rows()
    hi = on_grid(x)
    assert torch.allclose(fake_quantize_per_token(hi), hi, rtol=0, atol=1e-6 * x.abs().max().item())
    once = (fake_quantize_per_token(x) - x).abs().max(-1).values
    rows = split_rows(x)
    assert rows.shape == (32, 96)
    twice = (fake_quantize_per_token(rows[:16]) + fake_quantize_per_token(rows[16:]) - x).abs().max(-1).values
    assert (twice < once / 100).all(), (twice / once).max()


@pytest.mark.fast
def test_the_quantized_head_runs_twice_the_rows_and_returns_the_sum():
    """After torchao's ``quantize_`` (8-bit per-channel weights, int8 activations per token) the split head computes
    ``W hi + W q(lo)``: much closer to the float input's product with the same int8 weights than the plain head."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis

    model = _Tiny()
    ref_weights = _Tiny()
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    quantize_(model, config, filter_fn=lambda m, fqn: fqn == "lm_head")
    x = _outlier_rows()[None]
    with torch.no_grad():
        w = model.lm_head.weight.dequantize()
        exact = x @ w.T  # the input in float, the deployed int8 weights
        plain = model.lm_head(x)
        assert split_head_input(model) == "lm_head"
        assert isinstance(model.lm_head, SplitInput) and isinstance(model.lm_head, torch.nn.Linear)
        split = model.lm_head(x)
    assert split.shape == plain.shape == (1, 16, 64)
    err_plain, err_split = (plain - exact).abs().max(), (split - exact).abs().max()
    assert err_split < err_plain / 50, (err_split, err_plain)
    assert set(model.state_dict()) == set(ref_weights.state_dict())  # names and state dict unchanged


@pytest.mark.fast
def test_qat_fake_quantization_computes_what_the_deployed_head_computes():
    """QAT's head (torchao's ``FakeQuantizedLinear``, its activation fake quantizer wrapped in ``TwiceRounded``) and
    the converted head (two rows through one quantized GEMM) give the same logits; the gradient reaches the input."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis
    from torchao.quantization.qat import QATConfig

    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    qat, deployed = _Tiny(), _Tiny()
    deployed.load_state_dict(qat.state_dict())
    quantize_(qat, QATConfig(config, step="prepare"), filter_fn=lambda m, fqn: fqn == "lm_head")
    split_head_input(qat)
    assert isinstance(qat.lm_head.activation_fake_quantizer, TwiceRounded)
    quantize_(deployed, config, filter_fn=lambda m, fqn: fqn == "lm_head")
    split_head_input(deployed)
    x = _outlier_rows()[None].requires_grad_(True)
    trained = qat.lm_head(x)
    with torch.no_grad():
        shipped = deployed.lm_head(x)
    assert torch.allclose(trained, shipped, rtol=0, atol=1e-4 * shipped.abs().max().item())
    trained.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    qat.lm_head.activation_fake_quantizer.enabled = False  # the switch qat_loss_sources.py turns
    assert torch.allclose(qat.lm_head(x), x @ qat.lm_head.weight_fake_quantizer(qat.lm_head.weight).T, atol=1e-5)


@pytest.mark.fast
def test_a_split_head_the_recipe_keeps_in_float_is_refused_and_single_layers_are_not_split(tmp_path):
    (tmp_path / "r.yaml").write_text(
        "base: xnnpack_8da4w\nquantizer: {split_head_input: true}\nlayers: [{match: lm_head, quant: fp}]\n"
    )
    with pytest.raises(UserError, match=r"split_head_input: _Tiny's output projection \(lm_head\) is not quantized"):
        load_recipe(str(tmp_path / "r.yaml")).make_quantizer(is_qat=False).check(_Tiny(d=64))
    (tmp_path / "rule.yaml").write_text(
        "base: xnnpack_8da4w\nlayers: [{match: lm_head, weight_bits: 8, group_size: null, split_head_input: true}]\n"
    )
    with pytest.raises(UserError, match="recipe-wide setting"):
        load_recipe(str(tmp_path / "rule.yaml"))
    # qharness sensitivity quantizes copies of single layers (no output projection): they are not split
    (tmp_path / "split.yaml").write_text("base: xnnpack_8da4w\nquantizer: {split_head_input: true}\n")
    holder = torch.nn.ModuleDict({"0": torch.nn.Linear(64, 32)})
    assert load_recipe(str(tmp_path / "split.yaml")).make_quantizer(is_qat=False).convert(holder) == {"0": "8da4w-g32"}
    assert not isinstance(holder["0"], SplitInput)


@pytest.mark.parametrize(
    "command, recipe, mode",
    [
        ("calibrate", "xnnpack_8da4w_zp_split", "ptq"),
        pytest.param("fit", "xnnpack_8da4w_zp_split_lsq", "qat", marks=pytest.mark.slow),
    ],
)
def test_split_head_programs_through_the_cli_pass_the_gate(tmp_path, tiny_llama, corpus, command, recipe, mode):
    """``qharness calibrate --model.recipe xnnpack_8da4w_zp_split`` on the tiny Llama: the ``.pte`` (its head's
    GEMM of two rows inside the delegate: no projection outside it) passes the gate against the converted model,
    which computes the same split, with everything its base ``xnnpack_8da4w_zp`` shows (zero points, smoothing,
    scales bit for bit: ``test_zero_points.check_zero_point_program``)."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, run, model={"recipe": recipe, "mode": mode})
    r = run_cli(command, "--config", cfg)
    summary = check_zero_point_program(r, run, mode)
    assert summary["layers"]["schemes"]["lm_head"] == "8da8w-pc+split-input", summary["layers"]["schemes"]
    assert "1 x 8da8w-pc+split-input" in r.stdout, r.stdout[-3000:]  # the run's table labels the split head
    assert summary["coverage"]["float"] == {} and summary["coverage"]["fraction"] == 1.0, summary["coverage"]
