"""One graph per decoder layer (``model.layerwise``): the same numerics as the whole-model graph, the same trained
weights and learned scales by HF name, the units FSDP shards, activation checkpointing, and the errors that say
when it is needed. The two-process FSDP run through the CLI is in test_distributed.py (slow)."""

import pytest
import torch
from conftest import run_cli, write_config

from qharness.training.layerwise import LayerGraph, hf_name, layer_graphs, set_checkpointing
from qharness.training.module import QuantLM
from qharness.training.sharding import shardable_units


def built(tiny_llama, recipe: str, layerwise: bool, **kw) -> QuantLM:
    m = QuantLM(checkpoint=str(tiny_llama), recipe=recipe, mode="qat", layerwise=layerwise, **kw)
    m.build(2, 16)
    m.to_train()
    return m


@pytest.mark.parametrize("recipe", ["xnnpack_int8_dynamic", pytest.param("xnnpack_int4w_lsq", marks=pytest.mark.slow)])
def test_layerwise_graph_computes_what_the_whole_model_graph_computes(tiny_llama, recipe):
    whole, layers = built(tiny_llama, recipe, False), built(tiny_llama, recipe, True)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b = whole.graph(x), layers.graph(x)
    assert torch.equal(a, b)  # the same fake quantization of every linear layer, lm_head included
    a.logsumexp(-1).sum().backward()
    b.logsumexp(-1).sum().backward()
    grads = {k: p.grad for k, p in whole.graph.named_parameters()}
    for k, p in layers.graph.named_parameters():
        name = hf_name(k)
        if name in grads:  # a tied weight is named once per graph, maybe under its other name
            assert torch.allclose(p.grad, grads[name], atol=1e-6), name
    assert whole.trained_weights().keys() | {"model.embed_tokens.weight"} >= layers.trained_weights().keys()
    assert len(layer_graphs(layers.graph)) == 3  # two decoder layers and the (tied) output head
    if recipe.endswith("lsq"):
        w, lw = whole.learned_qparams(), layers.learned_qparams()
        assert w.keys() == lw.keys() and "model.layers.1.mlp.down_proj.weight" in lw
        assert all(torch.equal(w[k][0], lw[k][0]) for k in w)


def test_trained_weights_of_a_layerwise_graph_load_into_the_hf_model(tiny_llama):
    from qharness.sources.models import load_model_and_tokenizer

    m = built(tiny_llama, "xnnpack_int8_dynamic", True)
    with torch.no_grad():
        m.graph.model.model.layers[1].qgraph.layer.mlp.up_proj.weight.add_(1.0)
    hf, _ = load_model_and_tokenizer(str(tiny_llama))
    before = hf.model.layers[1].mlp.up_proj.weight.clone()
    m.load_into(hf)
    assert torch.equal(hf.model.layers[1].mlp.up_proj.weight, before + 1.0)


def test_fsdp_units_are_the_decoder_layers_and_a_tied_head_stays_in_the_root(tiny_llama):
    m = built(tiny_llama, "xnnpack_int8_dynamic", True)
    assert [n for n, _ in shardable_units(m.graph)] == ["model.model.layers.0", "model.model.layers.1"]
    eager = built(tiny_llama, "xnnpack_8da4w", False)  # torchao source-level: the eager decoder layers
    assert [n for n, _ in shardable_units(eager.graph)] == ["model.model.layers.0", "model.model.layers.1"]


def test_activation_checkpointing_gives_the_same_gradients(tiny_llama):
    plain = built(tiny_llama, "xnnpack_int4w_dynamic", True)
    ac = built(tiny_llama, "xnnpack_int4w_dynamic", True, activation_checkpointing=True)
    assert all(g.checkpoint for _, g in layer_graphs(ac.graph)) and not any(
        g.checkpoint for _, g in layer_graphs(plain.graph)
    )
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (plain, ac):
        m.graph(x).logsumexp(-1).sum().backward()
    for (k, p), (_, q) in zip(plain.graph.named_parameters(), ac.graph.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), k
    assert set_checkpointing(ac.graph, False) == 3 and not any(g.checkpoint for _, g in layer_graphs(ac.graph))


def test_a_layer_graph_refuses_a_call_unlike_its_export(tiny_llama):
    m = built(tiny_llama, "xnnpack_int8_dynamic", True)
    layer = m.graph.model.model.layers[0]
    assert isinstance(layer, LayerGraph)
    with pytest.raises(RuntimeError, match="unlike it was exported"):
        layer(torch.zeros(2, 16, 64), use_cache=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--trainer.strategy", "fsdp_layers"], "trainer.strategy fsdp_layers shards per decoder layer"),
        (["--model.activation_checkpointing", "true"], "model.activation_checkpointing recomputes decoder layers"),
    ],
)
def test_sharding_or_checkpointing_a_whole_model_graph_is_a_clear_error(
    tmp_path, tiny_llama, corpus, overrides, message
):
    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, tmp_path / "run")
    r = run_cli("fit", cfg, *overrides)
    assert r.returncode == 2, r.stderr[-2000:]
    assert message in r.stderr and "--model.layerwise true" in r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
