"""Every decoder quantized as its recipe says: projections normalized at load (GPT-2's Conv1D, Falcon's
FalconLinear -> nn.Linear), coverage measured at deploy and recorded in summary.json, a projection the recipe meant to
quantize and left float stopped, and the architecture check deploying a one-layer copy with the run's recipe before
any training (a failure at lowering, e.g. MoE routing's aten.histc, found at once).

Tiny random models of each pattern: GPT-2 (addmm), Falcon (matmul against a transposed weight), Llama (the control).
"""

import json

import pytest
import torch
from conftest import make_tiny_hf, make_tiny_llama, run_cli, write_config

from qharness.deploy.coverage_record import FloatWeight, RuleCoverage
from qharness.errors import UserError

# model_type and the config of each family's tiny copy (2 layers; GPT-2 and Falcon derive their head sizes)
FAMILIES = {
    "gpt2": ("gpt2", dict(head_dim=None, num_key_value_heads=None)),
    "falcon": ("falcon", dict(head_dim=None, num_key_value_heads=None, num_kv_heads=2, new_decoder_architecture=True)),
}
PROJECTIONS = {"gpt2": 9, "falcon": 9, "llama": 15}  # per layer (4, 4, 7) x 2 layers + lm_head


@pytest.fixture(scope="session")
def family(tmp_path_factory, corpus):
    made = {}

    def get(name):
        if name not in made:
            out, text = tmp_path_factory.mktemp(name), corpus.read_text()[:200_000]
            if name == "llama":
                made[name] = make_tiny_llama(out, text)
            else:
                model_type, extra = FAMILIES[name] if name in FAMILIES else (name, {})
                made[name] = make_tiny_hf(out, model_type, text, layers=2, **extra)
        return made[name]

    return get


def float_weight_matmuls(graph: torch.fx.GraphModule) -> list[str]:
    """Ops of ``graph`` that multiply by a float parameter of 2+ dimensions read directly (through transposes and
    views only): a projection left in floating point. Written apart from ``coverage.py`` on purpose."""
    params = {n for n, p in graph.named_parameters() if p.is_floating_point() and p.dim() >= 2}
    layout = {"t", "numpy_T", "transpose", "permute", "view", "reshape", "_unsafe_view", "expand", "clone", "detach"}
    found = []
    for node in graph.graph.nodes:
        if getattr(node.target, "_opname", None) not in {"linear", "addmm", "matmul", "mm", "bmm"}:
            continue
        for arg in node.all_input_nodes:
            while arg.op == "call_function" and getattr(arg.target, "_opname", None) in layout:
                arg = arg.args[0]
            if arg.op == "get_attr" and arg.target in params:
                found.append(f"{node.target} {arg.target}")
    return found


@pytest.mark.fast
@pytest.mark.parametrize("name, swapped", [("gpt2", "Conv1D"), ("falcon", "FalconLinear")])
def test_projections_load_as_plain_linear_with_the_same_outputs(name, swapped, family):
    from transformers import AutoModelForCausalLM

    from qharness.sources.models import load_model_and_tokenizer

    raw = AutoModelForCausalLM.from_pretrained(family(name)).eval()
    assert sum(type(m).__name__ == swapped for m in raw.modules()) == 8  # 4 per layer
    model, _ = load_model_and_tokenizer(str(family(name)))
    assert not [n for n, m in model.named_modules() if type(m).__name__ == swapped]
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert len(linears) == PROJECTIONS[name]
    assert list(model.state_dict()) == list(raw.state_dict())  # the same parameter names: checkpoints carry over
    x = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, raw(input_ids=x).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "name, recipe_name",
    [
        (name, recipe)
        if (name, recipe) != ("llama", "xnnpack_8da4w")
        else pytest.param(name, recipe, marks=pytest.mark.slow)  # the control; test_e2e's fit checks it too
        for name in ("gpt2", "falcon", "llama")
        for recipe in ("xnnpack_int8_dynamic", "xnnpack_8da4w")
    ],
)
def test_deploy_quantizes_every_projection(name, recipe_name, family):
    """The converted deploy graph reads no projection weight in float, and its coverage record says so."""
    from qharness.deploy.deployed import graph_coverage
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(family(name)))
    x = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    graph = quantize_for_deploy(model, load_recipe(recipe_name), 32, lambda g: g(x, torch.tensor([0])))
    assert float_weight_matmuls(graph) == []
    cov = graph_coverage(graph)
    assert cov.weights == cov.quantized == PROJECTIONS[name] and cov.float == {} and cov.fraction == 1.0
    assert cov.rules == [RuleCoverage("recipe", cov.weights, cov.bytes, cov.weights, cov.bytes)]


