"""``qharness autotune``: the per-layer assignment of least predicted cost under a ``.pte`` size budget (an exact
knapsack over the sensitivity table), written as a recipe that the normal path runs; its size prediction, its bad
input, and the sweep entry that names a budget."""

import itertools
import json
import math

import pytest
import yaml
from conftest import make_tiny_hf, run_cli, write_config
from test_mixed_precision import _recipe, _tiny_model

from qharness.errors import UserError
from qharness.evaluation import autotune as at
from qharness.evaluation.sensitivity import OVERHEAD_PER_LAYER_BYTES, format_table, shared_table_bytes, unit_sizes
from qharness.sweep.plan import plan
from qharness.sweep.spec import load_sweep

CANDIDATES = {
    "8da8w-pc": {"weight_bits": 8, "group_size": None},
    "8da4w-pc": {"weight_bits": 4, "group_size": None},
    "8da4w-g32": {"weight_bits": 4, "group_size": 32},
}


def _table(costs: dict[str, dict[str, float]], sizes: dict[str, dict[str, int]]) -> dict:
    """A sensitivity.json (against fp) with the given ppl ratios - 1 and weight bytes per unit and scheme."""
    return {
        "against": "fp",
        "unit": "layer",
        "candidates": CANDIDATES,
        "baseline": {"ppl": 50.0},
        "units": [
            {
                "name": u,
                "layers": [u],
                "weight_bytes": sizes[u],
                "results": {c: {"applicable": True, "ppl_ratio": 1 + v} for c, v in costs[u].items()},
            }
            for u in costs
        ],
    }


SIZES = {"fp": 4000, "8da8w-pc": 1040, "8da4w-g32": 560, "8da4w-pc": 520}
COSTS = {
    "a": {"8da8w-pc": 0.0001, "8da4w-g32": 0.030, "8da4w-pc": 0.050},  # sensitive
    "b": {"8da8w-pc": 0.0002, "8da4w-g32": 0.002, "8da4w-pc": 0.004},  # robust
    "c": {"8da8w-pc": 0.0001, "8da4w-g32": 0.010, "8da4w-pc": 0.012},
    "d": {"8da8w-pc": 0.0000, "8da4w-g32": 0.001, "8da4w-pc": 0.020},  # 8-bit costs nothing: never fp
}


def _brute_force(table, budget, rest):
    """The least summed log cost over every assignment that fits (isotonic costs, as the planner reads them)."""
    opts = [at.options(u) for u in table["units"]]
    best = (math.inf, math.inf)
    for picks in itertools.product(*[list(o.items()) for o in opts]):
        nbytes = rest + sum(b for _, (b, _) in picks)
        if nbytes <= budget:
            best = min(best, (round(sum(c for _, (_, c) in picks), 12), nbytes))
    return best


@pytest.mark.fast
@pytest.mark.parametrize("budget", [3080, 3300, 3600, 4100, 4800, 9000, 13000])
def test_the_plan_is_the_exact_least_cost_assignment_that_fits(budget):
    table = _table(COSTS, {u: SIZES for u in COSTS})
    plan = at.choose(table, budget, rest_bytes=1000, resolution=1)
    opts = {u["name"]: at.options(u) for u in table["units"]}
    cost = sum(opts[u][s][1] for u, s in plan.schemes.items())
    assert plan.predicted_bytes <= budget
    assert plan.predicted_bytes == 1000 + sum(SIZES[s] for s in plan.schemes.values())
    assert (round(cost, 12), plan.predicted_bytes) == _brute_force(table, budget, 1000)
    assert plan.predicted_ppl == pytest.approx(50.0 * math.exp(cost))


@pytest.mark.fast
def test_coarse_resolution_never_exceeds_the_budget():
    table = _table(COSTS, {u: SIZES for u in COSTS})
    for budget in range(3080, 5200, 37):
        assert at.choose(table, budget, 1000, resolution=97).predicted_bytes <= budget


@pytest.mark.fast
def test_the_sensitive_unit_keeps_precision_first():
    plan = at.choose(_table(COSTS, {u: SIZES for u in COSTS}), 1000 + 1040 + 3 * 560, 1000, resolution=1)
    assert plan.schemes == {"a": "8da8w-pc", "b": "8da4w-g32", "c": "8da4w-g32", "d": "8da4w-g32"}
    assert plan.rules[0] == {"match": "a", "weight_bits": 8, "group_size": None}


