"""Unit tests of the stages on a tiny random Llama: export -> prepare -> train -> deploy numerics."""

import pytest
import torch

from qharness.sources.models import load_model_and_tokenizer
from qharness.training.module import QuantLM
from qharness.training.prepare import export_for_training


@pytest.fixture(scope="module")
def fp(tiny_llama):
    return load_model_and_tokenizer(str(tiny_llama))[0]


def _module(tiny_llama, batch=2, seq=16):
    m = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_int8_dynamic", mode="qat")
    m.build(batch, seq)
    return m


@pytest.mark.fast
def test_exported_training_graph_matches_eager(fp):
    x = torch.randint(0, fp.config.vocab_size, (2, 16))
    graph = export_for_training(fp, 2, 16)
    torch.testing.assert_close(graph(x), fp(input_ids=x).logits)


def test_qat_graph_trains(tiny_llama):
    m = _module(tiny_llama)
    m.to_train()
    x = torch.randint(0, 300, (2, 16))
    opt = torch.optim.AdamW(m.graph.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = m.loss((x, x))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_validation_does_not_move_weight_scales(tiny_llama):
    m = _module(tiny_llama)
    m.to_train()
    x = torch.randint(0, 300, (2, 16))
    m.loss((x, x))
    scales = {k: v.clone() for k, v in m.graph.state_dict().items() if k.endswith(".scale")}
    with torch.no_grad():  # perturb weights, then validate: frozen observers must keep the scales
        for p in m.graph.parameters():
            p.mul_(1.5)
    m.to_eval()
    m.loss((x, x))
    after = {k: v for k, v in m.graph.state_dict().items() if k.endswith(".scale")}
    static = [k for k in scales if scales[k].numel() > 1]  # per-channel weight scales
    assert static and all(torch.equal(scales[k], after[k]) for k in static)
    m.to_train()
    m.loss((x, x))
    moved = {k: v for k, v in m.graph.state_dict().items() if k.endswith(".scale")}
    assert any(not torch.equal(scales[k], moved[k]) for k in static)


def test_qat_weight_fake_quant_uses_the_deploy_scale(tiny_llama):
    """Numerics in one place: QAT weight scales equal convert_pt2e's per-channel amax/127."""
    m = _module(tiny_llama)
    m.to_train()
    x = torch.randint(0, 300, (2, 16))
    m.loss((x, x))
    sd = m.graph.state_dict()
    checked = 0
    for name, w in m.graph.named_parameters():
        if w.dim() != 2 or "embed" in name:
            continue
        amax = w.detach().abs().amax(dim=1)
        hits = [
            k
            for k, v in sd.items()
            if k.endswith(".scale") and v.shape == amax.shape and torch.allclose(v, amax / 127, rtol=1e-5)
        ]
        checked += bool(hits)
    assert checked >= 10  # q/k/v/o/gate/up/down of 2 layers + lm_head


def test_state_dict_round_trip_into_a_rebuilt_graph(tiny_llama):
    a = _module(tiny_llama)
    a.to_train()
    x = torch.randint(0, 300, (2, 16))
    opt = torch.optim.SGD(a.graph.parameters(), lr=0.1)
    a.loss((x, x)).backward()
    opt.step()
    b = _module(tiny_llama)
    b.load_state_dict(a.state_dict())
    a.to_eval(), b.to_eval()
    with torch.no_grad():
        torch.testing.assert_close(a.graph(x), b.graph(x), rtol=0, atol=0)


def test_trained_weights_go_back_into_the_hf_model(tiny_llama, fp):
    import copy

    m = _module(tiny_llama)
    with torch.no_grad():
        for p in m.graph.parameters():
            p.add_(0.01)
    hf = copy.deepcopy(fp)
    m.load_into(hf)
    graph_params = dict(m.graph.named_parameters(remove_duplicate=False))
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    fp_params = dict(fp.named_parameters(remove_duplicate=False))
    assert len(graph_params) >= len(dict(hf.named_parameters())) > 10
    for name, p in graph_params.items():
        assert torch.equal(p, hf_params[name[len("model.") :]]), name
        assert not torch.equal(p, fp_params[name[len("model.") :]]), name


@pytest.mark.fast
def test_a_rebuilt_graph_keeps_every_buffer_of_the_trained_state(tiny_llama):
    """``rebuild_on`` (a graph trained on another device re-exported on CPU for deployment) loads the whole trained
    state: observer buffers too. A state copied without its module versions reset the observers' ``eps`` (XNNPACK's
    2**-12) to float32's on load."""
    a = _module(tiny_llama)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    assert any(k.endswith(".eps") for k in before)
    a.rebuild_on("cpu")
    after = a.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]), k
