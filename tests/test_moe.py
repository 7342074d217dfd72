"""MoE families (``sources/moe.py``): experts rewritten into per-expert ``nn.Linear`` modules with static-shape
routing reproduce transformers' blocks, load HF checkpoints, quantize expert by expert and deploy end to end."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_hf, run_cli, tiny_run_config

EXPERTS, TOP_K = 4, 2
# every sparse-MoE family of transformers 5.24 asked for, with its own names for the expert counts and widths
FAMILIES = {
    "mixtral": dict(num_local_experts=EXPERTS),
    "qwen3_moe": dict(num_experts=EXPERTS, moe_intermediate_size=32),
    "olmoe": dict(num_experts=EXPERTS),
    "granitemoe": dict(num_local_experts=EXPERTS),
    "qwen2_moe": dict(num_experts=EXPERTS, moe_intermediate_size=32, shared_expert_intermediate_size=48),
}


def tiny_moe(model_type: str):
    """A random 2-layer model of ``model_type`` (normal weights everywhere, so routers do not tie), eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=TOP_K,
        **FAMILIES[model_type],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def moe_blocks(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "experts")]


@pytest.mark.fast
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_rewrite_reproduces_each_family(model_type):
    """Block outputs on random input and whole-model logits match transformers' own (batched 3-D experts, whose
    default forward routes with ``histc``); every expert projection is then an ``nn.Linear``."""
    from qharness.sources.moe import LinearExperts, rewrite_moe

    model = tiny_moe(model_type)
    torch.manual_seed(1)
    ids, x = torch.randint(0, 96, (2, 11)), torch.randn(3, 5, 32)
    blocks = moe_blocks(model)
    with torch.no_grad():
        logits, block_out = model(ids).logits, blocks[0](x)
        assert rewrite_moe(model) == 2
        assert (blocks[0](x) - block_out).abs().max() < 1e-5
        assert (model(ids).logits - logits).abs().max() < 1e-5
    for block in blocks:
        assert isinstance(block.experts, LinearExperts) and len(block.experts) == EXPERTS
        for expert in block.experts:
            assert all(isinstance(p, torch.nn.Linear) for p in (expert.gate_proj, expert.up_proj, expert.down_proj))
    assert not [n for n, p in model.named_parameters() if p.dim() == 3]  # no batched expert weights left
    assert rewrite_moe(model) == 0  # idempotent


@pytest.mark.fast
@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_restored_model_saves_a_checkpoint_transformers_loads(tmp_path, model_type):
    """``restore_moe`` puts (trained) per-expert weights back into transformers' modules: ``save_pretrained`` then
    writes a checkpoint that transformers loads with no missing or extra tensor and the same logits (a rewritten
    model saved as it is would load with every expert missing)."""
    from transformers import AutoModelForCausalLM

    from qharness.sources.moe import restore_moe, rewrite_moe

    model = tiny_moe(model_type)
    rewrite_moe(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # "training" after the rewrite
        ids = torch.randint(0, 96, (2, 9))
        trained = model(ids).logits
        assert restore_moe(model) == 2
        assert (model(ids).logits - trained).abs().max() < 1e-5
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert (loaded.eval()(ids).logits - trained).abs().max() < 1e-5


@pytest.mark.fast
def test_rewritten_block_trains_and_exports_to_core_aten():
    """The rewritten block passes gradients to the router (through the routing weights) and exports to core ATen
    with static shapes: no ``histc`` or data-dependent op (``nonzero``, ``index_add``) for ``to_edge`` to refuse."""
    from qharness.sources.moe import rewrite_moe

    model = tiny_moe("mixtral")
    rewrite_moe(model)
    block = moe_blocks(model)[0]
    block(torch.randn(2, 5, 32)).square().sum().backward()
    assert block.gate.weight.grad.abs().sum() > 0 and block.experts[0].down_proj.weight.grad is not None
    ops = {str(n.target) for n in torch.export.export(block, (torch.randn(2, 5, 32),)).run_decompositions().graph.nodes}
    assert not [op for op in ops if any(bad in op for bad in ("histc", "nonzero", "index_add", "where.default"))], ops


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory, corpus):
    """A 1-layer Mixtral (4 experts, top-2) saved by transformers' ``save_pretrained`` (per-expert ``w1/w2/w3``)."""
    return make_tiny_hf(
        tmp_path_factory.mktemp("tiny_mixtral"),
        "mixtral",
        corpus.read_text()[:200_000],
        layers=1,
        intermediate_size=64,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )


