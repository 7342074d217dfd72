"""Learned weight scales (LSQ, ``learn_scales: true``): trained by backpropagation, kept in checkpoints, and carried
into the converted program exactly (not min-max of the final weights); the ``.pte`` is gated against the trained
fake-quant model."""

import json

import pytest
import torch
from conftest import run_cli, write_config

from qharness.errors import UserError
from qharness.recipes.learned_scales import LearnedScaleFakeQuantize, use_learned_qparams
from qharness.training.module import QuantLM

RECIPE = "xnnpack_int4w_lsq"
W = "model.layers.0.self_attn.q_proj.weight"


class FakeTrainer:
    global_step, estimated_stepping_batches = 0, 100


def minmax_scale(w: torch.Tensor) -> torch.Tensor:
    """The per-channel symmetric int4 [-8, 7] scale a min-max observer computes: amax / 7.5."""
    return torch.maximum(w.abs().amax(1) / ((7 - (-8)) / 2), torch.tensor(2**-12))


def _build(model_dir, recipe=RECIPE, **hp):
    """A QAT QuantLM of ``recipe`` built for [2, 16] batches, in training mode, with a stand-in trainer."""
    m = QuantLM(checkpoint=str(model_dir), recipe=str(recipe), mode="qat", **hp)
    m.build(2, 16)
    m.trainer = FakeTrainer()
    m.to_train()
    return m


def _train(m, steps: int, lr: float = 1e-2):
    """``steps`` AdamW steps on random tokens (seeded), through the training hooks; returns the optimizer."""
    m.hparams.lr = lr
    opt = m.configure_optimizers()["optimizer"]
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 300, (2, 16), generator=g)
        m.on_train_batch_start((x, x), 0)
        loss = m.loss((x, x))
        opt.zero_grad()
        loss.backward()
        opt.step()
        m.trainer.global_step += 1
    return opt


@pytest.fixture(scope="module")
def trained(tiny_llama):
    """A learned-scale QAT graph: its scales at the start, then after 4 AdamW steps (lr 1e-2) and mode switches."""
    m = _build(tiny_llama)
    start = m.learned_qparams()
    opt = _train(m, 4)
    m.to_eval()  # what validation and deployment do: must not reset the scales to min-max
    m.to_train()
    m.to_eval()
    return m, start, opt


def test_scales_start_at_min_max_and_are_parameters_without_weight_decay(tiny_llama):
    m = _build(tiny_llama, weight_decay=0.1)
    fqs = [mod for mod in m.graph.modules() if isinstance(mod, LearnedScaleFakeQuantize)]
    assert len(fqs) == 15  # q/k/v/o + 3 MLP projections per layer, 2 layers, lm_head
    q = m.learned_qparams()
    torch.testing.assert_close(q[W][0], minmax_scale(m.trained_weights()[W]))
    scales = {id(fq.scale) for fq in fqs}
    assert all(fq.scale.requires_grad and not fq.zero_point.requires_grad for fq in fqs)
    groups = m.configure_optimizers()["optimizer"].param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert groups[0]["weight_decay"] == 0.1 and not scales & decayed
    assert scales <= {id(p) for g in groups for p in g["params"]}  # trained, without decay
    assert not any("activation_post_process" in k for k in m.trained_weights())  # scales are no model weights
    m.load_into(m.load_fp()[0])  # raises on names the HF model lacks


@pytest.mark.fast
def test_scales_train_and_mode_switches_keep_them(trained):
    m, start, _ = trained
    now = m.learned_qparams()
    moved = [k for k in now if not torch.equal(now[k][0], start[k][0])]
    assert moved == list(now)  # every scale got a gradient and moved
    assert all(not zp.any() for _, zp in now.values())  # symmetric: zero point stays 0
    w = m.trained_weights()[W]
    assert (now[W][0] - minmax_scale(w)).abs().max() > 1e-4  # learned, not min-max of the final weights
    fq = next(mod for mod in m.graph.modules() if isinstance(mod, LearnedScaleFakeQuantize))
    assert fq.observer_enabled.item() == 0 and fq.learning_enabled.item() == 1


def _dequant_scales(graph) -> list[torch.Tensor]:
    """The per-channel scales of the converted graph's weight dequantizations."""
    out = []
    for n in graph.graph.nodes:
        if n.op == "call_function" and "dequantize_per_channel" in str(n.target) and n.args[0].op == "get_attr":
            out.append(getattr(graph, n.args[1].target))
    return out


def test_the_converted_program_uses_the_trained_scales_exactly(trained):
    from qharness.checks.parity import learned_scales_carried
    from qharness.deploy.lower import quantize_for_deploy

    m, _, _ = trained
    q = m.learned_qparams()
    q = {k: (s * 0.9 if k == W else s, zp) for k, (s, zp) in q.items()}  # far from min-max, to be sure
    fp, _ = m.load_fp()
    m.load_into(fp)
    final_minmax = minmax_scale(m.trained_weights()[W])

    def calibrate(g):
        g(torch.zeros(1, 8, dtype=torch.long), torch.tensor([0]))

    converted = quantize_for_deploy(fp, m.recipe, 64, calibrate, weight_qparams=q)
    scales = _dequant_scales(converted)
    assert len(scales) == len(q) == 15
    for name, (s, _) in q.items():  # each trained scale appears, bit for bit
        assert any(t.shape == s.shape and torch.equal(t, s) for t in scales), name
    assert not any(t.shape == final_minmax.shape and torch.allclose(t, final_minmax) for t in scales)
    assert learned_scales_carried(converted, q) == {"weights": 15, "exact": 15}  # the pipeline's own check
    # without weight_qparams deployment computes min-max of the final weights: the case the test tells apart
    plain = quantize_for_deploy(m.load_fp()[0], m.recipe, 64, calibrate)
    assert not any(torch.equal(t, q[W][0]) for t in _dequant_scales(plain))
    assert learned_scales_carried(plain, q) == {"weights": 15, "exact": 0}


