"""The fast deploy graph (qharness/deploy/fastpath/: the HF model's own forward with ExecuTorch's ops as its
attention and cache) against the HF model, for every family, and the generic fallback."""

import logging

import pytest
import torch

from qharness.checks.parity import block_logits, tail_logits
from qharness.deploy.fastpath import attention as fast_attention
from qharness.deploy.fastpath import decoder as fast_decoder
from qharness.deploy.fastpath import support as fast_support
from qharness.deploy.fastpath import transposes as fast_transposes
from qharness.deploy.fastpath import twin as fast_twin


def _step(decoder):
    return lambda tokens, start: decoder(tokens, torch.tensor([start]))


def _check_equal_to_hf(model, max_seq_len=48, atol=2e-5):
    """Prefill at 0, chunked prefill at a later start, token-by-token decode: last-token logits equal HF's."""
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    decoder = fast_decoder.FastDecoder(model, max_seq_len)
    with torch.no_grad():
        ref = model(input_ids=x).logits[0]
        out = decoder(x[:, :20], torch.tensor([0]))
        assert out.shape == (1, 1, vocab)
        torch.testing.assert_close(out[0, -1], ref[19], atol=atol, rtol=0)
        out = decoder(x[:, 20:30], torch.tensor([20]))  # a second chunk continues the cache
        torch.testing.assert_close(out[0, -1], ref[29], atol=atol, rtol=0)
        for i in range(30, 40):
            torch.testing.assert_close(decoder(x[:, i : i + 1], torch.tensor([i]))[0, -1], ref[i], atol=atol, rtol=0)
        torch.testing.assert_close(block_logits(_step(decoder), x[0, :24]), ref[:24], atol=atol, rtol=0)
        # a continuation's logits alone: one prefill of the context, then its tokens (a longer block ran before)
        calls = []

        def counted(tokens, start):
            calls.append(tokens.shape[1])
            return _step(decoder)(tokens, start)

        for k in (1, 3, 23):
            calls.clear()
            torch.testing.assert_close(tail_logits(counted, x[0, :24], k), ref[24 - k : 24], atol=atol, rtol=0)
            assert calls[0] == 25 - k and len(calls) == k  # a prefill, then k - 1 single tokens


@pytest.mark.fast
def test_fast_decoder_equals_the_hf_llama(tiny_llama):
    from qharness.sources.models import load_model_and_tokenizer

    model = load_model_and_tokenizer(str(tiny_llama))[0]
    assert fast_support.unsupported_reason(model, 64) is None
    _check_equal_to_hf(model)


def _tiny(arch: str, **extra):
    """A 2-layer random model: ``arch`` an HF class name (``LlamaForCausalLM``) or a ``model_type`` (``gemma2``)."""
    import transformers

    dims = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    if arch.endswith("ForCausalLM"):
        config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**dims, **extra)
        return getattr(transformers, arch)(config).eval()
    dims.update(hidden_size=64, intermediate_size=128, head_dim=16)  # = hidden / heads: some families assume it
    config = transformers.AutoConfig.for_model(arch, **dims, **extra)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


