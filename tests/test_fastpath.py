"""The fast deploy graph (qharness/deploy/fastpath.py) against the HF model it rewrites, and the generic fallback."""

import logging

import pytest
import torch

from qharness.checks.parity import block_logits
from qharness.deploy import fastpath


def _step(decoder):
    return lambda tokens, start: decoder(tokens, torch.tensor([start]))


def _check_equal_to_hf(model, max_seq_len=48, atol=2e-5):
    """Prefill at 0, chunked prefill at a later start, token-by-token decode: last-token logits equal HF's."""
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    decoder = fastpath.FastDecoder(model, max_seq_len)
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


def test_fast_decoder_equals_the_hf_llama(tiny_llama):
    from qharness.sources.models import load_model_and_tokenizer

    model = load_model_and_tokenizer(str(tiny_llama))[0]
    assert fastpath.unsupported_reason(model, 64) is None
    _check_equal_to_hf(model)


def _tiny(arch: str, **extra):
    import transformers

    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **extra,
    )
    torch.manual_seed(0)
    return getattr(transformers, arch)(config).eval()


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
    assert fastpath.unsupported_reason(model, 48) is None
    _check_equal_to_hf(model)


def test_exported_fast_graph_equals_the_eager_one(tiny_llama):
    from qharness.sources.models import load_model_and_tokenizer

    model = load_model_and_tokenizer(str(tiny_llama))[0]
    graph = fastpath.export_fast(model, 32).module()
    eager = fastpath.FastDecoder(model, 32)
    x = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        for tokens, start in ((x[:, :9], 0), (x[:, 9:10], 9), (x[:, 10:12], 10)):  # other lengths than the example's 8
            torch.testing.assert_close(graph(tokens, torch.tensor([start])), eager(tokens, torch.tensor([start])))
    with pytest.raises(RuntimeError):  # past the cache: the exported bound check refuses it
        graph(x[:, :4], torch.tensor([30]))


def test_unsupported_models_say_why():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert fastpath.unsupported_reason(gpt2, 32).startswith("GPT2LMHeadModel: not a supported architecture")
    mistral = _tiny("MistralForCausalLM", sliding_window=16)
    assert "sliding-window attention (window 16 < deploy.max_seq_len 32)" in fastpath.unsupported_reason(mistral, 32)
    assert fastpath.unsupported_reason(mistral, 16) is None  # the window covers the whole cache
    dynamic = _tiny("LlamaForCausalLM", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    assert "rotary type 'dynamic'" in fastpath.unsupported_reason(dynamic, 32)


def test_an_unsupported_architecture_falls_back_to_the_generic_export(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    from qharness.deploy.lower import export_path, fallback_reason, quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64, eos_token_id=0, bos_token_id=0)
    ).eval()
    x = torch.randint(0, 64, (1, 5))
    ref = gpt2(x).logits
    with caplog.at_level(logging.WARNING, logger="qharness.deploy.lower"):
        graph = quantize_for_deploy(gpt2, load_recipe("xnnpack_fp32"), 32, calibrate=lambda g: None)
    assert export_path(graph) == "generic" and fallback_reason(graph).startswith(
        "GPT2LMHeadModel: not a supported architecture"
    )
    assert "falling back to the generic HF static-cache export" in caplog.text and "GPT2LMHeadModel" in caplog.text
    torch.testing.assert_close(graph(x, torch.tensor([0])), ref)  # all-position logits, as before


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
    from qharness.deploy.lower import export_path, quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    model = _tiny("LlamaForCausalLM")
    blocks = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    deployed = quantize_for_deploy(
        model, load_recipe(recipe), 48, calibrate=lambda g: [g(b[None], torch.tensor([0])) for b in blocks]
    )
    reference = fold_constants(deployed)
    twin = fastpath.all_logits_twin(reference)
    assert export_path(twin) == "fast"
    shared = {t.data_ptr() for t in reference.state_dict().values()}
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
    from transformers import GPT2Config, GPT2LMHeadModel

    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.registry import load_recipe

    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64, eos_token_id=0, bos_token_id=0)
    ).eval()
    graph = quantize_for_deploy(gpt2, load_recipe("xnnpack_fp32"), 32, calibrate=lambda g: None)
    assert fastpath.all_logits_twin(graph) is graph
