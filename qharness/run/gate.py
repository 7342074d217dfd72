"""The parity stage: the converted model and the ``.pte`` scored on the validation blocks, and the ``.pte``'s
decoding gated against the converted model's (and, QAT, against the trained fake-quant graph)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from qharness.checks.parity import (
    KL_FLOOR,
    compare_blocks,
    compare_decoding,
    fold_constants,
    gate,
    learned_scales_carried,
    ppl_noise_bound,
    recipe_breaks_model,
    rounding_twin,
    score_deployed,
    score_jointly,
)
from qharness.checks.stats import with_intervals
from qharness.config import ParityConfig
from qharness.deploy.fastpath.twin import all_logits_twin
from qharness.errors import UserError
from qharness.progress import stage
from qharness.run.stages import Lowered
from qharness.run.summary import Parity, Score, Timings, typed
from qharness.run.trained import HeldOut, Trained

log = logging.getLogger(__name__)
TRAINED_CHECK = ".pte vs trained fake-quant: "  # how the reasons of the trained-model check begin


@dataclass
class Checked:
    """What the checks hand the summary: every model's scores, the gate's figures and the reference (the converted
    graph with its constants folded, which lm-eval scores later)."""

    metrics: dict[str, Score]
    parity: Parity
    reference: torch.fx.GraphModule


def check_parity(
    trained: Trained, lowered: Lowered, data: HeldOut, cfg: ParityConfig, scores: dict[str, dict], timings: Timings
) -> Checked:
    """Score the converted model and (where the backend runs here) the ``.pte`` on the validation blocks, and gate
    the ``.pte`` against the converted model (``gate_pte``)."""
    t = time.perf_counter()
    reference = fold_constants(lowered.deployed)  # the same outputs, the weight math done once
    scorer = all_logits_twin(reference)  # the same weights and ops (and KV cache), every position's logits
    scores = dict(scores)
    if trained.recipe.runs_here:
        figures = gate_pte(trained, lowered, scorer, data, cfg, scores)  # scores the converted model beside the .pte
    else:
        reasons = score_converted(step_of(scorer), data, scores)
        figures = {
            "passed": False if reasons else None,
            "skipped": f"the {trained.recipe.backend} backend cannot run on this machine (recipe runs_here: false)",
            "reasons": reasons,
        }
        log.warning("parity gate skipped: %s", figures["skipped"])
    timings.parity_s = time.perf_counter() - t
    metrics = with_intervals(scores)  # every model scored on the same blocks: paired against FP
    return Checked(typed(dict[str, Score], metrics, "metrics"), typed(Parity, figures, "parity"), reference)


def gate_pte(
    trained: Trained,
    lowered: Lowered,
    scorer: torch.fx.GraphModule,
    data: HeldOut,
    cfg: ParityConfig,
    scores: dict[str, dict],
) -> dict:
    """The parity gate of a ``.pte`` that runs here: its scores and the converted model's (added to ``scores``), its
    logits on the validation blocks and its decoding against the converted model's, (QAT) against the trained
    fake-quant graph, and whether learned scales reached it exactly. ``scorer``: the converted model's every-position
    twin (``all_logits_twin``), its KV cache shared. The KL divergence is judged over the blocks' positions and the
    decoding's together, against the converted model's rounding twin's over the same positions."""
    from qharness.runtime.pte import PteModel

    # the reference takes a prompt's logits in one prefill, then one token at a time as the .pte decodes; the .pte's
    # own prompt logits come one token at a time (``block_logits``)
    ref = step_of(scorer)
    twin = step_of(rounding_twin(scorer))  # the same program, each result rounded the other way

    try:
        pte = PteModel(lowered.pending)
    except UserError as e:  # e.g. XNNPACK refuses a NaN scale: a program that does not run fails its gate
        reasons = score_converted(ref, data, scores)
        return {"passed": False, "reasons": reasons + [f"the .pte does not load in the ExecuTorch runtime: {e.what}"]}
    scored = score_jointly(
        ref,
        {"pte": pte, "twin": twin},
        data.x,
        data.y,
        desc="scoring the .pte, the converted model and its rounding twin",
    )
    converted, twin_score = scored["reference"], scored.pop("twin")
    twins = [twin_score]
    if scored["pte"]["kl"] > KL_FLOOR:  # (a program closer than that passes whatever the noise: fp32's, int8's)
        twins += more_twins(scorer, ref, twin_score, data)
    scores["converted"] = converted
    scores["pte"] = {k: v for k, v in scored["pte"].items() if not k.startswith("kl")}
    reasons = non_finite_scores(scores, "converted") + non_finite_scores(scores, "pte")  # NaN passes no gate
    prompts = data.x[: cfg.prompts, : cfg.prompt_len]
    figures = compare_decoding(
        pte,
        ref,
        prompts,
        cfg.decode_steps,
        desc="parity: .pte vs converted decoding",
        tie_margin=cfg.tie_margin,
        twin=twin,  # the converted model's own rounding noise, on the same positions
    )
    figures["ppl_rel_diff"] = abs(scores["pte"]["ppl"] - converted["ppl"]) / converted["ppl"]
    pool_kl(figures, [scored["pte"]])  # the blocks' positions and the decoding's: one KL each
    pool_kl(figures["noise"], twins)
    figures["noise"]["twins"] = len(twins)
    # the converted model's rounding twin on the same blocks: how far rounding alone moves its perplexity
    figures["noise"]["ppl_rel_diff"] = abs(twin_score["ppl"] - converted["ppl"]) / converted["ppl"]
    figures["noise"]["ppl_bound"] = ppl_noise_bound(converted["block_losses"], twin_score["block_losses"])
    reasons += gate(figures, cfg)
    twin_agrees = figures["noise"].get("argmax_agreement_decided")
    if reasons and "fp" in scores:
        broken = recipe_breaks_model(scores["fp"]["ppl"], converted["ppl"], twin_agrees)
        reasons = [broken] + reasons if broken else reasons
    if trained.fake_quant is not None:
        figures["fake_quant"] = against_fake_quant(trained, pte, data, scores, cfg, twin_agrees)
        reasons += [TRAINED_CHECK + r for r in figures["fake_quant"]["reasons"]]
    if trained.weight_qparams is not None:
        figures["learned_scales"] = carried = learned_scales_carried(lowered.deployed, trained.weight_qparams)
        if carried["exact"] != carried["weights"]:
            reasons.append(
                f"only {carried['exact']} of {carried['weights']} trained weight scales reached the program exactly"
            )
    figures["passed"] = not reasons
    figures["reasons"] = reasons
    return figures


