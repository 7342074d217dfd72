"""The family matrix: one tiny random model (hidden 64, 2 layers, saved with ``save_pretrained`` with its
tokenizer) per attention / MLP / projection pattern, deployed as a run deploys it (``pipeline.deploy_and_check``
on the model ``load_model_and_tokenizer`` gives): every projection quantized as the recipe says (the summary's
coverage, and no float ``linear``/``addmm``/``matmul`` against a weight in the converted graph), the export path
expected for the family, parity passed, and ExecuTorch's own LLM runner (``TextLLMRunner``) generating from the
``.pte`` what qharness's greedy loop generates.

Default suite: each family with one recipe, in process (about 20 CPU-seconds each, mostly lowering), and GPT-NeoX
through ``qharness calibrate`` (test_moe.py runs Mixtral's); ``-m slow``: the other recipe, and every family through
``qharness calibrate``.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_hf, run_cli, runner_safe_head, tiny_run_config
from test_coverage import float_weight_matmuls
from test_fastpath import MAMBA2

from qharness.runtime.pte import kernel_libraries

INT8, W4 = "xnnpack_int8_dynamic", "xnnpack_8da4w"
NO_GQA = dict(head_dim=None, num_key_value_heads=None)  # families that derive their head sizes
MOE = dict(num_experts_per_tok=2, intermediate_size=64)
MLA = dict(
    NO_GQA,
    q_lora_rank=32,
    kv_lora_rank=32,  # a multiple of 8da4w's group size (32): kv_b_proj quantized too
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
)

LFM2 = dict(head_dim=None, layer_types=["conv", "full_attention"])
DELTANET = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
MOE_LFM2 = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# name: (model_type, config, linear weights the deploy must quantize (2 layers + the output head), export path,
#        the default suite's recipe); the pattern each one stands for in the comment
FAMILIES = {
    # fused q/k/v and gate/up projections
    "phi3": ("phi3", {}, 2 * 4 + 1, "fast", W4),
    # fused q/k/v, attention and MLP in parallel from the same input (use_parallel_residual)
    "gpt_neox": ("gpt_neox", dict(NO_GQA, use_parallel_residual=True), 2 * 4 + 1, "fast", INT8),
    # Conv1D projections: aten.addmm until normalized
    "gpt2": ("gpt2", NO_GQA, 2 * 4 + 1, "fast", INT8),
    # input @ weight.T through aten.matmul until normalized; parallel attention/MLP; its attention through
    # transformers' AttentionInterface since transformers 5.25 (the generic static cache before), so the fast path
    "falcon": ("falcon", dict(NO_GQA, num_kv_heads=2, new_decoder_architecture=True), 2 * 4 + 1, "fast", INT8),
    # MoE saved with one tensor per expert and projection (w1/w2/w3): 4 attention + router + 4 experts x 3
    "mixtral": ("mixtral", dict(MOE, num_local_experts=4), 2 * 17 + 1, "fast", INT8),
    # MoE saved as batched 3-D expert tensors
    "qwen3_moe": ("qwen3_moe", dict(MOE, num_experts=4, moe_intermediate_size=32), 2 * 17 + 1, "fast", INT8),
    # multi-head latent attention (5 projections), a dense layer (3) then an MoE one (router, 4 x 3, shared expert 3)
    "deepseek_v3": ("deepseek_v3", MLA, 5 + 3 + 5 + 1 + 12 + 3 + 1, "fast", INT8),
    # every layer windowed, the window (8) shorter than the cache
    "mistral_window": ("mistral", dict(sliding_window=8), 2 * 7 + 1, "fast", W4),
    # attention and final logit soft-capping, alternating window/full layers
    "gemma2": ("gemma2", dict(sliding_window=8), 2 * 7 + 1, "fast", INT8),
    # a short gated convolution layer (a convolution state in the program, no KV cache) then an attention layer
    "lfm2": ("lfm2", dict(LFM2), 5 + 7 + 1, "fast", W4),
    # the same hybrid with MoE: a dense conv layer, then attention with batched 3-D experts (router, 4 x 3)
    "lfm2_moe": ("lfm2_moe", dict(LFM2, num_dense_layers=1, **MOE_LFM2), 5 + 4 + 1 + 12 + 1, "fast", INT8),
    # LFM3: LFM2's short convolutions beside gated attention (g_proj), whose rotary knows only the attention types
    "lfm3": ("lfm3", dict(LFM2), 5 + 8 + 1, "fast", W4),
    # gated DeltaNet (a convolution window and a recurrent state; in_proj_qkv, z, b, a, out_proj) then gated attention
    "qwen3_5": ("qwen3_5_text", DELTANET, 5 + 3 + 4 + 3 + 1, "fast", W4),
    # fused in_proj_qkvz / in_proj_ba (+ out_proj) and MoE layers (router, 4 experts x 3, shared expert 3 + its gate)
    "qwen3_next": (
        "qwen3_next",
        dict(DELTANET, **MOE, num_experts=4, moe_intermediate_size=32),
        3 + 17 + 4 + 17 + 1,
        "fast",
        INT8,
    ),
    # Qwen3.5's MoE: separate in_proj_qkv / z / b / a (+ out_proj), batched 3-D experts (router, 4 x 3) and a shared
    # expert (3 + its gate)
    "qwen3_5_moe": (
        "qwen3_5_moe_text",
        dict(DELTANET, **MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        5 + 17 + 4 + 17 + 1,
        "fast",
        INT8,
    ),
    # Mamba2 mixer (in_proj, out_proj; a convolution window and a selective-scan state) + MLP, then attention + MLP
    "bamba": ("bamba", dict(MAMBA2, attn_layer_indices=[1]), 5 + 7 + 1, "fast", W4),
    # Granite-4.0-H-Micro (dense): the same layout, a shared MLP (input_linear / output_linear) in each layer, 1024
    # wide (the config's default): its token 0's all-zero embedding row reaches a 4-bit matmul XNNPACK computes as
    # ~1e-5 (upstream/fixes/xnnpack_zero_rows.py)
    "granitemoehybrid": (
        "granitemoehybrid",
        dict(MAMBA2, layer_types=["mamba", "attention"], num_local_experts=0),
        4 + 6 + 1,
        "fast",
        W4,
    ),
    # Falcon-H1: attention and a Mamba2 mixer side by side in every layer (a KV cache and states in one layer)
    "falcon_h1": ("falcon_h1", dict(MAMBA2, mamba_d_ssm=128), 2 * 9 + 1, "fast", INT8),
}
CONVS = {  # layer 0: the convolution (LFM2) or gated DeltaNet layer
    **{name: ("model.layers.0.conv.conv",) for name in ("lfm2", "lfm2_moe", "lfm3")},
    **{name: ("model.layers.0.linear_attn.conv1d",) for name in ("qwen3_5", "qwen3_next", "qwen3_5_moe")},
    **{name: ("model.layers.0.mamba.conv1d",) for name in ("bamba", "granitemoehybrid")},
    "falcon_h1": ("model.layers.0.mamba.conv1d", "model.layers.1.mamba.conv1d"),
}
OTHER = {INT8: W4, W4: INT8}
FAST_PATH_LIBRARIES = {
    "executorch",
    "xnnpack_backend",
    "optimized_native_cpu_ops_lib",
    "custom_ops",
    "quantized_ops_lib",
}
CLI_DEFAULT = (
    "gpt_neox",
)  # the family the default suite also runs through `qharness calibrate` (others: the slow tier)
PROMPT = "def main():"
# the runner-safe head's scale: logits of about a trained model's spread (std ~2 over a hidden state of unit scale);
# N(0, 1) rows give logits of std ~8 and perplexities near 1e10, where int8's rounding moves the perplexity by >2%
HEAD_STD = 0.25


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory, corpus):
    """The family's tiny model and tokenizer, saved with a runner-safe output head (``conftest.runner_safe_head``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = {}

    def get(name):
        if name not in made:
            model_type, config, *_ = FAMILIES[name]
            out = tmp_path_factory.mktemp(name)
            make_tiny_hf(out, model_type, corpus.read_text()[:200_000], layers=2, **config)
            model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
            runner_safe_head(model, tokenizer, std=HEAD_STD)  # saved with it: the CLI runs deploy the same model
            model.save_pretrained(out)
            made[name] = out
        return made[name]

    return get


