"""Multi-head latent attention (DeepSeek-V3, ``deepseek_v3``; also an MoE): the fast path caches its compressed latent
and rotary key (keys and values of different widths), attends over the keys and values the model expands from them,
every projection is quantized, and ``qharness calibrate`` deploys a ``.pte`` that passes parity and generates."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_hf, run_cli, tiny_run_config, write_config

# MLA widths (keys: qk_nope + qk_rope = 24 per head; the latent: kv_lora_rank) and the MoE ones, small
MLA = dict(
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=1,
    topk_group=1,
)


def tiny_deepseek(first_k_dense_replace: int = 1, **overrides):
    """A random 2-layer DeepSeek-V3 (a dense layer, then an MoE one), rewritten as qharness loads it, eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qharness.sources.normalize import normalize_model

    config = AutoConfig.for_model(
        "deepseek_v3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        first_k_dense_replace=first_k_dense_replace,
        **{**MLA, **overrides},
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    normalize_model(model)
    return model


@pytest.mark.fast
@pytest.mark.parametrize("v_head_dim", [12, 32])  # values narrower, then wider, than the keys (24)
def test_fast_path_takes_mla(v_head_dim):
    """The fast path's support check (prefill, a second chunk and a decode step against the model's own logits)
    passes, over per-layer caches of the latent ``[1, S, 1, kv_lora_rank]`` and rotary key ``[1, S, 1, qk_rope]``
    (before: 'a DynamicLayer cache layer without keys and values of one shape', and the generic export failed)."""
    from qharness.deploy.fastpath import decoder as fast_decoder
    from qharness.deploy.fastpath import support as fast_support

    model = tiny_deepseek(v_head_dim=v_head_dim)
    assert fast_support.unsupported_reason(model, 32) is None
    decoder = fast_decoder.FastDecoder(model, 32)
    assert tuple(decoder.k_cache_0.shape) == (1, 32, 1, 16) and tuple(decoder.v_cache_0.shape) == (1, 32, 1, 8)
    x = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=x, use_cache=False).logits[0, -1]
        decoder(x[:, :6], torch.tensor([0]))
        got = decoder(x[:, 6:], torch.tensor([6]))[0, -1]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_deploy_graph_quantizes_every_mla_projection():
    """The converted graph the ``.pte`` is lowered from takes the fast path and holds every weight as an int8
    constant: no ``quantize_per_channel`` of a float parameter is left to run (before: ``kv_b_proj``'s, which
    torchao's constant folding skips because its output is ``copy_``-ed into the keys; ExecuTorch's portable kernel
    then aborted at run time), and the coverage check counts every projection quantized."""
    from qharness.deploy.deployed import export_path, graph_coverage
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    model = tiny_deepseek()
    tokens = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    graph = quantize_for_deploy(model, load_recipe("xnnpack_int8_dynamic"), 32, lambda g: g(tokens, torch.tensor([0])))
    assert export_path(graph) == "fast"
    left = [n.name for n in graph.graph.nodes if getattr(n.target, "_opname", "") == "quantize_per_channel"]
    assert left == [], left
    assert not any("kv_b_proj" in name for name, _ in graph.named_parameters())
    coverage = graph_coverage(graph)
    assert coverage.fraction == 1.0 and coverage.float == {}, coverage
    assert "model.layers.0.self_attn.kv_b_proj" not in coverage.unused, coverage


def test_source_recipe_quantizes_every_mla_projection_and_the_router():
    """torchao's 8da4w (source-level) on DeepSeek-V3: the fast path's graph exports with the router's weight a torchao
    quantized tensor (its ``weight.type(torch.float32)``: before ``upstream/fixes/torchao_metadata.py``,
    ``NotImplementedError ... aten._assert_tensor_metadata``) and every projection, router included, is 8da4w."""
    from qharness.deploy.deployed import export_path, graph_coverage, quantized_layers
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    model = tiny_deepseek(kv_lora_rank=32, v_head_dim=8)  # every in_features a multiple of the group size (32)
    tokens = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(3))
    graph = quantize_for_deploy(model, load_recipe("xnnpack_8da4w"), 32, lambda g: g(tokens, torch.tensor([0])))
    assert export_path(graph) == "fast"
    assert quantized_layers(graph)["model.layers.1.mlp.gate.proj"] == "8da4w-g32"
    coverage = graph_coverage(graph)
    assert coverage.fraction == 1.0 and coverage.float == {}, coverage