TWINS_MOVED, MAX_TWINS = 100, 8  # rounding twins: more while fewer positions than this moved, up to this many


def more_twins(scorer: torch.fx.GraphModule, ref, first: dict, data: HeldOut) -> list[dict]:
    """The block figures (``score_jointly``'s) of the rounding twins of seeds 1, 2, ... scored after ``first`` (seed
    0's) while fewer than ``TWINS_MOVED`` positions moved (``kl_moved``) in all of them, ``MAX_TWINS`` in all. A large
    model moves at most positions under one twin; a tiny one moves where an int8 activation rounds the other way, at
    a few positions in a hundred, so one twin's KL counts rare events (eight twins of one tiny LFM2-MoE: 5e-8 to
    1.5e-5 nats/token over the same 64 positions) and the gate judges against their mean."""
    twins = [first]
    while sum(t["kl_moved"] for t in twins) < TWINS_MOVED and len(twins) < MAX_TWINS:
        twin = step_of(rounding_twin(scorer, seed=len(twins)))
        twins.append(score_jointly(ref, {"twin": twin}, data.x, data.y)["twin"])
    return twins[1:]


def pool_kl(figures: dict, blocks: list[dict]) -> None:
    """``figures["kl"]`` (``compare_decoding``'s, over its ``positions``) made the mean over those positions and every
    position of ``blocks`` (``score_jointly``'s figures: ``kl`` over ``kl_positions`` each, the same validation
    blocks for each of several rounding twins); ``figures["kl_positions"]``: how many."""
    n = figures["positions"] + sum(b["kl_positions"] for b in blocks)
    summed = figures["kl"] * figures["positions"] + sum(b["kl"] * b["kl_positions"] for b in blocks)
    figures["kl"] = summed / max(n, 1)
    figures["kl_positions"] = n


def step_of(graph: torch.fx.GraphModule):
    """``graph`` called as the ``.pte`` is: ``step(tokens[1, n], start) -> logits``."""
    return lambda tokens, start: graph(tokens, torch.tensor([start], dtype=torch.long))


def score_converted(ref, data: HeldOut, scores: dict[str, dict]) -> list[str]:
    """The converted model scored alone (into ``scores``; where no ``.pte`` is scored beside it), and the gate's
    reason if its loss is not finite: NaN passes no gate, run here or not."""
    scores["converted"] = score_deployed(ref, data.x, data.y, desc="scoring the converted model")
    return non_finite_scores(scores, "converted")


def non_finite_scores(metrics: dict, key: str) -> list[str]:
    """The gate's reason when model ``key``'s validation loss is NaN/inf (empty otherwise)."""
    names = {"converted": "the converted model", "pte": "the .pte"}
    loss = metrics[key]["loss"]
    return [] if math.isfinite(loss) else [f"{names[key]}'s validation loss is {loss} (stage: scoring {names[key]})"]


def against_fake_quant(
    trained: Trained, pte, data: HeldOut, metrics: dict, cfg: ParityConfig, twin_agreement: float | None = None
) -> dict:
    """The ``.pte`` against the trained fake-quant graph (QAT): ``compare_blocks`` over the first batch of validation
    blocks and the perplexity difference over all of them. Its verdict counts for every QAT run: QAT is worth only
    what its trained numerics are to the program that ships them (PT2E runs deploy the scales their graph trained
    with, learned or observed; source-level runs recompute the same min-max scales from the final weights).
    ``twin_agreement``: how many of the converted model's confident tokens its rounding twin keeps; on a model that
    rounding alone moves that far, the agreement floor is lowered alike (``checks.parity.gate``)."""
    with stage(".pte vs trained fake-quant"):
        figures = compare_blocks(pte, trained.fake_quant, data.x[: data.batch_size], tie_margin=cfg.tie_margin)
    ref = metrics["fake_quant"]["ppl"]
    figures["ppl_rel_diff"] = abs(metrics["pte"]["ppl"] - ref) / ref
    figures["reasons"] = gate(figures, cfg, prefix="fake_quant_", twin_agreement=twin_agreement)
    figures["passed"] = not figures["reasons"]
    return figures
