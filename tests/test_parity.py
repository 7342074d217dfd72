"""The parity gate judges numerics, not ties: near ties (flat logits) cannot fail it, real drift does."""

import pytest
import torch

from qharness.checks.parity import compare_decoding, gate
from qharness.config import ParityConfig

VOCAB, LENGTH = 64, 48


class Table:
    """A stateless stand-in for a deploy model: ``logits[pos] = by_pos[pos] + by_token[token]`` for every fed position."""

    def __init__(self, by_pos: torch.Tensor, by_token: torch.Tensor):
        self.by_pos, self.by_token = by_pos, by_token

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        n = tokens.shape[1]
        return (self.by_pos[start : start + n] + self.by_token[tokens[0]])[None]


def _models(scale: float, error: float, seed: int = 0):
    """A reference with logits of spread ``scale`` and a copy whose every logit is off by up to ``error``."""
    g = torch.Generator().manual_seed(seed)
    by_pos, by_token = scale * torch.randn(LENGTH, VOCAB, generator=g), scale * torch.randn(VOCAB, VOCAB, generator=g)
    noise = error * (2 * torch.rand(LENGTH, VOCAB, generator=g) - 1)
    return Table(by_pos + noise, by_token), Table(by_pos, by_token)


PROMPTS = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))


def _figures(pte, ref, margin):
    figures = compare_decoding(pte, ref, PROMPTS, decode_steps=8, tie_margin=margin)
    return {**figures, "ppl_rel_diff": 0.0}


@pytest.mark.fast
def test_flat_logits_with_tiny_error_pass_though_many_tokens_flip():
    pte, ref = _models(scale=0.01, error=0.04)  # random init: top-2 gaps far below the error
    figures = _figures(pte, ref, ParityConfig().tie_margin)
    assert figures["positions"] == 4 * (16 + 8)
    assert figures["argmax_agreement"] < 0.9  # the old criterion failed such a .pte
    assert figures["near_ties"] > 0.9 * figures["positions"]
    assert figures["max_abs_diff"] <= 0.04
    assert gate(figures, ParityConfig()) == []


@pytest.mark.fast
def test_real_drift_fails_on_the_decided_positions():
    pte, ref = _models(scale=2.0, error=3.0)  # errors as large as the logits' spread
    figures = _figures(pte, ref, ParityConfig().tie_margin)
    assert figures["near_ties"] < 0.2 * figures["positions"]
    assert figures["argmax_agreement_decided"] < 0.9
    reasons = gate(figures, ParityConfig())
    assert len(reasons) == 1 and "parity.min_argmax_agreement" in reasons[0] and "parity.tie_margin=0.2" in reasons[0]


@pytest.mark.fast
def test_shuffled_vocabulary_fails():
    _, ref = _models(scale=2.0, error=0.0)
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))
    shuffled = Table(ref.by_pos[:, perm], ref.by_token[:, perm])
    figures = _figures(shuffled, ref, ParityConfig().tie_margin)
    assert figures["argmax_agreement_decided"] < 0.5
    assert gate(figures, ParityConfig()) != []


@pytest.mark.fast
def test_small_error_on_spread_logits_passes_and_agrees_everywhere_decided():
    pte, ref = _models(scale=2.0, error=0.09)  # below half the margin: no decided position can flip
    figures = _figures(pte, ref, 0.2)
    assert figures["argmax_agreement_decided"] == 1.0
    assert gate(figures, ParityConfig()) == []


@pytest.mark.fast
def test_near_ties_are_the_positions_within_the_margin():
    by_pos = torch.zeros(LENGTH, VOCAB)
    by_pos[:, 0] = torch.linspace(0.0, 0.94, LENGTH)  # token 0 leads by 0, 0.02, ..., 0.94
    ref = Table(by_pos, torch.zeros(VOCAB, VOCAB))
    figures = compare_decoding(ref, ref, torch.zeros(1, LENGTH, dtype=torch.long), decode_steps=0, tie_margin=0.3)
    gaps = torch.linspace(0.0, 0.94, LENGTH)
    assert figures["near_ties"] == int((gaps <= 0.3).sum()) and figures["argmax_agreement_decided"] == 1.0


@pytest.mark.fast
def test_all_near_ties_leave_the_judgment_to_perplexity():
    pte, ref = _models(scale=0.001, error=0.01)
    figures = _figures(pte, ref, 0.2)
    assert figures["near_ties"] == figures["positions"] and figures["argmax_agreement_decided"] is None
    assert gate(figures, ParityConfig()) == []
    assert "parity.max_ppl_rel_diff" in gate({**figures, "ppl_rel_diff": 0.5}, ParityConfig())[0]


@pytest.mark.fast
@pytest.mark.parametrize("figures", [{"ppl_rel_diff": 0.0, "argmax_agreement": 0.5, "max_abs_diff": 0.1}])
def test_figures_without_near_ties_are_judged_on_every_position(figures):
    assert "argmax agreement 0.500 < parity.min_argmax_agreement=0.9" in gate(figures, ParityConfig())[0]