# Families on the fast path (model_type, extra config): windows shorter than the 48-position cache, soft-capping.
DELTANET = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
# Mamba2 mixers: 8 heads of 16 (intermediate 128), 2 groups of a 16-wide state, chunks of 16 (the model's own scan:
# 2 chunks and more over 40 tokens; the fast path's scan takes each call as one chunk)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=16, mamba_expand=2)
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 8},  # every layer windowed
    "qwen2": {},  # q/k/v biases
    "qwen3": {},  # q/k head norms
    "gemma": {},
    "gemma2": {"sliding_window": 8},  # alternating window / full layers, attention + final logit soft-capping
    "gemma3_text": {"sliding_window": 8},  # window layers with their own rotary base, q/k norms
    "phi3": {},  # fused qkv / gate_up projections
    "olmo2": {},  # q/k norms over the whole projection
    "stablelm": {},  # partial rotary, LayerNorm
    "granite": {},  # multipliers (same parts, no code of ours)
    "starcoder2": {},
    "gpt2": {},  # learned positions, no rotary
    "lfm2": {"layer_types": ["conv", "full_attention"]},  # a convolution state (no KV cache) in layer 0
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1, "num_experts": 4},
    # LFM3: LFM2's convolutions beside (here windowed) attention; its rotary knows the attention layer types only
    "lfm3": {"layer_types": ["conv", "sliding_attention"], "sliding_window": 8},
    "qwen3_5_text": DELTANET,  # gated DeltaNet: a convolution window and the delta rule's recurrent state in layer 0
    "qwen3_next": {**DELTANET, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "qwen3_5_moe_text": {  # Qwen3.5's MoE: gated DeltaNet and gated attention, batched 3-D experts + a shared expert
        **DELTANET,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    # Mamba2 selective-scan state (a convolution window and the scan's [heads, head_dim, state] state) in layer 0
    "bamba": {**MAMBA2, "attn_layer_indices": [1]},
    "granitemoehybrid": {**MAMBA2, "layer_types": ["mamba", "attention"], "num_local_experts": 4},  # Granite-4.0-H MoE
    "falcon_h1": {**MAMBA2, "mamba_d_ssm": 128},  # attention and a Mamba2 mixer side by side: a KV cache and states
    "nemotron_h": {  # Nemotron-H's own names for the same mixer
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "chunk_size": 16,
        "layers_block_type": ["mamba", "attention"],
    },
    "zamba2": {  # a shared attention block beside the mixer of its hybrid layer
        "mamba_headdim": 16,
        "mamba_d_state": 16,
        "mamba_ngroups": 2,
        "chunk_size": 16,
        "n_mamba_heads": 8,
        "layers_block_type": ["mamba", "hybrid"],
        "attention_head_dim": 16,
    },
    "mamba2": {"num_heads": 8, "state_size": 16, "n_groups": 2, "chunk_size": 16},  # no attention at all
}


@pytest.mark.fast
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_decoder_equals_every_family(family):
    model = _tiny(family, **FAMILIES[family])
    assert fast_support.unsupported_reason(model, 48) is None
    _check_equal_to_hf(model)


@pytest.mark.fast
@pytest.mark.parametrize("groups", [1, 2])
def test_mamba2_scan_as_one_chunk_equals_transformers_chunked_scan_and_continues_from_its_state(groups):
    """``mamba2_scan`` (each call's tokens one chunk) against transformers' own ``mamba2_chunk_scan`` (chunks of 8
    over 37 tokens, from a given state): the outputs and the final state; and the same 37 tokens in two calls, the
    second from the first's final state."""
    from transformers.models.mamba2 import modeling_mamba2

    from qharness.deploy.fastpath.state_cache import mamba2_scan

    g = torch.Generator().manual_seed(0)
    heads, width, state_size, n = 4, 8, 16, 37
    x, dt = torch.randn(1, n, heads, width, generator=g), torch.randn(1, n, heads, generator=g)
    B, C = (torch.randn(1, n, groups, state_size, generator=g) for _ in range(2))
    A, D, bias = -2 * torch.rand(heads, generator=g), torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    state = torch.randn(1, heads, width, state_size, generator=g)
    kw = dict(D=D, dt_bias=bias, dt_softplus=True, return_final_states=True)
    ref_y, ref_state = modeling_mamba2.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=8, initial_states=state, **kw)
    y, final = mamba2_scan(x, dt, A, B, C, initial_states=state, **kw)
    torch.testing.assert_close(y, ref_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref_state, atol=1e-3, rtol=1e-4)
    y1, mid = mamba2_scan(x[:, :30], dt[:, :30], A, B[:, :30], C[:, :30], initial_states=state, **kw)
    y2, final = mamba2_scan(x[:, 30:], dt[:, 30:], A, B[:, 30:], C[:, 30:], initial_states=mid, **kw)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), ref_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, ref_state, atol=1e-3, rtol=1e-4)


