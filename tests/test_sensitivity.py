"""``qharness sensitivity``: per-layer (or per-block) perplexity cost of each candidate precision with the converted
model, paired against the baseline on the same validation blocks; options checked before any model loads."""

import copy
import json

import pytest
import torch
from conftest import run_cli, write_config
from test_mixed_precision import MIX, _recipe, _tiny_model

from qharness.checks.parity import score_batched
from qharness.errors import UserError
from qharness.evaluation.sensitivity import candidate_rule, check_options, measure, weight_bytes
from qharness.recipes.registry import load_recipe


def _blocks(n=4, seq_len=24, vocab=256):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.fast
def test_sub_4bit_candidates_cost_the_bytes_of_int4_on_xnnpack():
    """XNNPACK stores 2/3-bit values as int4 (upstream/fixes/xnnpack_subbyte.py): no size below 4-bit."""
    linear = torch.nn.Linear(64, 32)
    assert weight_bytes(linear, "8da3w-g32") == weight_bytes(linear, "8da2w-g32") == weight_bytes(linear, "8da4w-g32")
    assert weight_bytes(linear, "8da4w-g32") < weight_bytes(linear, "8da8w-pc") < weight_bytes(linear, "fp")


@pytest.mark.fast
def test_candidates_are_the_rules_a_recipe_takes():
    assert candidate_rule("fp") == {"quant": "fp"}
    assert candidate_rule("8da8w-pc") == {"weight_bits": 8, "group_size": None}
    assert candidate_rule("8da4w-g64") == {"weight_bits": 4, "group_size": 64}
    assert candidate_rule("8da3w-pc") == {"weight_bits": 3, "group_size": None}
    assert check_options(load_recipe("xnnpack_8da4w"), None, "layer", "fp") == ["8da8w-pc", "8da4w-pc", "8da4w-g32"]
    assert check_options(load_recipe("xnnpack_8da4w"), None, "block", "recipe")[0] == "fp"
    # a PT2E recipe's run config is measured with the torchao schemes against FP
    assert check_options(load_recipe("xnnpack_int8_dynamic"), "8da4w-g32", "layer", "fp") == ["8da4w-g32"]


@pytest.mark.fast
@pytest.mark.parametrize(
    "recipe, candidates, unit, against, message",
    [
        ("xnnpack_8da4w", "int4", "layer", "fp", "unknown scheme 'int4'"),
        ("xnnpack_8da4w", "8da8w-g32", "layer", "fp", "XNNPACK lowers int8 weights per channel only"),
        ("xnnpack_8da4w", "8da4w-g24", "layer", "fp", "group_size=24 must be a power of two"),
        ("xnnpack_8da4w", "fp,fp", "layer", "fp", "distinct schemes"),
        ("xnnpack_8da4w", None, "row", "fp", "--unit must be one of layer, block"),
        ("xnnpack_8da4w", None, "layer", "int8", "--against must be one of fp, recipe"),
        ("xnnpack_int8_dynamic", None, "layer", "recipe", "--against recipe needs a source-level recipe"),
    ],
)
def test_bad_options_are_one_line_errors(recipe, candidates, unit, against, message):
    with pytest.raises(UserError, match=message):
        check_options(load_recipe(recipe), candidates, unit, against)


@pytest.mark.fast
def test_each_figure_is_the_model_that_recipe_rules_would_deploy(tmp_path):
    """A layer's cell is the perplexity of the FP model with only that layer quantized, as a recipe with per-layer
    rules (one layer at the candidate, the rest fp) converts it: computed here independently through the recipe."""
    model = _tiny_model().eval()
    x, y = _blocks()
    recipe = load_recipe("xnnpack_8da4w")
    result = measure(model, recipe, x, y, 2, ["8da8w-pc", "8da4w-g32"], progress=False)
    units = {u["name"]: u for u in result["units"]}
    assert len(units) == 15 and result["evaluations"] == 1 + 15 * 2
    fp_ppl = score_batched(lambda b: model(input_ids=b).logits, x, y, 2)["ppl"]
    assert result["baseline"]["ppl"] == pytest.approx(fp_ppl, rel=1e-6)  # measure left the model as it was
    for name, scheme, rule in (
        ("model.layers.1.mlp.down_proj", "8da4w-g32", "weight_bits: 4, group_size: 32"),
        ("lm_head", "8da8w-pc", "weight_bits: 8, group_size: null"),
    ):
        rules = f'base: xnnpack_8da4w\nlayers: [{{match: "{name}", {rule}}}, {{match: "*", quant: fp}}]\n'
        deployed = copy.deepcopy(model)
        assert _recipe(tmp_path, rules).make_quantizer(is_qat=False).convert(deployed)[name] == scheme
        ppl = score_batched(lambda b, m=deployed: m(input_ids=b).logits, x, y, 2)["ppl"]
        cell = units[name]["results"][scheme]
        assert cell["ppl"] == pytest.approx(ppl, rel=1e-6) and cell["ppl"] != pytest.approx(fp_ppl, rel=1e-9)
        assert cell["ci"][0] <= cell["ppl_ratio"] <= cell["ci"][1]
        assert cell["ppl_ratio"] == pytest.approx(ppl / fp_ppl, rel=1e-6)
    w = model.lm_head.weight  # 256 x 64, no bias
    assert units["lm_head"]["weight_bytes"] == {
        "8da8w-pc": w.numel() + 4 * 256,
        "8da4w-g32": w.numel() // 2 + 2 * 512,
        "fp": 4 * w.numel(),
    }
    assert weight_bytes(model.lm_head, "fp") == 4 * w.numel()