@pytest.mark.fast
def test_a_scheme_never_costs_less_than_one_storing_more_bytes():
    """A 4-bit cell below its 8-bit cell (noise) is read at the 8-bit cost, so equal costs go to fewer bytes."""
    costs = {"a": {"8da8w-pc": 0.004, "8da4w-g32": -0.001, "8da4w-pc": 0.010}}
    opts = at.options(_table(costs, {"a": SIZES})["units"][0])
    assert opts["fp"] == (4000, 0.0)
    assert opts["8da4w-g32"][1] == pytest.approx(math.log(1.004)) == opts["8da8w-pc"][1]
    assert opts["8da4w-pc"][1] == pytest.approx(math.log(1.010))


@pytest.mark.fast
def test_a_reused_table_must_be_of_the_same_recipe_and_gives_only_the_asked_candidates():
    """A run directory's ``sensitivity.json`` measured with another base recipe (other numerics) is measured again,
    and one that lacks a column for an asked candidate too; one with more columns gives the plan the asked ones
    alone (``--candidates 8da8w-pc,8da4w-g32`` was ignored where the table also had ``8da4w-pc``)."""
    table = {**_table(COSTS, {u: SIZES for u in COSTS}), "recipe": "xnnpack_8da4w_zp_split"}
    table.update(model="m", eval_blocks=8, seq_len=256, val_blocks="v")
    same = ("m", 8, 256, "v", "layer")
    assert at.table_matches(table, *same, "xnnpack_8da4w_zp_split", ["8da8w-pc", "8da4w-g32"]) is None
    assert "its recipe is 'xnnpack_8da4w_zp_split'" in at.table_matches(table, *same, "xnnpack_8da4w", [])
    assert at.table_matches(table, *same, "xnnpack_8da4w_zp_split", ["8da4w-g64"]) == "it has no column for 8da4w-g64"
    asked = at.only_candidates(table, ["8da8w-pc", "8da4w-g32"])
    assert list(asked["candidates"]) == ["8da8w-pc", "8da4w-g32"]
    assert all(set(u["results"]) == {"8da8w-pc", "8da4w-g32"} for u in asked["units"])
    assert "8da4w-pc" in at.choose(table, 3100, 1000, resolution=1).schemes.values()  # only per-channel 4-bit fits
    with pytest.raises(UserError, match="below the smallest .pte these candidates allow"):
        at.choose(asked, 3100, 1000, resolution=1)


@pytest.mark.fast
def test_a_tied_head_kept_once_with_its_table_is_still_read_at_its_precision():
    """A tied head at 8 bits costs its scales alone (``share_tables``), fewer bytes than at 4: the isotonic floor
    still orders the schemes by the bytes they store of their own (else the 8-bit head took the 4-bit cost, +30%,
    and the plan's predicted perplexity summed it: SmolLM2's read +57% for a program that scored +3%)."""
    costs = {"lm_head": {"8da8w-pc": 0.006, "8da4w-g32": 0.05, "8da4w-pc": 0.30}}
    table = at.share_tables(_table(costs, {"lm_head": SIZES}), {"lm_head": {"8da8w-pc": 900}})
    opts = at.options(table["units"][0])
    assert opts["8da8w-pc"] == (SIZES["8da8w-pc"] - 900, pytest.approx(math.log(1.006)))
    assert opts["8da4w-pc"][1] == pytest.approx(math.log(1.30))
    plan = at.choose(table, 3000, 1000, resolution=1)  # fp does not fit
    assert plan.schemes == {"lm_head": "8da8w-pc"} and plan.predicted_ppl == pytest.approx(50.0 * 1.006)
    assert "(+900 kept once with the tied table)" in at.format_plan(plan, table)


