"""The int8 KV cache (a recipe's ``kv_cache: int8``): keys and values stored as int8 per token and head, attention
through ExecuTorch's ``llama::custom_quantized_sdpa``; close to the float cache, equal between eager and export,
and through the CLI to a ``.pte`` that passes the parity gate."""

import json

import pytest
import torch
from conftest import run_cli, write_config
from test_fastpath import _tiny

from qharness.deploy.fastpath import decoder as fast_decoder
from qharness.errors import UserError
from qharness.recipes import registry


def _logits(model, kv_cache, x, max_seq_len=48):
    """Every position's logits: a prefill of 20 tokens, a chunk of 10, then one token at a time."""
    decoder = fast_decoder.FastDecoder(model, max_seq_len, all_logits=True, kv_cache=kv_cache)
    parts = []
    with torch.no_grad(), decoder.swapped():
        for start, end in [(0, 20), (20, 30), *((i, i + 1) for i in range(30, x.shape[1]))]:
            parts.append(decoder(x[:, start:end], torch.tensor([start]))[0])
    return torch.cat(parts)


@pytest.mark.fast
@pytest.mark.parametrize(
    "arch, extra",
    [
        ("LlamaForCausalLM", {}),  # custom_quantized_sdpa
        ("gemma2", {"sliding_window": 8}),  # window and soft-capped layers: attention over the dequantized cache
        ("mistral", {"sliding_window": 8}),  # every layer windowed
    ],
)
def test_int8_kv_cache_is_close_to_the_float_cache_but_not_equal(arch, extra):
    model = _tiny(arch, **extra)
    x = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=x).logits[0]
    fp, int8 = _logits(model, "fp32", x), _logits(model, "int8", x)
    torch.testing.assert_close(fp, ref, atol=2e-5, rtol=0)
    err = (int8 - ref).abs().max().item()
    assert 0 < err < 0.02 * ref.abs().max().item(), err  # quantized (not the float cache), within 2% of the range
    assert (int8.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.fast
def test_exported_int8_kv_graph_equals_the_eager_one_and_stores_int8():
    model = _tiny("LlamaForCausalLM")
    x = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    ep = fast_decoder.export_fast(model, 48, all_logits=True, kv_cache="int8")
    caches = {k: v.dtype for k, v in ep.module().named_buffers() if "_cache_" in k}
    assert caches and set(caches.values()) == {torch.int8}, caches
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "llama.custom_quantized_sdpa.default" in ops and "llama.custom_sdpa.default" not in ops
    graph = ep.module()
    parts = []
    with torch.no_grad():
        for start, end in [(0, 20), (20, 30), *((i, i + 1) for i in range(30, 40))]:
            parts.append(graph(x[:, start:end], torch.tensor([start]))[0])
    torch.testing.assert_close(torch.cat(parts), _logits(model, "int8", x), atol=1e-5, rtol=0)


@pytest.mark.fast
def test_recipes_take_kv_cache_and_refuse_unknown_values(tmp_path):
    assert registry.load_recipe("xnnpack_8da4w").kv_cache == "fp32"
    good = tmp_path / "kv8.yaml"
    good.write_text("base: xnnpack_8da4w\nkv_cache: int8\n")
    assert registry.load_recipe(str(good)).kv_cache == "int8"
    bad = tmp_path / "kv4.yaml"
    bad.write_text("base: xnnpack_8da4w\nkv_cache: int4\n")
    with pytest.raises(UserError, match="kv_cache must be one of fp32, int8 \\(got 'int4'\\)"):
        registry.load_recipe(str(bad))


def test_calibrate_with_an_int8_kv_cache_recipe_writes_a_pte_that_passes_parity(tmp_path, tiny_llama, corpus):
    recipe = tmp_path / "kv8.yaml"
    recipe.write_text("base: xnnpack_8da4w\ndescription: 8da4w with an int8 KV cache\nkv_cache: int8\n")
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "ptq.yaml",
        tiny_llama,
        corpus,
        run,
        model={"mode": "ptq", "recipe": str(recipe)},
        bench={"enabled": False},
    )
    r = run_cli("calibrate", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["pte"]["export_path"] == "fast" and summary["pte"]["kv_cache"] == "int8"
    assert summary["parity"]["passed"]