def test_a_projection_left_float_stops_the_deploy_with_its_name(family):
    """GPT-2 as transformers builds it (Conv1D: aten.addmm), not normalized: int8 would quantize only lm_head."""
    from transformers import AutoModelForCausalLM

    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    raw = AutoModelForCausalLM.from_pretrained(family("gpt2")).eval()
    x = torch.randint(0, 300, (1, 8))
    with pytest.raises(UserError, match=r"would leave 8 of 9 linear projections of GPT2LMHeadModel in floating") as e:
        quantize_for_deploy(raw, load_recipe("xnnpack_int8_dynamic"), 32, lambda g: g(x, torch.tensor([0])))
    assert "transformer.h.0.attn.c_attn (aten.addmm)" in str(e.value) and "\n" not in str(e.value)


def test_the_fp_recipe_and_a_recipe_rule_keep_layers_float_without_failing(family, tmp_path):
    from qharness.deploy.coverage import format_coverage
    from qharness.deploy.deployed import graph_coverage
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer

    x = torch.randint(0, 300, (1, 8))
    model, _ = load_model_and_tokenizer(str(family("llama")))
    cov = graph_coverage(quantize_for_deploy(model, load_recipe("xnnpack_fp32"), 32, lambda g: None))
    assert cov.fraction == 0.0 and cov.quantized == 0 and len(cov.float) == 15
    assert {(f.why, f.failure) for f in cov.float.values()} == {("fp recipe: the recipe quantizes nothing", False)}

    recipe = tmp_path / "keep_head.yaml"
    recipe.write_text('base: xnnpack_8da4w\nlayers:\n  - {match: "lm_head", quant: fp}\n')
    model, _ = load_model_and_tokenizer(str(family("llama")))
    cov = graph_coverage(quantize_for_deploy(model, load_recipe(str(recipe)), 32, lambda g: g(x, torch.tensor([0]))))
    head = model.lm_head.weight.numel() * 4
    assert cov.float == {
        "lm_head": FloatWeight(
            rule="layers[0] (match 'lm_head')", why="recipe rule", failure=False, op="linear", bytes=head
        )
    }
    assert cov.quantized == 14 and cov.fraction == pytest.approx(1 - head / cov.bytes)
    assert [(r.rule, r.weights, r.quantized) for r in cov.rules] == [
        ("recipe", 14, 14),
        ("layers[0] (match 'lm_head')", 1, 0),
    ]
    line = format_coverage(cov)  # the recipe's 4-bit embedding table follows the linears
    assert (
        "(14 of 15 weights; float: lm_head (recipe rule)); embeddings: model.embed_tokens 4-bit (groups of 32)" in line
    )


def test_the_deploy_probe_names_the_failing_stage_and_is_remembered_per_recipe(family, tmp_path, monkeypatch):
    """What fails at lowering (here: an op outside the core ATen opset, as MoE routing's aten.histc) stops the
    architecture check with the stage and the reason; a success is remembered for that recipe only."""
    import qharness.deploy.lower as lower
    from qharness.deploy.architectures import check_architecture
    from qharness.recipes.registry import load_recipe

    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    source, int8, fp32 = str(family("gpt2")), load_recipe("xnnpack_int8_dynamic"), load_recipe("xnnpack_fp32")
    real = lower.lower_to_pte

    def histc(*args, **kwargs):
        raise RuntimeError("Operator torch._ops.aten.histc.default is not in Core ATen opset")

    monkeypatch.setattr(lower, "lower_to_pte", histc)
    with pytest.raises(UserError) as e:
        check_architecture(source, recipe=int8, max_seq_len=32)
    assert str(e.value).startswith(
        "unsupported model " + repr(source) + " (model_type 'gpt2'): GPT2LMHeadModel cannot be deployed with recipe "
        "'xnnpack_int8_dynamic': lowering of a one-layer copy fails (RuntimeError: Operator torch._ops.aten.histc"
    )
    monkeypatch.setattr(lower, "lower_to_pte", real)
    check_architecture(source, recipe=int8, max_seq_len=32)
    monkeypatch.setattr(lower, "lower_to_pte", histc)
    check_architecture(source, recipe=int8, max_seq_len=32)  # remembered: not deployed again
    with pytest.raises(UserError, match="cannot be deployed with recipe 'xnnpack_fp32'"):
        check_architecture(source, recipe=fp32, max_seq_len=32)  # another recipe: probed on its own