def held_out(tokenizer, text: str, seq_len: int = 16):
    """4 validation blocks (batches of 2) and 2 calibration blocks of ``text``, as ``run.from_lightning.held_out``
    hands them to the pipeline."""
    from qharness.run.trained import HeldOut

    ids = torch.tensor(tokenizer(text[:20_000])["input_ids"][: 6 * (seq_len + 1)]).view(6, seq_len + 1)
    return HeldOut(x=ids[:4, :-1], y=ids[:4, 1:], batch_size=2, calibration=ids[4:, :-1], texts=lambda: [])


def deploy(source, recipe_name: str, run_dir, text: str, monkeypatch) -> tuple[dict, torch.fx.GraphModule]:
    """PTQ deploy of the model at ``source`` through ``deploy_and_check`` (what ``qharness calibrate`` runs after
    calibration): its summary (as summary.json holds it) and the converted graph the ``.pte`` was lowered from."""
    from qharness.config import ExportConfig, ParityConfig
    from qharness.recipes.registry import load_recipe
    from qharness.run import pipeline, stages, trained
    from qharness.sources.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(source))
    graphs = []
    real = trained.deploy_graph
    monkeypatch.setattr(stages, "deploy_graph", lambda *a, **k: graphs.append(real(*a, **k)) or graphs[-1])
    run = trained.Trained(model, tokenizer, load_recipe(recipe_name), "ptq", str(source), str(source))
    parity = ParityConfig(eval_blocks=4, prompts=1, prompt_len=8, decode_steps=3)
    summary = pipeline.deploy_and_check(run, held_out(tokenizer, text), run_dir, ExportConfig(max_seq_len=32), parity)
    return summary.to_dict(), graphs[0]