@pytest.mark.fast
@pytest.mark.parametrize(
    "arch, extra",
    [
        ("Qwen2ForCausalLM", {}),  # q/k/v biases
        ("Qwen3ForCausalLM", {"head_dim": 16}),  # q/k head norms, head_dim != hidden / heads
        ("MistralForCausalLM", {"sliding_window": None}),
        (
            "LlamaForCausalLM",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 5e5,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                }
            },
        ),
    ],
)
def test_fast_decoder_equals_other_supported_architectures(arch, extra):
    model = _tiny(arch, **extra)
    assert fast_support.unsupported_reason(model, 48) is None
    _check_equal_to_hf(model)


def test_exported_fast_graph_equals_the_eager_one(tiny_llama):
    from qharness.sources.models import load_model_and_tokenizer

    model = load_model_and_tokenizer(str(tiny_llama))[0]
    graph = fast_decoder.export_fast(model, 32).module()
    eager = fast_decoder.FastDecoder(model, 32)
    x = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        for tokens, start in ((x[:, :9], 0), (x[:, 9:10], 9), (x[:, 10:12], 10)):  # other lengths than the example's 8
            torch.testing.assert_close(graph(tokens, torch.tensor([start])), eager(tokens, torch.tensor([start])))
    with pytest.raises(RuntimeError):  # past the cache: the exported bound check refuses it
        graph(x[:, :4], torch.tensor([30]))


def _bloom():
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    config = BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2, eos_token_id=0, bos_token_id=0)
    return BloomForCausalLM(config).eval()