@pytest.mark.fast
def test_the_rounding_twin_moves_every_result_one_unit_in_the_last_place():
    """The gate's noise floor: the twin computes the same program with each op's result one ulp up or down, both
    directions taken, and an infinite mask still masks."""
    from qharness.checks.parity import rounding_twin

    class Net(torch.nn.Module):
        def forward(self, x):
            scores = (x @ x.T).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
            return (scores * 0.25).softmax(-1)

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    graph = torch.fx.symbolic_trace(Net())
    twin = rounding_twin(graph)
    a, b = graph(x), twin(x)
    assert torch.isfinite(b).all() and not torch.equal(a, b)
    assert ((b - a).abs() <= 8 * torch.finfo(torch.float32).eps * a.abs().clamp(min=1)).all()
    assert (a.triu(1) == 0).all() and (b.triu(1) == 0).all()  # masked scores softmax to zero in both
    moved = twin.get_submodule("_qharness_round_other_way")(torch.ones(4096))
    assert (moved == torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))).sum() > 1000  # one ulp up
    assert (moved == torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))).sum() > 1000  # one ulp down
    assert ((moved != 1) & (moved.sub(1).abs() <= torch.finfo(torch.float32).eps)).all()
    for dtype in (torch.float64, torch.bfloat16):  # e.g. a dynamic quantizer's float64 scale computation
        x = torch.ones(64, dtype=dtype)
        out = twin.get_submodule("_qharness_round_other_way")(x)
        assert out.dtype == dtype and ((out != 1) & (out.sub(1).abs() <= torch.finfo(dtype).eps)).all()


@pytest.mark.fast
def test_a_reference_that_rounding_alone_scrambles_vouches_for_nothing():
    """SmolLM2 with static int8 activations: the converted model's rounding twin kept 0.008 of its confident tokens,
    the .pte 0.04; the KL and agreement checks, relative to that noise, would pass any program of it."""
    noise = {"kl": 12.0, "argmax_agreement_decided": 0.008, "ppl_bound": 4.8}
    figures = {
        "max_abs_diff": 32.3, "argmax_agreement": 0.03, "positions": 160, "tie_margin": 0.2, "near_ties": 34,
        "argmax_agreement_decided": 0.04, "non_finite_positions": 0, "kl": 9.6, "ppl_rel_diff": 0.19, "noise": noise,
    }  # fmt: skip
    reasons = gate(figures, ParityConfig())
    assert len(reasons) == 1 and reasons[0].startswith("the converted model itself is unstable"), reasons
    stable = {**figures, "noise": {**noise, "argmax_agreement_decided": 0.95}, "argmax_agreement_decided": 0.96}
    assert gate(stable, ParityConfig()) == []  # the same figures with a stable reference: the KL is within the noise


@pytest.mark.fast
def test_a_failed_gate_on_a_model_the_recipe_breaks_says_so_first():
    """SmolLM2 with per-channel 3-bit weights (QAT): FP 7.52, the converted model 21,957, the .pte 23,040; its
    rounding twin keeps 0.630 of its confident tokens and the .pte 0.377. The gate fails, and its reasons lead with
    what the recipe did to the model rather than with an agreement figure that decides little."""
    from qharness.checks.parity import recipe_breaks_model

    why = recipe_breaks_model(7.52, 21956.7, 0.630)
    assert why.startswith("the recipe breaks this model: its converted model's perplexity is 22,000 against FP's 7.52")
    assert "(x2,920)" in why and "rounding alone changes 37% of its confident next tokens" in why
    assert "more bits, or QAT" in why
    assert recipe_breaks_model(7.52, 8.1, 0.95) is None  # a working recipe: the gate's own reasons stand alone
    assert recipe_breaks_model(7.52, 1e8, 0.3) is None  # the unstable-reference reason already says it
    assert recipe_breaks_model(7.52, float("nan"), None) is None  # NaN has its own reason


@pytest.mark.fast
def test_the_trained_model_check_allows_what_rounding_alone_costs_the_model():
    """QAT's ``.pte``-vs-fake-quant check on a model that rounding alone moves far (SmolLM2 with per-channel 3-bit
    weights, QAT: the converted model's twin keeps 0.621 of its confident tokens, the ``.pte`` agrees with the
    fake-quant model on 0.664 of 845): its floor comes down as the main gate's does; a model rounding leaves alone
    keeps the 0.8 floor."""
    figures = {"argmax_agreement": 0.66, "argmax_agreement_decided": 0.664, "positions": 1024, "near_ties": 179}
    figures |= {"tie_margin": 0.2}
    figures |= {"ppl_rel_diff": 0.0184, "non_finite_positions": 0}
    cfg = ParityConfig()
    (why,) = gate(figures, cfg, prefix="fake_quant_")
    assert why.startswith("argmax agreement 0.664 < parity.fake_quant_min_argmax_agreement=0.8 over the 845 of 1024")
    assert gate(figures, cfg, prefix="fake_quant_", twin_agreement=0.621) == []
    (why,) = gate(figures, cfg, prefix="fake_quant_", twin_agreement=0.99)
    assert "< parity.fake_quant_min_argmax_agreement=0.8" in why
    (why,) = gate({**figures, "argmax_agreement_decided": 0.5}, cfg, prefix="fake_quant_", twin_agreement=0.621)
    assert "less what rounding alone costs this model: its rounding twin agrees 0.621" in why


