import pytest

from qharness.errors import UserError
from qharness.recipes.registry import known_recipes, load_recipe
from qharness.recipes.xnnpack import XnnpackSettings


@pytest.mark.fast
def test_builtin_recipe_loads():
    r = load_recipe("xnnpack_int8_dynamic")
    assert r.backend == "xnnpack" and r.quantized and set(r.modes) == {"qat", "ptq"}
    assert r.partitioners == ("xnnpack_dynamic_quant", "xnnpack")


@pytest.mark.fast
def test_unknown_recipe_lists_known():
    with pytest.raises(UserError) as e:
        load_recipe("xnnpack_int3")
    assert "unknown recipe 'xnnpack_int3'" in str(e.value)
    for name in known_recipes():
        assert name in str(e.value)


@pytest.mark.fast
def test_recipe_inherits_and_overrides(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("base: xnnpack_int8_dynamic\ndescription: per-tensor child\nquantizer:\n  per_channel: false\n")
    r = load_recipe(str(child))
    assert r.name == "child" and r.description == "per-tensor child"
    assert r.quantizer == "xnnpack" and r.kind == "pt2e"
    assert r.settings == XnnpackSettings(per_channel=False, dynamic=True, weight_bits=8)
    assert r.partitioners == load_recipe("xnnpack_int8_dynamic").partitioners


@pytest.mark.fast
def test_unknown_field_names_it_and_lists_known(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: xnnpack_fp32\npartitioner: [xnnpack]\n")
    with pytest.raises(UserError, match="unknown field.*partitioner.*known fields.*partitioners"):
        load_recipe(str(bad))


@pytest.mark.fast
def test_unknown_quantizer_setting_is_caught(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: xnnpack_int8_dynamic\nquantizer:\n  bits: 4\n")
    with pytest.raises(UserError, match="unknown setting.*bits.*known settings: per_channel"):
        load_recipe(str(bad))  # when the recipe is read, before any model is loaded


@pytest.mark.fast
def test_mode_not_supported(tmp_path):
    with pytest.raises(UserError, match="does not support mode 'qat'"):
        load_recipe("xnnpack_fp32").check_mode("qat")


@pytest.mark.fast
def test_cyclic_base(tmp_path):
    (tmp_path / "a.yaml").write_text(f"base: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(UserError, match="extends itself"):
        load_recipe(str(tmp_path / "a.yaml"))


@pytest.mark.fast
def test_8da4w_hqq_recipe_is_ptq_only_and_lowers_weight_error():
    """HQQ-optimised scales (export_llm's 8da4w default) reconstruct the weights better than min-max scales;
    QAT, which trains against min-max scales, refuses them."""
    import copy

    import torch

    r = load_recipe("xnnpack_8da4w_hqq")
    assert r.modes == ("ptq",) and r.settings.choose_qparams == "hqq_scale_only" and r.kind == "source"
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


@pytest.mark.fast
@pytest.mark.parametrize(
    "quantizer, message",
    [
        ("{name: xnnpack, weight_bits: three}", "weight_bits='three' must be int"),
        ("{name: xnnpack, weight_bits: 3}", "weight_bits=3 is not supported"),
        ("{name: xnnpack, per_channel: 1}", "per_channel=1 must be bool"),
        ("{name: xnnpack, dynamic: false, activation_observer: kde}", "unknown activation_observer 'kde'"),
        ("{name: xnnpack, activation_observer: minmax}", "activation_observer applies to static activations only"),
        ("{name: torchao_8da4w, group_size: 0}", "group_size=0 must be a power of two"),
        ("{name: torchao_8da4w, group_size: 7}", "group_size=7 must be a power of two"),
        ("{name: torchao_8da4w, embedding_bits: 2}", "embedding_bits=2 is not supported.*use null .*, 4 or 8"),
        ("{name: torchao_8da4w, weight_bits: 5}", "weight_bits=5 is not supported.*use one of 2, 3, 4, 8"),
        ("[1, 2]", "quantizer must be a mapping with a name"),
        ("{name: int3}", "unknown quantizer 'int3'.*known quantizers: torchao_8da4w, vulkan, xnnpack"),
    ],
)
def test_settings_are_typed_and_checked_when_read(tmp_path, quantizer, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"description: d\nbackend: xnnpack\nquantizer: {quantizer}\n")
    with pytest.raises(UserError, match=message):
        load_recipe(str(bad))


@pytest.mark.fast
@pytest.mark.parametrize(
    "text, message",
    [
        ("description: d\nbackend: x\nquantizer: {name: xnnpack\n", "not valid YAML \\(line"),
        (
            "description: d\nbackend: x\nexecutorch_config: {do_quant_fusion: true}\n",
            "unknown executorch_config field.*do_quant_fusion",
        ),
        ("description: d\nbackend: x\npartitioners: xnnpack\n", "partitioners must be a list of names"),
        ("description: d\nbackend: x\nruns_here: maybe\n", "runs_here must be true or false"),
        ("- a\n- b\n", "must hold a mapping"),
    ],
)
def test_malformed_recipe_files_are_one_line_errors(tmp_path, text, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(UserError, match=message):
        load_recipe(str(bad))


@pytest.mark.fast
def test_executorch_config_fields_are_the_installed_ones():
    """The list recipes are checked against (without importing ExecuTorch) is ExecutorchBackendConfig's fields."""
    import dataclasses

    from executorch.exir import ExecutorchBackendConfig

    from qharness.recipes.registry import EXECUTORCH_CONFIG_FIELDS

    assert EXECUTORCH_CONFIG_FIELDS == {f.name for f in dataclasses.fields(ExecutorchBackendConfig)}


@pytest.mark.fast
def test_every_recipe_has_a_kind():
    kinds = {name: load_recipe(name).kind for name in known_recipes()}
    assert (
        kinds["xnnpack_fp32"] == "fp" and kinds["xnnpack_8da4w"] == "source" and kinds["xnnpack_int8_dynamic"] == "pt2e"
    )
    assert set(kinds.values()) <= {"fp", "pt2e", "source"}


@pytest.mark.fast
@pytest.mark.parametrize("name", known_recipes())
def test_every_recipe_builds_its_quantizer_and_partitioners(name):
    """Each built-in recipe's quantizer (for each of its modes) and partitioners construct against the installed
    upstreams, e.g. Vulkan's, which no end-to-end test lowers."""
    recipe = load_recipe(name)
    for mode in recipe.modes:
        assert (recipe.make_quantizer(is_qat=mode == "qat") is None) == (not recipe.quantized)
    assert len(recipe.make_partitioners()) == len(recipe.partitioners)


@pytest.mark.fast
def test_a_source_recipe_that_selects_no_layer_is_refused():
    """8da4w with a group size dividing no layer would ship an unquantized program labelled quantized."""
    import torch

    r = load_recipe("xnnpack_8da4w")
    with pytest.raises(UserError, match="selects no layer.*group_size=32"):
        r.make_quantizer(is_qat=False).convert(torch.nn.Sequential(torch.nn.Linear(24, 8)))
