"""PT2E QAT with min-max weight scales (``xnnpack_int4w_dynamic``, not learned): the converted program quantizes each
weight with the scale its trained fake-quant graph computes with, so the deployed model is the model QAT trained and
scored (issue 52).

The graph's weight fake-quants hold the scale of the weights they last observed: the last training forward, before
the optimizer's last step (or the step ``freeze_observers_after_n_steps`` froze them at). Deployment used to compute
min-max of the final weights instead. At 4 bits ([-8, 7], scale ``amax / 7.5``) that is no rounding detail: each
channel's negative extreme lies on the tie -7.5, which the slightest scale difference sends to -8 or -7; on
SmolLM2-135M (10 steps, lr 2e-5) the extreme of 57k of its 206k channels flipped between the two and the converted model
scored perplexity 21.27 against the fake-quant graph's 17.24."""

import pytest
import torch
from test_learned_scales import _build, _train

from qharness.run.from_lightning import trained as trained_of
from qharness.run.trained import deploy_graph
from qharness.upstream import imports

RECIPE = "xnnpack_int4w_dynamic"


def fake_quantized_weights(graph: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """``{weight: weight as the eval-mode graph fake-quantizes it}`` for every weight fake-quant of a QAT graph."""
    modules = dict(graph.named_modules())
    out = {}
    with torch.no_grad():
        for node in graph.graph.nodes:
            fq = modules.get(node.target) if node.op == "call_module" else None
            if isinstance(fq, imports.pt2e().FakeQuantizeBase) and node.args[0].op == "get_attr":
                out[node.args[0].target] = fq(graph.get_parameter(node.args[0].target)).clone()
    return out


def deployed_weights(graph: torch.fx.GraphModule) -> list[torch.Tensor]:
    """The weights a converted graph dequantizes (``dequantize_per_channel`` of constant int weights)."""
    imports.quantized_decomposed_ops()
    out = []
    for n in graph.graph.nodes:
        if n.op == "call_function" and "dequantize_per_channel" in str(n.target) and n.args[0].op == "get_attr":
            q, s, zp = (getattr(graph, a.target) for a in n.args[:3])
            out.append(torch.ops.quantized_decomposed.dequantize_per_channel(q, s, zp, *n.args[3:]))
    return out


@pytest.mark.parametrize("freeze", [None, 1], ids=["observers-follow", "observers-frozen-at-step-1"])
def test_qat_deploys_the_weights_its_fake_quant_graph_computes_with(tiny_llama, freeze):
    m = _build(tiny_llama, RECIPE, freeze_observers_after_n_steps=freeze)
    _train(m, 3)  # lr 1e-2: the last step moves every weight, after the graph's scales were computed
    trained = trained_of(m)  # what a run hands to deployment (eval mode: the scales stay as trained)
    want = fake_quantized_weights(trained.fake_quant)
    assert len(want) == 15  # q/k/v/o + 3 MLP projections per layer, 2 layers, lm_head
    got = deployed_weights(deploy_graph(trained, torch.randint(0, 300, (1, 16)), 64))
    assert len(got) == len(want)
    differ = [k for k, w in want.items() if not any(g.shape == w.shape and torch.equal(g, w) for g in got)]
    assert not differ, f"the converted program quantizes {len(differ)} of {len(want)} weights otherwise: {differ[:3]}"
