"""What a GPU trainer does to a model built on CPU, reproduced on CPU with the ``meta`` device.

Lightning builds the model in ``configure_model`` inside ``torch.device(<the GPU>)``: a tensor made without a device
lands there (a CPU generator then fails, "Expected a 'cuda' device type for generator"); and it moves the trained
module back with ``.to()``, which leaves plain tensor attributes behind (torchao's range-learning zero points: "found
at least two devices, cuda:0 and cpu"). Both stopped SmolLM2's ``xnnpack_8da4w_zp_lsq`` QAT on an H200 before these
fixes. Its move back also hides, from the state's devices, that an exported graph was built on the GPU (the last
test). Here ``meta`` stands in for the GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.fast


def test_qat_loads_and_rounds_on_cpu_inside_a_trainers_device_context(tiny_llama, monkeypatch):
    """``QuantLM.build`` under another default device: the model loads and ``qat_start`` rounds it on CPU (smoothing
    draws its probe there too); only ``prepare_for_training`` sees the trainer's device."""
    from qharness.training import module as module_mod

    seen = {}

    def prepare(model, *args, **kwargs):
        seen["devices"] = {p.device.type for p in model.parameters()}
        seen["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        return torch.nn.Linear(1, 1)

    monkeypatch.setattr(module_mod, "prepare_for_training", prepare)
    m = module_mod.QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w_zp_lsq", mode="qat")
    blocks = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        m.build(2, 32, device="cpu", warm_start=blocks)
    assert seen == {"devices": {"cpu"}, "finite": True}


def test_smoothing_lora_and_linear_checks_draw_on_cpu_inside_another_device_context(tiny_llama):
    from transformers import AutoModelForCausalLM

    from qharness.recipes.smoothing import gated_mlps
    from qharness.schema.model import LoRA
    from qharness.sources.normalize import _computes_linear
    from qharness.training.lora import add_adapters

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    names = {n for n, _ in model.named_modules()}
    q = model.model.layers[0].self_attn.q_proj
    with torch.device("meta"):
        assert len(gated_mlps(model, names)) == model.config.num_hidden_layers
        assert _computes_linear(q, q.weight, q.bias)
        added = add_adapters(model, LoRA(rank=2, alpha=4, targets=["q_proj"]))
    assert added and all(p.device.type == "cpu" for p in model.parameters())


def _range_learning_quantizer():
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer

    config = IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True, is_dynamic=False, range_learning=True)
    fq = IntxFakeQuantizer(config)
    fq._initialized = True
    fq(torch.randn(8, 64, generator=torch.Generator().manual_seed(0)))  # scales from min-max, then parameters
    return fq


def test_upstream_range_learning_zero_point_is_still_a_plain_tensor_that_to_leaves_behind():
    """torchao 0.18: a symmetric range-learning ``IntxFakeQuantizer`` holds its scale as a parameter and its zero
    point as a plain attribute, so ``.to()`` moves one and not the other. When this fails, upstream registers the zero
    point: ``plain_tensors_to`` in ``QuantLM.graph_to_cpu`` (qharness/training/weights.py) may go."""
    fq = _range_learning_quantizer()
    assert isinstance(fq.scale, torch.nn.Parameter)
    assert "zero_point" not in fq._buffers and "zero_point" not in fq._parameters
    fq.to("meta")
    assert fq.scale.device.type == "meta" and fq.zero_point.device.type == "cpu"


def test_plain_tensors_follow_a_module_moved_with_to():
    from qharness.training.weights import plain_tensors_to

    fq = _range_learning_quantizer()
    graph = torch.nn.Sequential(torch.nn.Linear(64, 8), fq).to("meta")
    assert plain_tensors_to(graph, "meta") == 1
    assert {t.device.type for t in (fq.scale, fq.zero_point, graph[0].weight)} == {"meta"}
    assert plain_tensors_to(graph, "meta") == 0  # nothing left behind


@pytest.mark.parametrize("recipe, rebuilt", [("xnnpack_int8_dynamic", True), ("xnnpack_8da4w", False)])
def test_a_graph_exported_on_another_device_is_rebuilt_after_the_trainer_moved_it(tiny_llama, recipe, rebuilt):
    """Lightning's teardown moves the trained module to CPU before deployment, so its state no longer tells where it
    trained: an exported graph (PT2E), whose devices are baked in, is exported again on CPU with the trained state;
    eager modules (torchao's source-level recipes) are only moved. ``meta`` stands in for the GPU it was built on."""
    from qharness.training.module import QuantLM

    m = QuantLM(checkpoint=str(tiny_llama), recipe=recipe, mode="qat")
    m.build(2, 16)
    with torch.no_grad():
        next(p for p in m.graph.parameters() if p.is_floating_point()).add_(0.25)  # "trained"
    before, graph = {k: v.clone() for k, v in m.graph.state_dict().items()}, m.graph
    m._built_on = torch.device("meta")  # as if exported on a GPU, then moved back by the trainer
    m.graph_to_cpu()
    if rebuilt:
        assert m.graph is not graph and m._built_on.type == "cpu"
    else:
        assert m.graph is graph
    after = m.graph.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