def check_coverage(summary: dict, expected_weights: int, convolutions: tuple[str, ...] = ()) -> None:
    """Every linear weight of the model counted, and quantized by the recipe: none float, 100% of the bytes; parity
    passed. A recurrent layer's convolution (LFM2's) is recorded apart, float, with why."""
    cov = summary["coverage"]
    assert cov["weights"] == cov["quantized"] == expected_weights, cov
    assert cov["float"] == {} and cov["fraction"] == 1.0, cov
    convs = cov.get("convolutions", {})
    assert sorted(convs) == sorted(convolutions), convs
    assert all(not c["quantized"] and "multiply-add per kernel tap" in c["note"] for c in convs.values()), convs
    parity = summary["parity"]
    assert summary["quantized"] and parity["passed"], parity
    assert parity["near_ties"] < parity["positions"], parity  # the argmax agreement counted some decided positions


def check_runner(run_dir, new_tokens: int = 8) -> None:
    """ExecuTorch's LLM runner generates ``new_tokens`` tokens from the run's ``.pte`` and tokenizer, the same text
    as qharness's greedy loop (``runtime/generate.py``) over the same program."""
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    from qharness.runtime.generate import generate, load_tokenizer
    from qharness.runtime.pte import PteModel

    pte, tokenizer = run_dir / "model.pte", run_dir / "tokenizer"
    ours = generate(PteModel(pte), load_tokenizer(tokenizer), PROMPT, max_new_tokens=new_tokens, temperature=0)
    pieces, stats = [], []
    config = GenerationConfig(echo=False, max_new_tokens=new_tokens, temperature=0.0, num_bos=1)
    TextLLMRunner(str(pte), str(tokenizer)).generate(
        PROMPT, config, token_callback=pieces.append, stats_callback=stats.append
    )
    assert len(ours["new_tokens"]) == new_tokens and len(set(ours["new_tokens"])) > 1, ours
    assert "".join(pieces) == ours["text"] and stats[0].num_prompt_tokens == ours["prompt_tokens"]


# families whose deploy path the default suite covers elsewhere (slow tier here, to keep the default suite short):
# MoE experts (mixtral, deepseek_v3 here), sliding windows (gemma2), parallel residuals (phi3, falcon; gpt_neox through
# the CLI below), recurrent states (lfm2, qwen3_5; Mamba2: granitemoehybrid, falcon_h1; bamba has the same mixer)
DEPLOY_SLOW = {"qwen3_moe", "qwen3_next", "qwen3_5_moe", "lfm2_moe", "lfm3", "mistral_window", "gpt_neox", "bamba"}


@pytest.mark.parametrize(
    "name, recipe",
    [
        pytest.param(
            name,
            recipe,
            marks=() if recipe == default and name not in DEPLOY_SLOW else pytest.mark.slow,
            id=f"{name}-{recipe}",
        )
        for name, (*_, default) in FAMILIES.items()
        for recipe in (default, OTHER[default])
    ],
)
def test_family_deploys_fully_quantized_passes_parity_and_runs_in_the_runner(
    name, recipe, family_dir, corpus, tmp_path, monkeypatch
):
    _, _, weights, path, _ = FAMILIES[name]
    summary, graph = deploy(family_dir(name), recipe, tmp_path / "run", corpus.read_text(), monkeypatch)
    check_coverage(summary, weights, CONVS.get(name, ()))
    assert float_weight_matmuls(graph) == []  # counted apart from coverage.py: no projection reads a float weight
    assert summary["pte"]["export_path"] == path, summary["pte"]["fallback_reason"]
    # what a runner links for it (docs/tutorials/deploying.md's table): the fast path's libraries, no other
    libraries = set(kernel_libraries(tmp_path / "run" / "model.pte"))
    assert "unknown" not in libraries and (path != "fast" or libraries <= FAST_PATH_LIBRARIES), libraries
    check_runner(tmp_path / "run")


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=() if name in CLI_DEFAULT else pytest.mark.slow) for name in FAMILIES]
)
def test_family_through_calibrate(name, family_dir, corpus, tmp_path):
    """``qharness calibrate`` with the family's recipe, as a user runs it (the architecture check's deploy probe, PTQ,
    deploy): coverage and parity in ``summary.json``, the runner generates from the ``.pte``."""
    _, _, weights, path, recipe = FAMILIES[name]
    cfg = tiny_run_config(tmp_path, family_dir(name), corpus, model={"mode": "ptq", "recipe": recipe})
    result = run_cli("calibrate", "--config", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    check_coverage(summary, weights, CONVS.get(name, ()))
    assert summary["pte"]["export_path"] == path, summary["pte"]["fallback_reason"]
    assert f"quantized: 100.0% of linear weight bytes ({weights} of {weights} weights)" in result.stdout
    gen = run_cli("generate", "--pte", tmp_path / "run" / "model.pte", "--prompt", PROMPT, "--max_new_tokens", "6")
    assert gen.returncode == 0 and gen.stdout.startswith(PROMPT), gen.stderr[-2000:]