def test_the_deploy_probe_stops_a_recipe_that_would_leave_projections_float(family, tmp_path, monkeypatch):
    """Without the normalization, GPT-2's projections stay Conv1D: the probe's coverage check names them."""
    import qharness.sources.normalize as normalize
    from qharness.deploy.architectures import check_architecture
    from qharness.recipes.registry import load_recipe

    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(normalize, "normalize_linears", lambda model: {})
    with pytest.raises(UserError, match=r"would leave 4 of 5 linear projections of GPT2LMHeadModel .*c_attn \(aten"):
        check_architecture(str(family("gpt2")), recipe=load_recipe("xnnpack_8da4w"), max_seq_len=32)


def _cli_config(tmp_path, source, corpus, recipe, mode):
    return write_config(
        tmp_path / "c.yaml",
        source,
        corpus,
        tmp_path / "run",
        model={"recipe": recipe, "mode": mode},
        data={"seq_len": 16, "batch_size": 2},
        trainer={"max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1},
        checkpoint={"every_n_train_steps": 2},
        deploy={"max_seq_len": 32},
        parity={"eval_blocks": 2, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
    )


@pytest.mark.parametrize(
    "name, recipe, command",
    [
        # the slow tier: ~25-50 s each; the default suite's CLI runs through calibrate with coverage in summary.json:
        # test_families (gpt_neox), below (a Mixtral, fit), test_runner_snippet, test_gguf, ...
        pytest.param("gpt2", "xnnpack_int8_dynamic", "calibrate", marks=pytest.mark.slow),
        pytest.param("falcon", "xnnpack_8da4w", "calibrate", marks=pytest.mark.slow),
        pytest.param("gpt2", "xnnpack_8da4w", "fit", marks=pytest.mark.slow),
        pytest.param("falcon", "xnnpack_int8_dynamic", "fit", marks=pytest.mark.slow),
    ],
)
def test_every_projection_is_quantized_in_the_summary_and_parity_passes(
    name, recipe, command, family, tmp_path, corpus
):
    cfg = _cli_config(tmp_path, family(name), corpus, recipe, "qat" if command == "fit" else "ptq")
    r = run_cli(command, cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    cov = summary["coverage"]
    assert summary["quantized"] and summary["parity"]["passed"]
    assert cov["weights"] == cov["quantized"] == PROJECTIONS[name] and cov["float"] == {} and cov["fraction"] == 1.0
    assert f"quantized: 100.0% of linear weight bytes ({PROJECTIONS[name]} of {PROJECTIONS[name]} weights)" in r.stdout


@pytest.mark.slow  # ~40 s; the default suite deploys a Mixtral and a DeepSeek-V3 in process (test_families: int8,
# parity, the runner) and refuses MoE experts a recipe would leave float before work (test_moe)
def test_a_mixtral_is_never_lost_after_training(family, tmp_path, corpus):
    """Tiny Mixtral (MoE) with int8: whatever of it does not deploy (its routing's aten.histc does not lower on this
    stack) stops the run before any training step, in one line; a Mixtral that deploys is fully quantized."""
    cfg = _cli_config(tmp_path, family("mixtral"), corpus, "xnnpack_int8_dynamic", "qat")
    r = run_cli("fit", cfg)
    if r.returncode == 2:
        lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "MixtralForCausalLM cannot be deployed with recipe 'xnnpack_int8_dynamic'" in lines[0]
        assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was trained
    else:
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["parity"]["passed"] and summary["coverage"]["fraction"] == 1.0
