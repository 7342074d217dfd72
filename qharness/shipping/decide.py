"""The ship decision on the candidates' report rows (``reporting/rows.py``): which candidate meets the tolerance and
the budgets, which one to ship among them (ties inside the noise, broken by a stated rule), the closest one when
none does, and whether a rung not yet run could change the answer.

- **Meets the tolerance**: the upper end of the paired 95% interval of the ``.pte``'s perplexity against FP (scored
  on the same held-out blocks in the candidate's run) is at most the tolerance: ``ppl_pte_vs_fp_hi <= tolerance``.
- **Fits the budgets**: the measured ``.pte`` size (MB) within ``max_size_mb``; the decode latency (ms/token, the
  median over the joint benchmark's processes) within ``max_latency_ms``. Only a ``.pte`` that passed its parity
  gate is a candidate.
- **The pick** among the candidates that meet everything, ``prefer="size"``: the smallest ``.pte``; sizes within
  ``SIZE_TIE`` (1%) of the smallest are a tie. ``prefer="latency"``: the fastest, ties inside the joint benchmark's
  noise (``reporting.ranking.compare_latency``). A tie is broken by: more accurate beyond the noise (the paired
  interval of the two candidates' per-block losses), then the cheaper rung (earlier in the ladder), then the
  smaller upper end of the interval against FP, then the name.
- **Closest** when none meets everything: the candidate whose worst relative miss is smallest, then its next worst
  (accuracy: ``(1 + hi) / (1 + tolerance) - 1``; size: ``size / max_size_mb - 1``; latency:
  ``latency / max_latency_ms - 1``), then the name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qharness.reporting.ranking import compare_accuracy, compare_latency
from qharness.reporting.rows import _number

SIZE_TIE = 0.01  # .pte sizes within 1% of each other are a tie on size
PREFER = ("size", "latency")


@dataclass(frozen=True)
class Goal:
    """What the shipped candidate must meet: ``tolerance`` (a fraction: 0.02 = +2% perplexity against FP, judged on
    the upper end of the paired interval), the optional budgets, and which axis to minimise (``prefer``)."""

    tolerance: float
    max_size_mb: float | None = None
    max_latency_ms: float | None = None
    prefer: str = "size"

    @property
    def needs_latency(self) -> bool:
        """Whether the decision reads latencies (a latency budget, or the fastest asked for)."""
        return self.max_latency_ms is not None or self.prefer == "latency"

    def requirements(self) -> str:
        """The tolerance and the budgets, in words."""
        parts = [f"ppl increase vs FP <= {self.tolerance:.2%} (upper end of the paired 95% interval)"]
        if self.max_size_mb is not None:
            parts.append(f".pte <= {self.max_size_mb:g} MB")
        if self.max_latency_ms is not None:
            parts.append(f"decode <= {self.max_latency_ms:g} ms/token")
        return ", ".join(parts)

    def text(self) -> str:
        return self.requirements() + f"; prefer the {'smallest' if self.prefer == 'size' else 'fastest'}"


def misses(row: dict, goal: Goal) -> list[str]:
    """What ``row`` misses of ``goal``, in words (empty: it meets everything)."""
    if row.get("parity_passed") is not True:
        return ["its .pte failed the parity gate" if row.get("parity_passed") is False else "no checked .pte"]
    out = []
    hi = row.get("ppl_pte_vs_fp_hi")
    if not _number(hi):
        out.append("no paired interval against FP")
    elif hi > goal.tolerance:
        out.append(f"ppl vs FP up to {hi:+.2%} > {goal.tolerance:.2%}")
    size = row.get("pte_size_mb")
    if goal.max_size_mb is not None and (not _number(size) or size > goal.max_size_mb):
        out.append(f".pte {size:.3f} MB > {goal.max_size_mb:g} MB" if _number(size) else "no .pte size")
    lat = row.get("decode_ms_per_token")
    if goal.max_latency_ms is not None and (not _number(lat) or lat > goal.max_latency_ms):
        out.append(f"decode {lat:.3g} ms/token > {goal.max_latency_ms:g}" if _number(lat) else "no latency measured")
    return out


def fits_budgets(row: dict, goal: Goal) -> bool:
    """A checked ``.pte`` within the size and latency budgets (accuracy aside)."""
    return row.get("parity_passed") is True and not any(
        m.startswith((".pte", "decode", "no .pte size", "no latency")) for m in misses(row, goal)
    )


def relative_misses(row: dict, goal: Goal) -> tuple[float, ...]:
    """``row``'s relative misses, the worst first (all 0 when it meets everything; ``(inf,)`` without a checked
    ``.pte``): compared as tuples, the closest candidate has the smallest worst miss, then the smallest next one."""
    if row.get("parity_passed") is not True or not _number(row.get("ppl_pte_vs_fp_hi")):
        return (math.inf,)
    out = [(1 + row["ppl_pte_vs_fp_hi"]) / (1 + goal.tolerance) - 1]
    for key, budget in (("pte_size_mb", goal.max_size_mb), ("decode_ms_per_token", goal.max_latency_ms)):
        if budget is not None:
            out.append(row[key] / budget - 1 if _number(row.get(key)) else math.inf)
    return tuple(sorted((max(m, 0.0) for m in out), reverse=True))


@dataclass
class Decision:
    """The outcome: ``chosen`` (a row, None when no candidate meets everything), the ``tied`` rows it was picked
    among, the ``closest`` row when none meets, and the reasons in words (``text``)."""

    chosen: dict | None
    tied: list[dict]
    closest: dict | None
    text: str


def _primary_tie(a: dict, b: dict, prefer: str) -> bool:
    """Whether ``a`` and ``b`` tie on the preferred axis (sizes within ``SIZE_TIE``; latency inside the noise)."""
    if prefer == "latency":
        return compare_latency(a, b).sign == 0
    return abs(a["pte_size_mb"] - b["pte_size_mb"]) <= SIZE_TIE * min(a["pte_size_mb"], b["pte_size_mb"])


def _primary_value(row: dict, prefer: str) -> float:
    return row["decode_ms_per_token"] if prefer == "latency" else row["pte_size_mb"]


def decide(rows: list[dict], goal: Goal, rung_order: dict[str, int]) -> Decision:
    """The candidate to ship among ``rows`` (each with ``run``, its report columns and ``_`` noise keys), or the
    closest one. ``rung_order``: run name -> its rung's place in the ladder (the tie-break's "cheaper rung")."""
    ok = [r for r in rows if not misses(r, goal)]
    if not ok:
        ranked = sorted(
            (r for r in rows if math.isfinite(relative_misses(r, goal)[0])),
            key=lambda r: (relative_misses(r, goal), r["run"]),
        )
        if not ranked:
            return Decision(None, [], None, "no candidate produced a checked .pte with a paired interval against FP")
        near = ranked[0]
        return Decision(
            None,
            [],
            near,
            f"no candidate meets {goal.requirements()}; the closest is {near['run']} ({'; '.join(misses(near, goal))})",
        )
    if goal.prefer == "latency" and not all(_number(r.get("decode_ms_per_token")) for r in ok):
        ok = [r for r in ok if _number(r.get("decode_ms_per_token"))] or ok
        prefer = "latency" if all(_number(r.get("decode_ms_per_token")) for r in ok) else "size"
    else:
        prefer = goal.prefer
    lead = min(ok, key=lambda r: (_primary_value(r, prefer), r["run"]))
    tied = [r for r in ok if r is lead or _primary_tie(lead, r, prefer)]
    # more accurate beyond the noise: drop any tied candidate another tied one beats on the paired interval
    top = [r for r in tied if not any(compare_accuracy(o, r, "ppl_pte", True).sign > 0 for o in tied if o is not r)]
    steps = [f"more accurate beyond the noise (ahead of {', '.join(r['run'] for r in tied if r not in top)})"]
    steps = steps if len(top) < len(tied) else []
    left = top
    for label, key in (
        ("the cheaper rung", lambda r: rung_order.get(r["run"], 99)),
        ("the smaller upper end of the interval against FP", lambda r: r["ppl_pte_vs_fp_hi"]),
        (f"the {'smaller .pte' if prefer == 'size' else 'lower median latency'}", lambda r: _primary_value(r, prefer)),
        ("the name", lambda r: r["run"]),
    ):
        if len(left) == 1:
            break
        low = min(key(r) for r in left)
        if any(key(r) != low for r in left):
            steps.append(label)
            left = [r for r in left if key(r) == low]
    best = left[0]
    axis = "size" if prefer == "size" else "latency"
    head = f"{best['run']} meets {goal.requirements()}"
    if len(tied) == 1:
        return Decision(best, [], None, f"{head}; it is the {'smallest' if axis == 'size' else 'fastest'} that does")
    others = [r for r in tied if r is not best]
    how = "within 1% on .pte size" if axis == "size" else "inside the joint benchmark's noise on latency"
    text = (
        f"{head}; a tie on {axis} between {', '.join(r['run'] for r in tied)} ({how}), broken by "
        + ", then by ".join(steps)
        + " (the rule: more accurate beyond the noise, the cheaper rung, the smaller upper end against FP, "
        f"the {'smaller .pte' if prefer == 'size' else 'lower latency'}, the name)"
    )
    return Decision(best, others, None, text)


@dataclass(frozen=True)
class Reach:
    """What the programs of a rung not yet run can be, from the candidates already measured: ``size_mb`` / ``latency_ms``
    (None: unknown, e.g. a backend that stores fewer bits smaller) and where that comes from (``basis``)."""

    size_mb: float | None
    latency_ms: float | None
    basis: str


def as_do(best: dict, ok: list[dict]) -> str:
    """`` (as do B, C)``: the other candidates besides ``best`` that meet everything (the tie rule may choose one of
    them at the end), or "" when ``best`` is the only one.

    >>> as_do({"run": "a"}, [{"run": "a"}, {"run": "b"}])
    ' (as does b)'
    """
    others = sorted(r["run"] for r in ok if r["run"] != best["run"])
    return f" (as do{'es' if len(others) == 1 else ''} {', '.join(others)})" if others else ""


def cannot_win(reach: Reach, rows: list[dict], goal: Goal) -> str | None:
    """Why a rung whose programs are like ``reach`` cannot change the answer (None: it might): every program it can
    make is over a budget, or no smaller (no faster, ``prefer="latency"``) than a candidate that meets everything."""
    if goal.max_size_mb is not None and reach.size_mb is not None and reach.size_mb > goal.max_size_mb * (1 + 1e-9):
        return (
            f"its programs are at least {reach.size_mb:.3f} MB ({reach.basis}), over the {goal.max_size_mb:g} MB budget"
        )
    if goal.max_latency_ms is not None and reach.latency_ms is not None and reach.latency_ms > goal.max_latency_ms:
        return (
            f"its programs run at {reach.latency_ms:.3g} ms/token ({reach.basis}), over the "
            f"{goal.max_latency_ms:g} ms budget"
        )
    ok = [r for r in rows if not misses(r, goal)]
    if not ok:
        return None
    if goal.prefer == "size" and reach.size_mb is not None:
        best = min(ok, key=lambda r: r["pte_size_mb"])
        if best["pte_size_mb"] <= reach.size_mb * (1 + SIZE_TIE):
            return (
                f"{best['run']} already meets everything at {best['pte_size_mb']:.3f} MB{as_do(best, ok)}; this "
                f"rung's programs are at least {reach.size_mb:.3f} MB ({reach.basis}), so none can be smaller beyond "
                "a tie"
            )
    if goal.prefer == "latency" and reach.latency_ms is not None:
        timed = [r for r in ok if _number(r.get("decode_ms_per_token"))]
        if timed:
            best = min(timed, key=lambda r: r["decode_ms_per_token"])
            if best["decode_ms_per_token"] <= reach.latency_ms:
                return (
                    f"{best['run']} already meets everything at {best['decode_ms_per_token']:.3g} ms/token"
                    f"{as_do(best, ok)}; this rung's programs run at {reach.latency_ms:.3g} ms/token ({reach.basis}), "
                    "so none can be faster"
                )
    return None