@pytest.mark.fast
def test_loader_rewrites_an_hf_checkpoint(tiny_mixtral):
    """``load_model_and_tokenizer`` (every stage's loader) gives the rewritten model, with the checkpoint's weights:
    the same logits as transformers' own model of that directory."""
    from transformers import AutoModelForCausalLM

    from qharness.sources.models import load_model_and_tokenizer
    from qharness.sources.moe import LinearExperts

    model, _ = load_model_and_tokenizer(str(tiny_mixtral))
    assert all(isinstance(b.experts, LinearExperts) for b in moe_blocks(model))
    reference = AutoModelForCausalLM.from_pretrained(tiny_mixtral, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        assert (model(ids).logits - reference(ids).logits).abs().max() < 1e-5


def test_trained_graph_weights_load_into_a_fresh_model(tiny_mixtral):
    """What a checkpoint holds (the prepared training graph's parameters) maps by name onto a freshly loaded model,
    expert by expert, as ``qharness export`` and deployment load it (``hf_weights`` -> ``load_weights_into``)."""
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer
    from qharness.training.prepare import prepare_for_training
    from qharness.training.weights import hf_weights, load_weights_into

    model, _ = load_model_and_tokenizer(str(tiny_mixtral))
    graph = prepare_for_training(model, load_recipe("xnnpack_int8_dynamic"), 1, 8, is_qat=True)
    with torch.no_grad():
        for p in graph.parameters():
            p.add_(0.01)  # "trained"
    weights = hf_weights(graph.named_parameters())
    fresh, _ = load_model_and_tokenizer(str(tiny_mixtral))
    load_weights_into(weights, fresh)
    down = fresh.get_parameter("model.layers.0.mlp.experts.3.down_proj.weight")
    assert torch.equal(down, weights["model.layers.0.mlp.experts.3.down_proj.weight"])


def expert_linears(graph: torch.fx.GraphModule) -> dict[str, str]:
    """``{module: op producing its weight}`` for the graph's ``aten.linear`` calls made by an expert's projection
    (found by the module stack each node keeps): a dequantize op where the weight is quantized, else a parameter."""
    found = {}
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
            module = list(node.meta.get("nn_module_stack", {}).values())[-1][0]
            if ".experts." in module:
                found[module] = str(node.args[1].target)
    return found


@pytest.mark.parametrize("recipe", ["xnnpack_int8_dynamic", "xnnpack_8da4w"])
def test_deploy_graph_quantizes_every_expert_projection(tiny_mixtral, recipe):
    """The converted graph the ``.pte`` is lowered from (``quantize_for_deploy``) has a linear per expert and
    projection, each against a dequantized (int8 / int4) weight: none against a float expert weight."""
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(str(tiny_mixtral))
    tokens = torch.randint(0, 300, (1, 8))
    graph = quantize_for_deploy(model, load_recipe(recipe), 16, lambda g: g(tokens, torch.tensor([0])))
    linears = expert_linears(graph)
    assert len(linears) == 3 * EXPERTS, linears
    assert all("dequantize" in op for op in linears.values()), linears


def check_run(run_dir, tokenizer_dir=None) -> dict:
    """A finished run's ``.pte`` passed parity and generates text through ``qharness generate``."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["parity"]["passed"], summary["parity"]
    coverage = summary["coverage"]  # every expert and the router counted, and quantized
    assert coverage["fraction"] == 1.0 and not coverage["unused"] and not coverage["float"], coverage
    gen = run_cli(
        "generate", "--pte", run_dir / "model.pte", "--prompt", "def ", "--max_new_tokens", "6", "--seed", "0"
    )
    assert gen.returncode == 0 and gen.stdout.startswith("def ") and "tok/s" in gen.stderr, gen.stderr[-2000:]
    return summary


@pytest.mark.slow  # ~35 s; the default suite deploys a Mixtral in process (test_families), the CLI on other families
def test_calibrate_cli_deploys_mixtral(tmp_path, tiny_mixtral, corpus):
    """``qharness calibrate`` (PTQ, int8 dynamic) of a Mixtral writes a ``.pte`` that passes the parity gate and
    generates (before the rewrite: ``SpecViolationError`` on ``aten.histc`` at lowering, exit 1)."""
    cfg = tiny_run_config(tmp_path, tiny_mixtral, corpus, model={"mode": "ptq"})
    result = run_cli("calibrate", "--config", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    check_run(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize(
    "command,recipe",
    [("fit", "xnnpack_8da4w"), ("fit", "xnnpack_int8_dynamic"), ("calibrate", "xnnpack_8da4w")],
)
def test_mixtral_runs_end_to_end(tmp_path, tiny_mixtral, corpus, command, recipe):
    """QAT (a few steps) and PTQ with both recipes: parity passes, the ``.pte`` generates; torchao's record of what
    it quantized names every expert projection; after ``fit``, ``qharness export`` reloads the saved checkpoint into
    a freshly loaded (rewritten) model and deploys it again."""
    cfg = tiny_run_config(
        tmp_path,
        tiny_mixtral,
        corpus,
        model={"mode": "qat" if command == "fit" else "ptq", "recipe": recipe},
        trainer={"max_steps": 3, "val_check_interval": 3},
    )
    result = run_cli(command, "--config", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = check_run(tmp_path / "run")
    if recipe == "xnnpack_8da4w":
        schemes = summary["layers"]["schemes"]
        assert all(
            schemes.get(f"model.layers.0.mlp.experts.{e}.{p}_proj") == "8da4w-g32"
            for e in range(EXPERTS)
            for p in ("gate", "up", "down")
        ), schemes
    if command == "fit":
        (tmp_path / "run" / "model.pte").unlink()
        again = run_cli("export", "--config", cfg)
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads((tmp_path / "run" / "summary.json").read_text())["parity"]["passed"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "olmoe", "granitemoe"])
def test_other_families_calibrate_end_to_end(tmp_path, corpus, model_type):
    """The other MoE families of transformers 5.24 (shared expert: qwen2_moe; softmax over the top-k logits:
    granitemoe) deploy through ``qharness calibrate``: parity passes and the ``.pte`` generates."""
    model = make_tiny_hf(
        tmp_path / "model", model_type, corpus.read_text()[:200_000], num_experts_per_tok=TOP_K, **FAMILIES[model_type]
    )
    cfg = tiny_run_config(tmp_path, model, corpus, model={"mode": "ptq"})
    result = run_cli("calibrate", "--config", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    check_run(tmp_path / "run")


@pytest.mark.fast
def test_experts_moe_py_does_not_rewrite_stop_a_quantizing_recipe_before_work(tmp_path, monkeypatch):
    """gpt-oss's experts (a clamped gate of their own, gate and up interleaved) stay batched 3-D weights: the
    architecture check stops a quantizing recipe naming them and why, before any work (before: 'would leave 2 of 11
    linear projections ... model.layers.0.mlp.router.weight', the experts, most of the bytes, counted nowhere)."""
    from transformers import AutoConfig

    from qharness.deploy.architectures import check_architecture
    from qharness.errors import UserError
    from qharness.recipes.registry import load_recipe

    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    AutoConfig.for_model(
        "gpt_oss",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    ).save_pretrained(tmp_path / "gpt_oss")
    with pytest.raises(UserError) as e:
        check_architecture(str(tmp_path / "gpt_oss"), recipe=load_recipe("xnnpack_int8_dynamic"), max_seq_len=32)
    message = str(e.value)
    assert "recipe 'xnnpack_int8_dynamic' would leave the MoE experts of GptOssForCausalLM in floating point" in message
    assert "model.layers.0.mlp.experts (GptOssExperts: its own gate (GptOssExperts._apply_gate)" in message
    assert "\n" not in message