@pytest.mark.slow  # ~35 s; the default suite deploys DeepSeek-V3 in process (test_families: fast path, coverage, parity,
# the runner) and drives other families through qharness calibrate
def test_calibrate_cli_deploys_deepseek_v3(tmp_path, corpus):
    """``qharness calibrate`` (PTQ, int8 dynamic) of a one-layer DeepSeek-V3 MoE: the architecture check passes,
    the ``.pte`` takes the fast path, passes the parity gate and generates (before: exit 2, the architecture check's
    export failed on transformers' static cache, ``index_copy_`` of a 16-wide latent into a 24-wide key cache)."""
    model = make_tiny_hf(
        tmp_path / "model",
        "deepseek_v3",
        corpus.read_text()[:200_000],
        first_k_dense_replace=0,
        head_dim=None,
        num_key_value_heads=None,
        **MLA,
    )
    cfg = tiny_run_config(tmp_path, model, corpus, model={"mode": "ptq"})
    result = run_cli("calibrate", "--config", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parity"]["passed"], summary["parity"]
    assert summary["pte"]["export_path"] == "fast", summary["pte"]
    assert summary["coverage"]["fraction"] == 1.0, summary["coverage"]
    gen = run_cli(
        "generate", "--pte", tmp_path / "run" / "model.pte", "--prompt", "def ", "--max_new_tokens", "6", "--seed", "0"
    )
    assert gen.returncode == 0 and gen.stdout.startswith("def ") and "tok/s" in gen.stderr, gen.stderr[-2000:]


def test_int8_kv_cache_of_mla_stores_the_latent_as_int8_and_stays_close():
    """``kv_cache: int8``: the latent and rotary-key caches are int8 (per token, dequantized before the model expands
    them); prefill then decode stays close to the model's own logits, eager and exported alike."""
    from qharness.deploy.fastpath import decoder as fast_decoder

    model = tiny_deepseek()
    x = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    decoder = fast_decoder.FastDecoder(model, 32, kv_cache="int8")
    assert decoder.k_cache_0.dtype == torch.int8 and tuple(decoder.v_cache_0.shape) == (1, 32, 1, 8)
    graph = fast_decoder.export_fast(model, 32, kv_cache="int8").module()
    with torch.no_grad():
        ref = model(input_ids=x, use_cache=False).logits[0, -1]
        for run in (decoder, graph):
            run(x[:, :6], torch.tensor([0]))
            got = run(x[:, 6:], torch.tensor([6]))[0, -1]
            err = (got - ref).abs().max().item()
            assert 0 < err < 0.02 * ref.abs().max().item(), err


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache", ["fp32", "int8"])
def test_calibrate_cli_deploys_deepseek_v3_with_8da4w(tmp_path, corpus, kv_cache):
    """The same with torchao's 8da4w (int4 group-wise weights, group 32), with a float and an int8 KV cache: parity
    passes and the ``.pte`` generates."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: xnnpack_8da4w\ndescription: 8da4w, {kv_cache} KV cache\nkv_cache: {kv_cache}\n")
    dims = {**MLA, "kv_lora_rank": 32, "v_head_dim": 8}
    model = make_tiny_hf(
        tmp_path / "model", "deepseek_v3", corpus.read_text()[:200_000], head_dim=None, num_key_value_heads=None, **dims
    )
    cfg = tiny_run_config(tmp_path, model, corpus, model={"mode": "ptq", "recipe": str(recipe)})
    result = run_cli("calibrate", "--config", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parity"]["passed"] and summary["pte"]["export_path"] == "fast", summary
    assert summary["pte"]["kv_cache"] == kv_cache, summary["pte"]
    gen = run_cli(
        "generate", "--pte", tmp_path / "run" / "model.pte", "--prompt", "def ", "--max_new_tokens", "6", "--seed", "0"
    )
    assert gen.returncode == 0 and gen.stdout.startswith("def "), gen.stderr[-2000:]


def test_deepseek_v2_is_refused_before_work_naming_the_missing_pieces(tmp_path, corpus):
    """DeepSeek-V2 rotates with complex numbers: ``qharness calibrate`` stops at the architecture check (exit 2, one
    line) naming what each export lacks: complex rotary factors for the fast path (ExecuTorch has no complex dtype),
    keys and values of different widths for transformers' StaticCache (before: only 'TorchRuntimeError: RuntimeError
    when making fake tensor call')."""
    dims = {k: v for k, v in MLA.items() if k not in ("n_group", "topk_group")}
    model = make_tiny_hf(
        tmp_path / "model", "deepseek_v2", corpus.read_text()[:50_000], head_dim=None, num_key_value_heads=None, **dims
    )
    cfg = write_config(tmp_path / "run.yaml", model, corpus, tmp_path / "run", model={"mode": "ptq"})
    result = run_cli("calibrate", "--config", cfg)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "DeepseekV2ForCausalLM cannot be deployed" in lines[0], lines[0]
    assert "complex rotary factors" in lines[0] and "no complex dtype" in lines[0], lines[0]
    assert "keys of 1 x 16 and values of 1 x 8" in lines[0] and "StaticCache" in lines[0], lines[0]
    assert not (tmp_path / "run" / "model.pte").exists()
