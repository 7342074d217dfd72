"""The ladder ``qharness ship`` climbs, as data: rungs from the cheapest to the costliest, each a batch of sweep run
entries (``sweep/spec.py``'s ``runs`` entries) with why it sits where it does, and what its programs can be
(``decide.Reach``) so a rung that cannot change the answer is skipped before it runs.

XNNPACK (``LADDERS["xnnpack"]``), in order:

1. ``int8_ptq``: int8 dynamic PTQ: a calibration pass, the least accuracy lost.
2. ``int4_ptq``: 4-bit weights, PTQ: rounding to nearest, HQQ scales, GPTQ, rotation + GPTQ (each seconds more than
   nearest; smaller than int8), the 8-bit output tensor stored once with a tied table (``xnnpack_8da4w_tied8``:
   SmolLM2-135M's 89 MB against 94; docs/benchmarks/real-model.md; an untied table at 4 bits), and that layout with zero points and weighted
   scales (``xnnpack_8da4w_zp``), and that program with the output projection's input rounded as two int8 rows
   (``xnnpack_8da4w_zp_split``: on SmolLM2 the 4-bit PTQ program that loses least, at Q4_0's size, its decode a few
   percent slower than ``_zp``'s, which a latency goal can prefer).
3. ``mixed_ptq``: per-layer mixed precision under the size budget (``qharness autotune``: a per-layer sensitivity
   table, then PTQ): only with ``--max_size_mb`` and while no candidate meets everything (it spends the budget on
   accuracy, it does not look for a smaller program); its smallest scheme (4-bit per channel) stores 8/9 of 4-bit
   g32's linear bytes, so a budget below 8/9 of the smallest measured candidate is out of its reach.
4. ``int4_qat``: 4-bit QAT distilled from the FP model: from GPTQ's weights with learned scales (what paid off in the
   quality benchmarks, docs/benchmarks/quality.md), ``xnnpack_8da4w_tied8`` from nearest rounding, and
   ``xnnpack_8da4w_zp_lsq`` from the zero-point program its PTQ sibling deploys, the scales kept where rounding put
   them (``scale_lr_ratio: 0``; learning them gained nothing on SmolLM2), and ``xnnpack_8da4w_zp_split_lsq``, the
   same with the split head input (on SmolLM2 the QAT that did best: docs/benchmarks/real-model.md): training, the
   costliest so far; each the same program size and speed as its PTQ
   sibling, only more accurate. An entry whose sibling shows it cannot change the answer (over a budget, or no
   smaller than a candidate that meets everything) is left out of the rung (``climb.prune``).
5. ``int3_ptq``, 6. ``int3_qat``: 3-bit weights, where the budgets demand them (no candidate at more bits fits the
   budgets). XNNPACK stores 2/3-bit values as int4, so on this backend they are 4-bit's size: these rungs then
   show it and stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from qharness.errors import UserError

DISTILL = {"model": {"distill": {"kl_weight": 1.0, "temperature": 1.0, "hard_loss": False}}}
KEEP_SCALES = {"model": {**DISTILL["model"], "scale_lr_ratio": 0.0}}  # QAT from rounding's scales, kept


@dataclass(frozen=True)
class Rung:
    """One rung: ``entries`` (sweep run entries, PTQ or QAT), ``why`` it sits here, ``bits`` of its weights (the
    fewer-bits rule), ``trains`` (QAT), ``siblings`` (QAT run name -> the PTQ run whose program it matches in size
    and speed), ``needs_size_budget`` (autotune), ``on_demand`` (run only when no candidate at more bits fits the
    budgets), ``mixes`` (its programs mix the measured ones' layers: never smaller than the smallest of them)."""

    name: str
    why: str
    entries: tuple[dict, ...] = ()
    bits: int = 8
    trains: bool = False
    siblings: dict[str, str] = field(default_factory=dict)
    needs_size_budget: bool = False
    on_demand: bool = False
    mixes: bool = False
    mix_floor: float = 1.0


def _ptq(*recipes: str) -> tuple[dict, ...]:
    return tuple({"recipe": r, "modes": ["ptq"]} for r in recipes)


LADDERS: dict[str, tuple[Rung, ...]] = {
    "xnnpack": (
        Rung(
            "int8_ptq",
            "int8 weights, PTQ: one calibration pass and the least accuracy lost; the cheapest candidate",
            _ptq("xnnpack_int8_dynamic"),
            bits=8,
        ),
        Rung(
            "int4_ptq",
            "4-bit weights, PTQ (nearest, HQQ scales, GPTQ, rotation + GPTQ, an 8-bit output tensor stored once with a "
            "tied table, with zero points and weighted scales, and with the output projection's input as two int8 "
            "rows): seconds more than int8, a smaller .pte",
            _ptq(
                "xnnpack_8da4w",
                "xnnpack_8da4w_hqq",
                "xnnpack_8da4w_gptq",
                "xnnpack_8da4w_rot_gptq",
                "xnnpack_8da4w_tied8",
                "xnnpack_8da4w_zp",
                "xnnpack_8da4w_zp_split",
            ),
            bits=4,
        ),
        Rung(
            "mixed_ptq",
            "per-layer mixed precision under the size budget (autotune: a sensitivity table, then PTQ): costs a "
            "measurement per layer and precision, no training",
            bits=4,
            needs_size_budget=True,
            mixes=True,
            mix_floor=8 / 9,  # its smallest scheme, 4-bit per channel: 0.5 B/weight against 4-bit g32's 0.5625
        ),
        Rung(
            "int4_qat",
            "4-bit QAT distilled from the FP model (GPTQ's weights with learned scales; the tied 8-bit output "
            "tensor; the zero-point program, from its PTQ's choice, without and with the split head input): "
            "training, the costliest rung so far; each the same program as its PTQ sibling, more accurate",
            (
                {"recipe": "xnnpack_8da4w_lsq_gptq", "modes": ["qat"], "config": DISTILL},
                {"recipe": "xnnpack_8da4w_tied8", "modes": ["qat"], "config": DISTILL},
                {"recipe": "xnnpack_8da4w_zp_lsq", "modes": ["qat"], "config": KEEP_SCALES},
                {"recipe": "xnnpack_8da4w_zp_split_lsq", "modes": ["qat"], "config": KEEP_SCALES},
            ),
            bits=4,
            trains=True,
            siblings={
                "xnnpack_8da4w_lsq_gptq-qat": "xnnpack_8da4w_gptq-ptq",
                "xnnpack_8da4w_tied8-qat": "xnnpack_8da4w_tied8-ptq",
                "xnnpack_8da4w_zp_lsq-qat": "xnnpack_8da4w_zp-ptq",
                "xnnpack_8da4w_zp_split_lsq-qat": "xnnpack_8da4w_zp_split-ptq",
            },
        ),
        Rung(
            "int3_ptq",
            "3-bit weights, PTQ (GPTQ, which halves nearest rounding's loss at 3 bits on the demo model; per-row scales, "
            "the smaller program): fewer bits, only where the budgets demand them",
            _ptq("xnnpack_8da3w_gptq", "xnnpack_8da3w_pc"),
            bits=3,
            on_demand=True,
        ),
        Rung(
            "int3_qat",
            "3-bit QAT from GPTQ's weights, learned scales, distilled from the FP model: training at fewer bits, "
            "the costliest rung",
            ({"recipe": "xnnpack_8da3w_lsq_gptq", "modes": ["qat"], "config": DISTILL},),
            bits=3,
            trains=True,
            siblings={"xnnpack_8da3w_lsq_gptq-qat": "xnnpack_8da3w_gptq-ptq"},
            on_demand=True,
        ),
    ),
}


def _autotune_rung(rung: Rung, max_size_mb: float | None, max_latency_ms: float | None = None) -> Rung:
    """The mixed-precision rung with its autotune entry for the size budget, and the latency budget when one is
    given (autotune's ``--max_latency_ms``: it then measures its per-layer latency table); no entry without a size
    budget. The one place that builds autotune's options from the ship's budgets."""
    if max_size_mb is None:
        return rung
    budgets = {"max_size_mb": max_size_mb, **({"max_latency_ms": max_latency_ms} if max_latency_ms else {})}
    return Rung(**{**rung.__dict__, "entries": ({"recipe": "xnnpack_8da4w", "autotune": budgets, "modes": ["ptq"]},)})


def ladder_for(
    backend: str, max_size_mb: float | None = None, exclude: Sequence[str] = (), max_latency_ms: float | None = None
) -> list[Rung]:
    """The rungs for ``backend`` with their runs (the autotune rung's for ``max_size_mb`` and ``max_latency_ms``); recipes the installed
    registry lacks, that refuse the rung's mode, or that ``exclude`` names (e.g. a runtime that cannot take a
    rotation) are left out."""
    from qharness.recipes.registry import load_recipe
    from qharness.sweep.plan import run_name

    if backend not in LADDERS:
        raise UserError(
            f"qharness ship has no ladder for backend {backend!r}",
            fix=f"ship a {', '.join(LADDERS)} baseline (e.g. baseline: xnnpack_fp32)",
        )
    named = {e.get("recipe") for rung in LADDERS[backend] for e in rung.entries}
    unknown = sorted(set(exclude) - named)
    if unknown:
        raise UserError(
            f"--exclude {', '.join(unknown)}: not a recipe of the {backend} ladder",
            fix=f"exclude some of {', '.join(sorted(n for n in named if n))}",
        )
    out = []
    for rung in LADDERS[backend]:
        rung = _autotune_rung(rung, max_size_mb, max_latency_ms) if rung.needs_size_budget else rung
        kept = []
        for entry in rung.entries:
            if entry.get("recipe") in exclude and "autotune" not in entry:
                continue
            try:
                load_recipe(entry.get("recipe", "xnnpack_8da4w")).check_mode(entry["modes"][0])
            except UserError:
                continue
            kept.append(entry)
        names = {run_name(e, e["modes"][0]) for e in kept}
        siblings = {q: p for q, p in rung.siblings.items() if q in names}
        out.append(Rung(**{**rung.__dict__, "entries": tuple(kept), "siblings": siblings}))
    if exclude and not any(rung.entries for rung in out):
        raise UserError(
            f"--exclude {', '.join(dict.fromkeys(exclude))} leaves no recipe of the {backend} ladder to try",
            fix=f"exclude fewer of {', '.join(sorted(n for n in named if n))}"
            + ("" if max_size_mb else " (or give --max_size_mb: the per-layer mixed rung then runs)"),
        )
    return out