@pytest.mark.fast
def test_against_the_recipe_blocks_start_from_its_own_assignment(tmp_path):
    """Baseline: the recipe's quantized model (its layers: rules too); a unit's own scheme is the baseline cell,
    and fp there means leaving that unit alone in floating point."""
    model = _tiny_model().eval()
    x, y = _blocks()
    result = measure(
        model, _recipe(tmp_path, MIX), x, y, 2, ["fp", "8da4w-g32"], unit="block", against="recipe", progress=False
    )
    units = {u["name"]: u for u in result["units"]}
    assert list(units) == ["model.layers.0", "model.layers.1", "lm_head"]
    assert len(units["model.layers.0"]["layers"]) == 7
    assert result["baseline"]["schemes"]["lm_head"] == "fp" and units["lm_head"]["results"]["fp"]["baseline"]
    assert units["model.layers.1"]["results"]["fp"].get("baseline") is None  # 8da4w there: fp is a change
    assert result["evaluations"] == 1 + 5  # every (unit, candidate) but lm_head at fp


@pytest.mark.fast
def test_against_a_split_head_recipe_the_head_unsplit_is_a_change(tmp_path):
    """A ``split_head_input`` recipe's baseline labels its head as split; the head at the recipe's own scheme, not
    split, is then a change whose cell is the recipe's model without the split (computed here independently)."""
    model = _tiny_model().eval()
    x, y = _blocks()
    split = _recipe(tmp_path, "base: xnnpack_8da4w\nquantizer: {split_head_input: true}\n")
    result = measure(model, split, x, y, 2, ["8da4w-g32"], unit="block", against="recipe", progress=False)
    units = {u["name"]: u for u in result["units"]}
    assert result["baseline"]["schemes"]["lm_head"] == "8da4w-g32+split-input"
    assert result["evaluations"] == 1 + 1  # only the head: every other unit is at 8da4w-g32 already
    plain = copy.deepcopy(model)
    load_recipe("xnnpack_8da4w").make_quantizer(is_qat=False).convert(plain)
    ppl = score_batched(lambda b: plain(input_ids=b).logits, x, y, 2)["ppl"]
    cell = units["lm_head"]["results"]["8da4w-g32"]
    assert cell["ppl"] == pytest.approx(ppl, rel=1e-6) and cell["ppl"] != pytest.approx(result["baseline"]["ppl"])


def test_sensitivity_cli_writes_table_heat_map_and_json(tmp_path, tiny_llama, corpus):
    (tmp_path / "mix.yaml").write_text(MIX)
    cfg = write_config(
        tmp_path / "run.yaml", tiny_llama, corpus, tmp_path / "run", model={"recipe": str(tmp_path / "mix.yaml")}
    )
    r = run_cli("sensitivity", cfg, "--unit", "block", "--against", "recipe", "--candidates", "fp,8da8w-pc")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sensitivity: validation perplexity change per block" in r.stdout
    assert "sensitivity (block x precision)" in r.stderr  # the progress bar
    result = json.loads((tmp_path / "run" / "sensitivity.json").read_text())
    assert result["candidates"] == {"fp": {"quant": "fp"}, "8da8w-pc": {"weight_bits": 8, "group_size": None}}
    assert [u["name"] for u in result["units"]] == ["model.layers.0", "model.layers.1", "lm_head"]
    assert result["units"][0]["results"]["8da8w-pc"]["baseline"]  # MIX has layer 0 at 8da8w-pc
    assert result["eval_blocks"] == 8 and result["model"] == str(tiny_llama)
    assert (tmp_path / "run" / "sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    assert "model.layers.1" in (tmp_path / "run" / "sensitivity.md").read_text()
    bad = run_cli("sensitivity", cfg, "--candidates", "8da4w-g3")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --candidates 8da4w-g3")