@pytest.mark.fast
def test_learned_scales_must_cover_the_deploy_graph_exactly(trained):
    from qharness.deploy.lower import export_deploy
    from qharness.upstream import imports

    m, _, _ = trained
    fp, _ = m.load_fp()
    prepared = imports.pt2e().prepare_pt2e(export_deploy(fp, 64)[0].module(), m.recipe.make_quantizer(is_qat=False))
    q = m.learned_qparams()
    with pytest.raises(RuntimeError, match="unused .*nope"):
        use_learned_qparams(prepared, fp, {**q, "nope.weight": q[W]})
    with pytest.raises(RuntimeError, match="no scale for .*q_proj"):
        use_learned_qparams(prepared, fp, {k: v for k, v in q.items() if k != W})


def test_a_checkpoint_restores_the_learned_scales(tiny_llama, trained):
    m, _, _ = trained
    fresh = _build(tiny_llama)
    before = fresh.learned_qparams()
    fresh.load_state_dict(m.state_dict())  # what resuming from a checkpoint does, after configure_model's build
    after, want = fresh.learned_qparams(), m.learned_qparams()
    assert all(torch.equal(after[k][0], want[k][0]) for k in want)
    assert not torch.equal(before[W][0], want[W][0])


def test_learning_restarts_from_min_max_when_fake_quant_turns_on(tiny_llama):
    m = _build(tiny_llama, fake_quant_after_n_steps=2)
    start = m.learned_qparams()[W][0]
    opt = _train(m, 2, lr=5e-2)  # FP steps: weights move, scales get no gradient
    scale_param = next(mod.scale for mod in m.graph.modules() if isinstance(mod, LearnedScaleFakeQuantize))
    m.on_train_batch_start(None, 0)  # step 2: fake quantization on
    now = m.learned_qparams()[W][0]
    torch.testing.assert_close(now, minmax_scale(m.trained_weights()[W]))
    assert not torch.equal(now, start)
    assert any(scale_param is p for g in opt.param_groups for p in g["params"])  # updated in place: still trained


@pytest.mark.fast
def test_ptq_with_a_learned_scale_recipe_is_refused(tiny_llama, tmp_path):
    recipe = tmp_path / "lsq_any.yaml"
    recipe.write_text(f"base: {RECIPE}\nmodes: [qat, ptq]\n")
    with pytest.raises(UserError, match="learns its weight scales.*needs training"):
        QuantLM(checkpoint=str(tiny_llama), recipe=str(recipe), mode="ptq")


@pytest.mark.fast
def test_compare_blocks_and_the_fake_quant_gate():
    from qharness.checks.parity import compare_blocks, gate
    from qharness.config import ParityConfig

    torch.manual_seed(0)
    table = torch.randn(50, 7) * 3

    def ref(x):  # a no-cache model: logits[B, T, vocab]
        return table[x]

    def pte(tokens, start):  # a cache model with the same logits, slightly off
        return table[tokens] + 0.01

    x = torch.randint(0, 50, (2, 5))
    f = compare_blocks(pte, ref, x, tie_margin=0.0)
    assert f["positions"] == 10 and f["argmax_agreement"] == 1.0 and abs(f["max_abs_diff"] - 0.01) < 1e-5
    flipped = compare_blocks(lambda t, s: -table[t], ref, x)
    assert flipped["argmax_agreement"] < 0.5
    reasons = gate({**flipped, "ppl_rel_diff": 0.1}, ParityConfig(), prefix="fake_quant_")
    assert len(reasons) == 2
    assert "parity.fake_quant_max_ppl_rel_diff" in reasons[0] and "parity.fake_quant_min_argmax_agreement" in reasons[1]
    assert gate({**f, "ppl_rel_diff": 0.03}, ParityConfig(), prefix="fake_quant_") == []  # looser than 0.02


@pytest.mark.slow
@pytest.mark.parametrize("recipe,q_scales", [(RECIPE, 64), ("xnnpack_8da4w_lsq", 64 * 2)])
def test_fit_with_learned_scales_passes_parity_against_its_fake_quant_graph(
    tmp_path, tiny_llama, corpus, recipe, q_scales
):
    """``qharness fit`` with an LSQ recipe (PT2E; torchao source-level), resumed from its step-3 checkpoint: the
    ``.pte`` passes the gate against the converted model and against the trained fake-quant graph.
    ``q_scales``: how many scales a q_proj weight has (per channel; per group of 32)."""
    run = tmp_path / "run"
    cfg = write_config(tmp_path / "r.yaml", tiny_llama, corpus, run, model={"recipe": recipe}, bench={"enabled": False})
    first = run_cli("fit", cfg, "--trainer.max_steps", "3", "--deploy.enabled", "false")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert any(k.endswith(".scale") and v.numel() == q_scales for k, v in ckpt.items())  # the learned scales are saved
    r = run_cli("fit", cfg, "--ckpt_path", "last")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Restoring states from the checkpoint" in r.stdout + r.stderr
    summary = json.loads((run / "summary.json").read_text())
    p = summary["parity"]
    assert p["passed"] and p["fake_quant"]["gated"] and p["fake_quant"]["passed"], p
    assert p["learned_scales"] == {"weights": 15, "exact": 15}
    assert p["fake_quant"]["positions"] == 4 * 32  # one batch of validation blocks, every position
    assert ".pte vs trained fake-quant PASSED" in r.stdout
