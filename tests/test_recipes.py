import pytest

from qharness.errors import UserError
from qharness.recipes.registry import known_recipes, load_recipe


def test_builtin_recipe_loads():
    r = load_recipe("xnnpack_int8_dynamic")
    assert r.backend == "xnnpack" and r.quantized and set(r.modes) == {"qat", "ptq"}
    assert r.partitioners == ("xnnpack_dynamic_quant", "xnnpack")


def test_unknown_recipe_lists_known():
    with pytest.raises(UserError) as e:
        load_recipe("xnnpack_int3")
    assert "unknown recipe 'xnnpack_int3'" in str(e.value)
    for name in known_recipes():
        assert name in str(e.value)


def test_recipe_inherits_and_overrides(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("base: xnnpack_int8_dynamic\ndescription: per-tensor child\nquantizer:\n  per_channel: false\n")
    r = load_recipe(str(child))
    assert r.name == "child" and r.description == "per-tensor child"
    assert r.quantizer == {"name": "xnnpack", "per_channel": False, "dynamic": True, "weight_bits": 8}
    assert r.partitioners == load_recipe("xnnpack_int8_dynamic").partitioners


def test_unknown_field_names_it_and_lists_known(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: xnnpack_fp32\npartitioner: [xnnpack]\n")
    with pytest.raises(UserError, match="unknown field.*partitioner.*known fields.*partitioners"):
        load_recipe(str(bad))


def test_unknown_quantizer_setting_is_caught(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: xnnpack_int8_dynamic\nquantizer:\n  bits: 4\n")
    with pytest.raises(UserError, match="unknown setting.*bits"):
        load_recipe(str(bad)).make_quantizer(is_qat=False)


def test_mode_not_supported(tmp_path):
    with pytest.raises(UserError, match="does not support mode 'qat'"):
        load_recipe("xnnpack_fp32").check_mode("qat")


def test_cyclic_base(tmp_path):
    (tmp_path / "a.yaml").write_text(f"base: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(UserError, match="extends itself"):
        load_recipe(str(tmp_path / "a.yaml"))


def test_8da4w_hqq_recipe_is_ptq_only_and_lowers_weight_error():
    """HQQ-optimised scales (export_llm's 8da4w default) reconstruct the weights better than min-max scales;
    QAT, which trains against min-max scales, refuses them."""
    import copy

    import torch

    r = load_recipe("xnnpack_8da4w_hqq")
    assert r.modes == ("ptq",) and r.quantizer["choose_qparams"] == "hqq_scale_only"
    with pytest.raises(UserError, match="choose_qparams 'hqq_scale_only' has no QAT"):
        r.make_quantizer(is_qat=True)
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    x = torch.randn(64, 256)
    errors = {}
    for name in ("xnnpack_8da4w", "xnnpack_8da4w_hqq"):
        m = copy.deepcopy(linear)
        load_recipe(name).make_quantizer(is_qat=False).convert(m)
        errors[name] = (m(x) - linear(x)).pow(2).mean().item()
    assert 0 < errors["xnnpack_8da4w_hqq"] < errors["xnnpack_8da4w"]