@pytest.mark.fast
@pytest.mark.parametrize(
    "budget, message",
    [
        (2000, r"--max_size_mb 0.002 is below the smallest \.pte these candidates allow, about 0\.003 MB"),
        (20000, "holds the whole FP model"),
    ],
)
def test_budgets_nothing_fits_or_everything_fits_are_one_line_errors(budget, message):
    costs = {u: {c: v + 0.0001 for c, v in cs.items()} for u, cs in COSTS.items()}  # every scheme costs something
    with pytest.raises(UserError, match=message):
        at.check_not_all_fp(at.choose(_table(costs, {u: SIZES for u in COSTS}), budget, 1000))
    if budget > 17000:  # where 8-bit costs nothing (unit d), the plan takes it over fp: the same accuracy, smaller
        assert at.choose(_table(COSTS, {u: SIZES for u in COSTS}), budget, 1000).schemes["d"] == "8da8w-pc"


@pytest.mark.fast
@pytest.mark.parametrize("value", [None, 0, -1.5, "big", float("inf"), True])
def test_bad_budgets(value):
    with pytest.raises(UserError, match="max_size_mb"):
        at.check_budget(value)


@pytest.mark.fast
def test_a_table_against_the_recipe_is_refused():
    table = {**_table(COSTS, {u: SIZES for u in COSTS}), "against": "recipe"}
    with pytest.raises(UserError, match="measured --against recipe"):
        at.choose(table, 5000, 1000)


@pytest.mark.fast
def test_the_written_recipe_gives_each_layer_the_planned_scheme(tmp_path):
    """Sizes from the real model (``unit_sizes``); the recipe file read back assigns exactly the plan."""
    from qharness.recipes.registry import load_recipe

    model = _tiny_model()
    units = unit_sizes(model, load_recipe("xnnpack_8da4w"), list(CANDIDATES), "block")
    costs = {u["name"]: {"8da8w-pc": 0.001, "8da4w-g32": 0.01 * (i + 1), "8da4w-pc": 0.02} for i, u in enumerate(units)}
    table = _table(costs, {u["name"]: u["weight_bytes"] for u in units})
    for u, sized in zip(table["units"], units):
        u["layers"] = sized["layers"]
    table["unit"] = "block"
    all4 = sum(u["weight_bytes"]["8da4w-g32"] for u in units)
    budget = 10_000 + all4 + (units[-1]["weight_bytes"]["8da8w-pc"] - units[-1]["weight_bytes"]["8da4w-g32"])
    plan = at.choose(table, budget, 10_000, resolution=1)
    assert plan.schemes["lm_head"] == "8da8w-pc" and plan.schemes["model.layers.0"] == "8da4w-g32"
    path = at.write_recipe(plan, tmp_path / "autotuned.yaml", "xnnpack_8da4w", "qharness autotune x.yaml")
    text = path.read_text()
    assert text.startswith("# written by: qharness autotune x.yaml\n# budget: .pte <= ")
    assert yaml.safe_load(text)["layers"][0] == {"match": "model.layers.0.*", "weight_bits": 4, "group_size": 32}
    assigned = _recipe(tmp_path, text, "again.yaml").make_quantizer(is_qat=False).check(model)
    for u in units:
        for layer in u["layers"]:
            assert assigned[layer] == plan.schemes[u["name"]], layer


@pytest.mark.fast
def test_a_sweep_entry_names_an_autotune_budget(tmp_path):
    spec = {
        "sweep_dir": str(tmp_path / "sweep"),
        "runs": [{"recipe": "xnnpack_8da4w", "modes": ["ptq"]}, {"autotune": {"max_size_mb": 1.6}, "modes": ["ptq"]}],
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    runs = plan(load_sweep(tmp_path / "s.yaml"))
    tuned = runs[-1]
    assert (tuned.name, tuned.subcommand, tuned.summary_recipe) == ("autotune_1.6mb-ptq", "autotune", "autotuned")
    assert tuned.config["max_size_mb"] == 1.6 and tuned.config["model"]["recipe"] == "xnnpack_8da4w"
    assert runs[1].subcommand == "calibrate"
    spec["runs"][1]["autotune"] = {"max_size_mb": -1}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match=r"runs\[1\]\.autotune: --max_size_mb must be a positive"):
        load_sweep(tmp_path / "s.yaml")