@pytest.mark.fast
def test_a_refusal_by_the_trained_model_check_alone_says_so():
    from qharness.run.pipeline import PARITY_FIX, TRAINED_FIX, parity_fix

    assert parity_fix([".pte vs trained fake-quant: argmax agreement 0.5 < 0.8"]) == TRAINED_FIX
    assert "not what QAT trained" in TRAINED_FIX and "--ckpt_path last" in TRAINED_FIX
    both = ["KL divergence from the converted model 2 > ...", ".pte vs trained fake-quant: perplexity differs"]
    assert parity_fix(both) == PARITY_FIX


@pytest.mark.fast
def test_a_refusal_of_a_model_the_recipe_breaks_points_at_the_recipe_not_the_program():
    """SmolLM2 with 2-bit weights: the gate calls the converted model uncheckable; the fix must not say the program
    computes something else, but that the recipe ruined the model."""
    from qharness.run.pipeline import BROKEN_FIX, parity_fix

    unstable = "the converted model itself is unstable: with every result rounded the other way it keeps only 0.358"
    broken = "the recipe breaks this model: its converted model's perplexity is 22,000 against FP's 7.52 (x2,920)"
    for reasons in (
        [unstable],
        [broken, "argmax agreement 0.305 < 0.472 ..."],
        [broken, ".pte vs trained fake-quant: x"],
    ):
        assert parity_fix(reasons) == BROKEN_FIX
    assert "does not compute" not in BROKEN_FIX and "more bits, or QAT" in BROKEN_FIX


@pytest.mark.fast
def test_score_jointly_scores_each_model_as_alone_and_its_kl_from_the_reference_over_every_position():
    import torch.nn.functional as F

    from qharness.checks.parity import score_deployed, score_jointly
    from qharness.sources.example_cache import IGNORE

    pte, ref = _models(scale=2.0, error=0.5)
    x = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(3))
    y[1, :3] = IGNORE  # chat data: prompt positions unscored (their logits are still compared)
    out = score_jointly(ref, {"pte": pte, "itself": ref}, x, y)
    for name, model in (("reference", ref), ("pte", pte)):
        alone = score_deployed(model, x, y)
        assert out[name]["loss"] == pytest.approx(alone["loss"])
        assert out[name]["block_losses"] == pytest.approx(alone["block_losses"])

    def logp(model, block):
        return model(block[None], 0)[0].double().log_softmax(-1)

    kl = [F.kl_div(logp(pte, b), logp(ref, b), log_target=True, reduction="none").sum(-1) for b in x]
    want = torch.cat(kl)
    assert out["pte"]["kl"] == pytest.approx(want.mean().item()) and out["pte"]["kl"] > 0.01
    assert out["pte"]["kl_positions"] == x.numel() and out["itself"]["kl"] == 0.0


@pytest.mark.fast
def test_the_gate_scores_more_rounding_twins_while_few_positions_moved(monkeypatch):
    """``more_twins``: seeds 1, 2, ... until ``TWINS_MOVED`` positions moved in all twins, at most ``MAX_TWINS``; the
    noise the gate judges by (``pool_kl``) is the mean over every twin's positions and the decoding's."""
    from types import SimpleNamespace

    import qharness.run.gate as gate_mod

    seeds = []
    monkeypatch.setattr(gate_mod, "rounding_twin", lambda scorer, seed: seeds.append(seed) or seed)
    moved = {1: 30, 2: 5, 3: 40}  # the first twin moved 30: 100 reached by the third more
    monkeypatch.setattr(
        gate_mod,
        "score_jointly",
        lambda ref, others, x, y: {
            "twin": {
                "kl": 1e-5 * moved[others["twin"].seed],
                "kl_positions": 64,
                "kl_moved": moved[others["twin"].seed],
            }
        },
    )
    monkeypatch.setattr(gate_mod, "step_of", lambda seed: SimpleNamespace(seed=seed))
    first = {"kl": 3e-4, "kl_positions": 64, "kl_moved": 30}
    data = SimpleNamespace(x=None, y=None)
    more = gate_mod.more_twins(None, None, first, data)
    assert seeds == [1, 2, 3] and [t["kl_moved"] for t in more] == [30, 5, 40]
    figures = {"kl": 1e-3, "positions": 11}
    gate_mod.pool_kl(figures, [first, *more])
    assert figures["kl_positions"] == 11 + 4 * 64
    assert figures["kl"] == pytest.approx((1e-3 * 11 + 64 * (3e-4 + 3e-4 + 5e-5 + 4e-4)) / (11 + 256))
    seeds.clear()
    moved.update({i: 0 for i in range(1, 8)})  # nothing moves: eight twins in all, then stop
    assert len(gate_mod.more_twins(None, None, {**first, "kl_moved": 0}, data)) == 7 and seeds == list(range(1, 8))