@pytest.mark.fast
def test_unsupported_models_say_why():
    assert fast_support.unsupported_reason(_bloom(), 32) == (
        "BloomForCausalLM: its attention does not use transformers' AttentionInterface"
    )
    dynamic = _tiny("LlamaForCausalLM", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    assert "rotary type 'dynamic'" in fast_support.unsupported_reason(dynamic, 32)


@pytest.mark.fast
def test_a_family_whose_forward_ignores_the_cache_is_refused(monkeypatch):
    """The eager check is what proves a family's attention goes through the interfaces: here the cache is skipped."""
    model = _tiny("LlamaForCausalLM")
    monkeypatch.setattr(fast_decoder, "register", lambda: None)  # keeps the attention function below registered
    from transformers import AttentionInterface

    AttentionInterface.register(fast_attention.ATTENTION, lambda module, q, k, v, *a, **kw: (q.transpose(1, 2), None))
    try:
        assert "the fast path's logits differ from the model's own" in fast_support.unsupported_reason(model, 32)
    finally:
        monkeypatch.undo()
        fast_attention.register()


@pytest.mark.fast
def test_an_unsupported_architecture_falls_back_to_the_generic_export(caplog):
    from qharness.deploy.deployed import export_path, fallback_reason
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    bloom = _bloom()
    x = torch.randint(0, 64, (1, 5))
    ref = bloom(x).logits
    with caplog.at_level(logging.WARNING, logger="qharness.deploy.lower"):
        graph = quantize_for_deploy(bloom, load_recipe("xnnpack_fp32"), 32, calibrate=lambda g: None)
    assert export_path(graph) == "generic" and fallback_reason(graph).startswith(
        "BloomForCausalLM: its attention does not use transformers' AttentionInterface"
    )
    assert "falling back to the generic HF static-cache export" in caplog.text and "BloomForCausalLM" in caplog.text
    torch.testing.assert_close(graph(x, torch.tensor([0])), ref)  # all-position logits, as before


def test_a_failing_fast_export_falls_back_with_the_reason(monkeypatch):
    from qharness.deploy.lower import export_deploy

    def broken(model, max_seq_len, all_logits=False, kv_cache="fp32"):
        raise RuntimeError("Dynamo failed to run FX node")

    monkeypatch.setattr(fast_decoder, "export_fast", broken)
    _, reason = export_deploy(_tiny("LlamaForCausalLM"), 32)
    assert (
        reason == "LlamaForCausalLM: torch.export of the fast path failed (RuntimeError: Dynamo failed to run FX node)"
    )


def test_a_source_quantized_model_is_checked_for_the_fast_path_on_its_fp_weights(monkeypatch):
    """torchao recipes quantize the model before export; the support check (the fast path's logits against the
    model's own, to float tolerance) must see the FP weights, where one int8 activation rounded the other way cannot
    move the logits (it did by 0.13 on a 30-layer 135M model, which then fell back to the slow export)."""
    from qharness.deploy.deployed import export_path
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    seen, check = [], fast_support.unsupported_reason

    def recording(model, max_seq_len):
        seen.append({type(m.weight.data) for m in model.modules() if isinstance(m, torch.nn.Linear)})
        return check(model, max_seq_len)

    monkeypatch.setattr(fast_support, "unsupported_reason", recording)
    model = _tiny("LlamaForCausalLM")
    graph = quantize_for_deploy(model, load_recipe("xnnpack_8da4w"), 32, lambda g: None)
    assert seen == [{torch.Tensor}]  # checked once, on plain float weights
    assert {type(m.weight.data) for m in model.modules() if isinstance(m, torch.nn.Linear)} != {torch.Tensor}
    assert export_path(graph) == "fast"


def test_the_model_is_left_as_it_was():
    """The attention implementation and rotary modules are swapped only while the fast path runs."""
    model = _tiny("gemma2", sliding_window=8)
    rotary, impl = model.model.rotary_emb, model.config._attn_implementation
    fast_decoder.export_fast(model, 32)
    assert model.model.rotary_emb is rotary and model.config._attn_implementation == impl != fast_attention.ATTENTION


def test_sink_transposes_leaves_no_transpose_and_the_same_values():
    """HF's BHSD transposes and the fast path's way back to BSHD cancel: the lowered program has no permute of
    q, k, v or the cache (ExecuTorch would copy each)."""
    for family in ("llama", "gemma3_text", "phi3", "olmo2", "stablelm"):
        model = _tiny(family, **FAMILIES[family])
        ep = fast_decoder.export_fast(model, 32)
        assert not [n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.transpose.int], family
        assert fast_transposes.sink_transposes(ep.graph_module) == 0  # nothing left to move


def _lowered_ops(graph, recipe, max_seq_len):
    import tempfile
    from pathlib import Path

    from qharness.deploy.lower import lower_to_pte
    from qharness.runtime.pte import operators

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "m.pte"
        path.write_bytes(lower_to_pte(graph, recipe, max_seq_len))
        return operators(path)["operators"]


@pytest.mark.parametrize(
    "family", ["llama", "mistral", pytest.param("gemma2", marks=pytest.mark.slow)]
)  # gemma2: ~14 s
def test_lowered_fast_program_has_no_permute_copies(family):
    """No layer moves data between layouts: custom SDPA layers (causal, or windowed by a mask), and Gemma2's
    soft-capped attention (plain matmuls: ``custom_sdpa`` cannot soft-cap), which reads the caches as they lie."""
    from qharness.deploy.deployed import export_path
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    recipe = load_recipe("xnnpack_fp32")
    graph = quantize_for_deploy(_tiny(family, **FAMILIES[family]), recipe, 32, calibrate=lambda g: None)
    assert export_path(graph) == "fast"
    ops = _lowered_ops(graph, recipe, 32)
    assert "llama::update_cache.out" in ops and not [op for op in ops if "permute" in op], ops
    assert ("llama::custom_sdpa.out" in ops) == (family != "gemma2"), ops


@pytest.mark.fast
def test_fold_constants_computes_weight_math_once_and_keeps_the_cache_state():
    from qharness.checks.parity import fold_constants

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w_int", torch.randint(-8, 8, (4, 4), dtype=torch.int8))
            self.register_buffer("scale", torch.rand(4))
            self.register_buffer("cache", torch.zeros(4))

        def forward(self, x):
            w = self.w_int.to(torch.float32) * self.scale  # constants only: folded
            self.cache.add_(x.sum(0))  # a mutated buffer: never folded
            return x @ w + self.cache

    graph = torch.export.export(M(), (torch.randn(2, 4),)).module()
    folded = fold_constants(graph)

    def count(g, op):
        return sum(n.target == op for n in g.graph.nodes)

    assert count(graph, torch.ops.aten.mul.Tensor) == 1 and count(folded, torch.ops.aten.mul.Tensor) == 0
    for _ in range(3):  # the caches of both advance alike
        x = torch.randn(2, 4)
        torch.testing.assert_close(folded(x), graph(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "recipe, rel",
    [  # tolerance as a fraction of the logits' spread (std ~0.1 here)
        ("xnnpack_fp32", 1e-4),
        (
            "xnnpack_8da4w",
            0.02,
        ),  # per-token dynamic activations: only float rounding flips an int8 rounding now and then
        ("xnnpack_int8_dynamic", 0.15),  # per-tensor dynamic activations: one scale over the block vs one per token
    ],
)
def test_all_logits_twin_scores_blocks_as_the_per_token_path(recipe, rel):
    """A wrong twin (e.g. logits of the next position) is off by several times the spread."""
    from qharness.checks.parity import fold_constants
    from qharness.deploy.deployed import export_path
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    model = _tiny("LlamaForCausalLM")
    blocks = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    deployed = quantize_for_deploy(
        model, load_recipe(recipe), 48, calibrate=lambda g: [g(b[None], torch.tensor([0])) for b in blocks]
    )
    reference = fold_constants(deployed)
    twin = fast_twin.all_logits_twin(reference)
    assert export_path(twin) == "fast"
    shared = {t.data_ptr() for t in [*reference.state_dict().values(), *reference.buffers()]}  # + rotary tables
    assert all(t.data_ptr() in shared for t in twin.state_dict().values())  # weights and KV cache shared, not copied
    with torch.no_grad():
        for block in blocks:
            per_token = block_logits(_step(reference), block)  # n calls
            all_positions = twin(block[None], torch.tensor([0]))[0]  # one call
            assert all_positions.shape == per_token.shape == (24, 96)
            atol = rel * per_token.std().item()
            torch.testing.assert_close(all_positions, per_token, atol=atol, rtol=0)
        # the twin's prefill leaves the shared cache as the per-token path does: decoding goes on alike
        nxt = torch.tensor([[5]])
        twin(blocks[0][None], torch.tensor([0]))
        after_twin = reference(nxt, torch.tensor([24]))
        block_logits(_step(reference), blocks[0])
        torch.testing.assert_close(after_twin, reference(nxt, torch.tensor([24])), atol=atol, rtol=0)


def test_all_logits_twin_of_a_generic_graph_is_the_graph():
    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    graph = quantize_for_deploy(_bloom(), load_recipe("xnnpack_fp32"), 32, calibrate=lambda g: None)
    assert fast_twin.all_logits_twin(graph) is graph


@pytest.mark.fast
def test_a_config_the_model_itself_cannot_run_is_named_as_such_not_blamed_on_the_fast_path(tmp_path, monkeypatch):
    """A Mixtral choosing 4 of its 2 experts fails in transformers' own forward: the architecture check says that,
    naming the config (it said "its forward fails with the fast path's cache", and a user looked at the fast path)."""
    from qharness.deploy.architectures import check_architecture
    from qharness.errors import UserError
    from qharness.recipes.registry import load_recipe

    model = _tiny("MixtralForCausalLM", num_local_experts=2, num_experts_per_tok=4)
    with pytest.raises(
        UserError, match=r"MixtralForCausalLM: the model's own forward fails on 6 tokens \(RuntimeError"
    ):
        fast_support.unsupported_reason(model, 32)
    model.config.save_pretrained(tmp_path / "mixtral")
    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"the model's own forward fails .* fix: check its config"):
        check_architecture(str(tmp_path / "mixtral"), recipe=load_recipe("xnnpack_int8_dynamic"), max_seq_len=32)