@pytest.mark.fast
def test_a_sweep_entry_names_a_latency_budget(tmp_path):
    """An autotune entry takes autotune's --max_latency_ms too (alone or with the size budget): what `qharness ship`
    passes its latency budget through."""
    spec = {"sweep_dir": str(tmp_path / "sweep"), "runs": [{"recipe": "xnnpack_8da4w", "modes": ["ptq"]}]}
    for budgets, name in (
        ({"max_latency_ms": 0.6}, "autotune_0.6ms-ptq"),
        ({"max_size_mb": 1.6, "max_latency_ms": 0.6}, "autotune_1.6mb_0.6ms-ptq"),
    ):
        spec["runs"][1:] = [{"autotune": budgets, "modes": ["ptq"]}]
        (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
        tuned = plan(load_sweep(tmp_path / "s.yaml"))[-1]
        assert tuned.name == name and tuned.config["max_latency_ms"] == 0.6
    spec["runs"][1]["autotune"] = {"max_latency_ms": 0}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match=r"runs\[1\]\.autotune: .*max_latency_ms"):
        load_sweep(tmp_path / "s.yaml")


def test_autotune_cli_writes_a_recipe_that_fits_and_runs_it(tmp_path, tiny_llama, corpus):
    """End to end on the tiny Llama (one rule per block): sensitivity measured, the plan written as autotuned.yaml,
    calibrated, lowered, parity-checked; the .pte fits the budget and its layers are the plan's."""
    cfg = write_config(
        tmp_path / "run.yaml",
        tiny_llama,
        corpus,
        tmp_path / "run",
        model={"recipe": "xnnpack_8da4w", "mode": "ptq"},
        bench={"enabled": False},
    )
    bad = run_cli("autotune", cfg, "--max_size_mb", "-1")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: --max_size_mb must be")
    r = run_cli("autotune", cfg, "--max_size_mb", "0.225", "--unit", "block")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    record = json.loads((run / "autotune.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["recipe"] == "autotuned" and summary["parity"]["passed"]
    assert summary["pte"]["size_bytes"] == record["measured_size_bytes"] <= 225_000
    assert abs(record["measured_size_bytes"] - record["predicted_size_bytes"]) / record["measured_size_bytes"] < 0.03
    assert len(set(record["schemes"].values())) > 1  # the budget lies between the uniform sizes: a mix
    schemes = dict(summary["layers"]["schemes"])
    assert schemes.pop("model.embed_tokens") == "w4-g32"  # the base recipe's 4-bit table: not a unit autotune assigns
    for layer, scheme in schemes.items():
        unit = "lm_head" if layer == "lm_head" else ".".join(layer.split(".")[:3])
        assert scheme == record["schemes"][unit], layer
    recipe = yaml.safe_load((run / "autotuned.yaml").read_text())
    assert recipe["base"] == "xnnpack_8da4w" and len(recipe["layers"]) == 3
    assert "predicted .pte" in r.stdout and "[autotune] .pte size: predicted" in r.stdout
    assert (run / "sensitivity.json").is_file()


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, corpus):
    """A tied 1-layer Llama whose table (2048 x 64) is a third of an 8-bit program: a size off by it shows."""
    return make_tiny_hf(tmp_path_factory.mktemp("tied"), "llama", corpus.read_text(), tie=True, vocab_size=2048)


@pytest.mark.fast
@pytest.mark.parametrize(
    "recipe_name, tie, shared",
    [
        ("xnnpack_8da4w_tied8", True, {"lm_head": {"8da8w-pc": 2048 * 64}}),  # the table's int8 values, once
        ("xnnpack_8da4w_zp_split", True, {"lm_head": {"8da8w-pc": 2048 * 64}}),  # the shipped recipe, on tied8
        ("xnnpack_8da4w_tied8", False, {}),  # untied: the head's values are its own
        ("xnnpack_8da4w", True, {}),  # a 4-bit table in groups: nothing the head shares
    ],
)
def test_a_tied_head_at_its_tables_int8_values_is_counted_once(tied_model, recipe_name, tie, shared):
    """The head's bytes at the scheme that gives it the table's int8 values are its scales alone (``rest_bytes``
    counts the table): the lowering stores those values once (tests/test_shared_table.py)."""
    from transformers import AutoModelForCausalLM

    from qharness.recipes.registry import load_recipe

    model = AutoModelForCausalLM.from_pretrained(tied_model)
    if not tie:
        model.lm_head.weight = type(model.lm_head.weight)(model.lm_head.weight.detach().clone() * 0.5)
    recipe = load_recipe(recipe_name)
    names = ["8da8w-pc", "8da4w-pc", "8da4w-g32"]
    assert shared_table_bytes(model, recipe, names) == shared
    sizes = at.share_tables({"unit": "layer", "units": unit_sizes(model, recipe, names)}, shared)
    head = next(u for u in sizes["units"] if u["name"] == "lm_head")
    full = unit_sizes(model, recipe, names)[-1]["weight_bytes"]
    cut = shared.get("lm_head", {})
    assert head["weight_bytes"] == {s: b - cut.get(s, 0) for s, b in full.items()}
    assert head.get("shared_bytes", {}) == cut


@pytest.mark.fast
def test_zero_point_recipes_are_measured_and_sized_with_their_offsets(tied_model, corpus):
    """A recipe with ``zero_points`` (the shipped ``xnnpack_8da4w_zp_split``): each unit's candidates are measured
    (their copies are quantized without the calibration-chosen weights; the globs matched no copy and stopped the
    table), and a zero-point layer's group-wise bytes hold its 8-bit GEMM of the group means."""
    import torch
    from transformers import AutoModelForCausalLM

    from qharness.evaluation.sensitivity import measure
    from qharness.recipes.registry import load_recipe

    model = AutoModelForCausalLM.from_pretrained(tied_model).eval()
    recipe = load_recipe("xnnpack_8da4w_zp_split")
    x = torch.randint(0, 2048, (2, 16))
    result = measure(model, recipe, x, x.roll(-1, 1), 2, ["8da4w-g32"], progress=False)
    cells = {u["name"]: u["results"]["8da4w-g32"] for u in result["units"]}
    assert all(c["applicable"] and math.isfinite(c["ppl_ratio"]) for c in cells.values()), cells
    sizes = {u["name"]: u["weight_bytes"]["8da4w-g32"] for u in unit_sizes(model, recipe, ["8da4w-g32"])}
    k, q = "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.q_proj"  # k takes a zero point, q does not
    assert sizes[q] == 64 * 64 // 2 + 64 * 64 // 32 * 2  # int4 values, bf16 group scales ([64, 64])
    # + int8 [32, 64 / 32], fp32 scales, and that second GEMM's program bytes
    assert sizes[k] == 32 * 64 // 2 + 32 * 64 // 32 * 2 + 32 * 64 // 32 + 4 * 32 + OVERHEAD_PER_LAYER_BYTES
    assert {u["name"]: u["weight_bytes"]["8da4w-g32"] for u in result["units"]} == sizes
    assert result["measured_without"] == ["rounding: weighted", "smoothing: 0.5"]
    assert (
        "; min-max weights: the recipe's rounding: weighted, smoothing: 0.5 choose them in the run"
        in (format_table(result).splitlines()[0])
    )


@pytest.mark.fast
def test_a_zero_point_unit_is_measured_as_the_run_deploys_it(tied_model):
    """Zero points need no data (min-max per group): a block of the shipped ``zp_split`` at ``8da4w-g32`` is measured
    with its key, value, up and down projections split as the run splits them, each copy computing what the run's
    deployed layer computes (weighted rounding and smoothing, which need calibration blocks, stay the run's). Before,
    the table measured them without zero points: per-channel 4-bit blocks, which have none in the run, looked as
    good as grouped ones, and autotune on SmolLM2 chose six of them."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from qharness.evaluation import sensitivity as sens
    from qharness.recipes.registry import load_recipe
    from qharness.recipes.rounding import round_weights
    from qharness.recipes.zero_points import ZeroPointLinear

    model = AutoModelForCausalLM.from_pretrained(tied_model).eval()
    quantizer = sens._zero_point_quantizers(load_recipe("xnnpack_8da4w_zp_split"), ["8da4w-pc", "8da4w-g32"])
    assert list(quantizer) == ["8da4w-g32"]  # a per-channel layer has no zero point in the run either
    block = {
        n: m for n, m in model.named_modules() if n.startswith("model.layers.0.") and isinstance(m, torch.nn.Linear)
    }
    copies = sens._zero_point_copies(block, quantizer["8da4w-g32"])
    deployed = copy.deepcopy(model)
    rounded = round_weights(model, quantizer["8da4w-g32"], None, weighted=False)
    rounded.load(deployed)
    quantizer["8da4w-g32"].convert(deployed, rounded.qparams)
    split = {n for n, m in copies.items() if isinstance(m, ZeroPointLinear)}
    assert split == {
        f"model.layers.0.{n}" for n in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj")
    }
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, m in copies.items():
            inp = x if m.in_features == 64 else torch.randn(3, 5, m.in_features)
            assert torch.equal(m(inp), deployed.get_submodule(name)(inp)), name


@pytest.mark.fast
def test_the_rest_counts_a_quantized_table_as_the_program_stores_it(tied_model):
    """Packed rows and one fp32 scale a group (``EmbeddingQuant.stored_bytes``, which test_embeddings.py checks
    against a program's table); the rest had bf16 scales, 1.8 MB short at SmolLM2's 4-bit table."""
    from transformers import AutoModelForCausalLM

    from qharness.recipes.registry import load_recipe

    model = AutoModelForCausalLM.from_pretrained(tied_model)
    units = {"units": [{"layers": ["lm_head"]}]}
    quantized = at.rest_bytes(model, units, 64, load_recipe("xnnpack_8da4w")) - at.rest_bytes(model, units, 64)
    assert quantized == 2048 * (64 // 2 + 4 * (64 // 32)) - 2048 * 64 * 4


def test_autotune_predicts_a_tied_tables_one_copy(tmp_path, tied_model, corpus):
    """Through the CLI, a tied model on the shipped ``xnnpack_8da4w_zp_split`` (built on ``tied8``): the 8-bit head
    keeps the table's values once, so it costs its scales (at the budget only that fits: a 4-bit head is a copy
    apart), each zero-point layer its second GEMM and the split head input its graph; the predicted size is the
    measured one to 2% (it was 54% over with the table twice, 7% under without the zero-point GEMMs' and the split's
    program bytes, 3% under without the split's) and the plan's line says why."""
    cfg = write_config(
        tmp_path / "run.yaml",
        tied_model,
        corpus,
        tmp_path / "run",
        model={"recipe": "xnnpack_8da4w_zp_split", "mode": "ptq"},
        bench={"enabled": False},
    )
    r = run_cli("autotune", cfg, "--max_size_mb", "0.216", "--unit", "block", "--candidates", "8da8w-pc,8da4w-g32")
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "autotune.json").read_text())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert record["schemes"] == {"model.layers.0": "8da4w-g32", "lm_head": "8da8w-pc"}  # the block's zero points
    assert summary["coverage"]["embeddings"]["model.embed_tokens"]["shared"]
    error = record["predicted_size_bytes"] / record["measured_size_bytes"] - 1
    assert abs(error) < 0.02, (record["predicted_size_bytes"], record["measured_size_bytes"])
    assert f"(+{2048 * 64:,} kept once with the tied table)" in r.stdout


@pytest.mark.slow
def test_autotune_qat_trains_the_planned_assignment_and_its_recipe_reruns(tmp_path, tiny_llama, corpus):
    """QAT: the plan is trained (last.ckpt) and deployed with the fake-quant comparison; then the written recipe run
    again by calibrate (PTQ on the same FP model) gives a .pte with the same assignment, of about the same size (not
    byte for byte: the untrained model's norm weights are equal, and ExecuTorch stores equal constants once)."""
    cfg = write_config(
        tmp_path / "run.yaml",
        tiny_llama,
        corpus,
        tmp_path / "run",
        model={"recipe": "xnnpack_8da4w", "mode": "qat"},
        bench={"enabled": False},
    )
    r = run_cli("autotune", cfg, "--max_size_mb", "0.225", "--unit", "block")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == "qat" and summary["parity"]["passed"] and "fake_quant" in summary["parity"]
    assert (run / "checkpoints" / "last.ckpt").is_file()
    again = run_cli(
        "calibrate",
        cfg,
        "--model.mode",
        "ptq",
        "--model.recipe",
        run / "autotuned.yaml",
        "--trainer.default_root_dir",
        tmp_path / "again",
    )
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert abs(rerun["pte"]["size_bytes"] - summary["pte"]["size_bytes"]) <= 2048
    assert rerun["layers"]["schemes"] == summary["layers"]["schemes"]
