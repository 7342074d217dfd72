"""Per-layer quantization (a recipe's ``layers:`` rules, ``qharness/recipes/layers.py``): rules are checked when the
recipe is read and against the model before any work; each module gets its rule's scheme in QAT and deployment;
the ``.pte`` passes parity and ``summary.json`` records the assignment."""

import json
import logging

import pytest
from conftest import run_cli, write_config

from qharness.errors import UserError
from qharness.recipes.registry import load_recipe

MIX = """base: xnnpack_8da4w
quantizer: {embedding_bits: null}
layers:
  - {match: "lm_head", quant: fp}
  - {match: "model.layers.0.*", weight_bits: 8, group_size: null}
  - {match: "model.layers.1.mlp.*", group_size: null}
"""
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
EXPECTED = {  # MIX on the tiny 2-layer Llama
    **{f"model.layers.0.{n}": "8da8w-pc" for n in LINEARS + MLP},
    **{f"model.layers.1.{n}": "8da4w-g32" for n in LINEARS},
    **{f"model.layers.1.{n}": "8da4w-pc" for n in MLP},
    "lm_head": "fp",
}


def _recipe(tmp_path, text: str, name: str = "mix.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return load_recipe(str(path))


def _tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


@pytest.mark.fast
def test_rules_are_read_as_typed_settings(tmp_path):
    r = _recipe(tmp_path, MIX)
    assert [rule.match for rule in r.layers] == ["lm_head", "model.layers.0.*", "model.layers.1.mlp.*"]
    assert r.layers[0].settings is None  # fp
    assert (r.layers[1].settings.weight_bits, r.layers[1].settings.group_size) == (8, None)
    assert (r.layers[2].settings.weight_bits, r.layers[2].settings.group_size) == (4, None)  # the rest from the base
    assert r.settings.group_size == 32 and not load_recipe("xnnpack_8da4w").layers


@pytest.mark.fast
@pytest.mark.parametrize(
    "layers, message",
    [
        ("layers: {match: lm_head}", "layers must be a non-empty list of rules"),
        ("layers: [lm_head]", r"layers\[0\] must be a mapping"),
        ("layers: [{quant: fp}]", r"layers\[0\]: match must be a module-name pattern"),
        ("layers: [{match: lm_head, bits: 8}]", r"layers\[0\]: unknown setting\(s\) bits.*settings among group_size"),
        ("layers: [{match: lm_head, learn_scales: true}]", r"recipe-wide setting\(s\) learn_scales"),
        ("layers: [{match: lm_head, quant: int4}]", r"quant must be fp \(got 'int4'\)"),
        ("layers: [{match: lm_head, quant: fp, weight_bits: 8}]", "quant: fp takes no settings"),
        ("layers: [{match: lm_head}]", r"layers\[0\] sets nothing for 'lm_head'"),
        ("layers: [{match: lm_head, weight_bits: eight}]", r"layers\[0\]: weight_bits='eight' must be int"),
        ("layers: [{match: lm_head, weight_bits: 8}]", "weight_bits=8 with group_size=32: XNNPACK lowers int8"),
        ("layers: [{match: lm_head, group_size: 24}]", "group_size=24 must be a power of two"),
    ],
)
def test_bad_rules_are_one_line_errors_when_read(tmp_path, layers, message):
    with pytest.raises(UserError, match=message):
        _recipe(tmp_path, f"base: xnnpack_8da4w\n{layers}\n")


@pytest.mark.fast
@pytest.mark.parametrize(
    "base, message",
    [("xnnpack_int8_dynamic", "need a source-level quantizer.*'xnnpack'"), ("xnnpack_fp32", "quantizes nothing")],
)
def test_rules_need_a_source_level_recipe(tmp_path, base, message):
    with pytest.raises(UserError, match=message):
        _recipe(tmp_path, f'base: {base}\nlayers: [{{match: "lm_head", quant: fp}}]\n')


@pytest.mark.fast
def test_each_layer_gets_its_rules_scheme(tmp_path):
    """The assignment is what the converted weights are: int8 per channel, int4 per channel or in groups, or FP."""
    import torch

    recipe = _recipe(tmp_path, MIX)
    model = _tiny_model()
    assert recipe.make_quantizer(is_qat=True).check(model) == EXPECTED
    assert recipe.make_quantizer(is_qat=False).convert(model) == EXPECTED
    for name, scheme in EXPECTED.items():
        w = model.get_submodule(name).weight
        if scheme == "fp":
            assert type(w) is torch.nn.Parameter and w.dtype == torch.float32, name
            continue
        bits = {"8da8w": torch.int8, "8da4w": torch.int4}[scheme[:5]]
        block = w.shape[1] if scheme.endswith("-pc") else 32
        assert (w.target_dtype, tuple(w.block_size)) == (bits, (1, block)), name
        assert w.activation_quantization is not None, name  # int8 dynamic activations
        q = w.qdata
        assert q.min() >= (-128 if bits == torch.int8 else -8) and q.max() <= (127 if bits == torch.int8 else 7)
        if bits == torch.int8:
            assert q.abs().max() > 7, name  # truly 8-bit, not 4-bit values in int8 storage


@pytest.mark.fast
def test_qat_prepare_follows_the_rules(tmp_path):
    """QAT fake-quantizes exactly the assigned layers, with each rule's granularity and bits."""
    import torch

    model = _tiny_model()
    _recipe(tmp_path, MIX).make_quantizer(is_qat=True).prepare_qat(model)
    fake = {n: m for n, m in model.named_modules() if hasattr(m, "weight_fake_quantizer")}
    assert set(fake) == {n for n, s in EXPECTED.items() if s != "fp"}
    assert fake["model.layers.0.mlp.up_proj"].weight_fake_quantizer.config.dtype == torch.int8
    assert fake["model.layers.1.mlp.up_proj"].weight_fake_quantizer.config.dtype == torch.int4
    assert fake["model.layers.1.self_attn.q_proj"].weight_fake_quantizer.config.granularity.group_size == 32
    assert type(model.lm_head) is torch.nn.Linear


@pytest.mark.fast
@pytest.mark.parametrize(
    "layers, message",
    [
        (
            '[{match: "model.layers.7.*", quant: fp}]',
            r"layers\[0\] \(match 'model.layers.7.\*'\) matches no quantizable",
        ),
        ('[{match: "lm_head", quant: fp}, {match: "lm_*", quant: fp}]', r"layers\[1\].*takes no layer: earlier rules"),
        ('[{match: "*", quant: fp}]', "keep every quantizable layer .* in floating point"),
        (
            '[{match: "model.embed_tokens", quant: fp}]',
            r"match 'model.embed_tokens'.*matches no quantizable",
        ),  # no embedding_bits
    ],
)
def test_patterns_are_checked_against_the_model(tmp_path, layers, message):
    recipe = _recipe(tmp_path, f"base: xnnpack_8da4w\nquantizer: {{embedding_bits: null}}\nlayers: {layers}\n")
    with pytest.raises(UserError, match=message) as e:
        recipe.make_quantizer(is_qat=False).check(_tiny_model())
    if "match" in message:  # a pattern that takes nothing: the fix shows names to pattern on
        assert "fix: patterns are fnmatch globs on module names: model.layers.0.self_attn.q_proj" in str(e.value)


@pytest.mark.fast
def test_embeddings_follow_rules_and_layers_a_group_cannot_split_stay_fp(tmp_path, caplog):
    recipe = _recipe(
        tmp_path,
        "base: xnnpack_8da4w\nquantizer: {embedding_bits: 4}\n"
        'layers: [{match: "model.embed_tokens", embedding_bits: 8, embedding_group_size: null},'
        ' {match: "*.self_attn.q_proj", group_size: 128}]\n',
    )
    with caplog.at_level(logging.WARNING):
        layers = recipe.make_quantizer(is_qat=False).check(_tiny_model())
    assert layers["model.embed_tokens"] == "w8-pc" and layers["model.layers.0.mlp.down_proj"] == "8da4w-g32"
    assert layers["model.layers.0.self_attn.q_proj"] == "fp"  # in_features 64: no group of 128
    assert "cannot quantize model.layers.0.self_attn.q_proj, model.layers.1.self_attn.q_proj" in caplog.text


def test_qat_fit_with_per_layer_rules_passes_parity_and_records_the_assignment(tmp_path, tiny_llama, corpus):
    """The end-to-end check: QAT with the rules, the .pte against the converted model (gate) and against the trained
    fake-quant model, and the assignment and size in summary.json."""
    (tmp_path / "mix.yaml").write_text(MIX)
    cfg = write_config(
        tmp_path / "run.yaml",
        tiny_llama,
        corpus,
        tmp_path / "run",
        model={"recipe": str(tmp_path / "mix.yaml")},
        bench={"enabled": False},
    )
    r = run_cli("fit", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["parity"]["passed"] and s["parity"]["fake_quant"]["passed"], s["parity"]
    assert s["layers"]["schemes"] == EXPECTED
    assert s["layers"]["counts"] == {"8da4w-g32": 4, "8da4w-pc": 3, "8da8w-pc": 7, "fp": 1}
    assert s["layers"]["rules"][1] == {"match": "model.layers.0.*", "weight_bits": 8, "group_size": None}
    assert s["pte"]["size_bytes"] == (tmp_path / "run" / "model.pte").stat().st_size
    assert "layers: 4 x 8da4w-g32, 3 x 8da4w-pc, 7 x 8da8w-pc, 1 x fp" in r.stdout


@pytest.mark.slow
def test_calibrate_with_rules_and_a_pattern_that_matches_nothing(tmp_path, tiny_llama, corpus):
    (tmp_path / "mix.yaml").write_text(MIX)
    (tmp_path / "bad.yaml").write_text('base: xnnpack_8da4w\nlayers: [{match: "model.layer.0.*", quant: fp}]\n')
    for name in ("mix", "bad"):
        write_config(
            tmp_path / f"{name}_run.yaml",
            tiny_llama,
            corpus,
            tmp_path / name,
            model={"recipe": str(tmp_path / f"{name}.yaml"), "mode": "ptq"},
            bench={"enabled": False},
        )
    r = run_cli("calibrate", tmp_path / "bad_run.yaml")
    assert r.returncode == 2 and "matches no quantizable layer" in r.stderr
    assert not (tmp_path / "bad" / "model.pte").exists()
    r = run_cli("calibrate", tmp_path / "mix_run.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((tmp_path / "mix" / "summary.json").read_text())
    assert s["parity"]["passed"] and s["layers"]["schemes"] == EXPECTED
