"""Noise-aware ranking of runs: pairwise comparisons with ties inside the noise, the Pareto front, the pick.

Differences inside the noise are ties. Programs of one structure (one latency class of the joint benchmark) tie on
latency by construction. Accuracy: the paired interval of two runs' per-block losses (same validation
blocks), else an unpaired one from their standard errors (lm-eval's for task metrics). Latency: per-process ranges
that overlap, or an exact rank test that finds no difference; without a joint benchmark, each run's own min-max
over repetitions (weak evidence). A run is dominated only by one better beyond the noise on one axis and not worse
beyond it on the other; the best run under a budget is picked by accuracy, then latency, beyond the noise, then by
the smaller ``.pte`` (then the name), and the words say when the data did not decide. Runs whose ``.pte`` failed
the parity gate are never on the front or picked.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from qharness.checks.stats import ALPHA, diff_interval, paired_ratio, ranges_overlap, rank_test_p, stderr_name
from qharness.reporting.render import describe, label
from qharness.reporting.rows import STAGES, _number

AXES = {"latency": "decode_ms_per_token", "size": "pte_size_mb"}  # the x axis of a front: decode latency or .pte size


def eligible(row: dict, column: str, axis: str = "latency") -> bool:
    """Shippable and measured: parity passed, the axis (decode latency, or ``.pte`` size) and the metric known."""
    return row.get("parity_passed") is True and _number(row.get(AXES[axis])) and _number(row.get(column))


def pareto_front(points: list[tuple[float, float]], lower_is_better: bool) -> list[int]:
    """Indices of the points (latency, metric) no other point dominates (lower latency is better; the metric's
    direction is ``lower_is_better``), sorted by latency: the front without noise (``noisy_front`` has ties).
    One sort and one sweep (n log n): a point is on it when its metric beats every faster point's and is the best at
    its latency (equal points are all on it).

    >>> pareto_front([(1, 10), (2, 8), (3, 9), (4, 5)], lower_is_better=True)
    [0, 1, 3]
    """
    sign = 1 if lower_is_better else -1
    order = sorted(range(len(points)), key=lambda i: (points[i][0], sign * points[i][1]))
    front, best, k = [], math.inf, 0  # best: the lowest (signed) metric of the strictly faster points
    while k < len(order):
        x = points[order[k]][0]
        same = []
        while k < len(order) and points[order[k]][0] == x:
            same.append(order[k])
            k += 1
        low = sign * points[same[0]][1]  # the best metric at this latency (sorted)
        if low < best:
            front += [i for i in same if sign * points[i][1] == low]
            best = low
    return front


@dataclass(frozen=True)
class Comparison:
    """Run ``a`` against run ``b`` on one axis: ``sign`` +1 when ``a`` is better beyond the noise, -1 when ``b`` is,
    0 for a tie; ``text`` the difference with its interval, e.g. ``ppl -0.3% [-0.9%, +0.4%], paired over 32 blocks``."""

    sign: int
    text: str


def same_program(a: dict, b: dict) -> bool:
    return a.get("_sha256") is not None and a.get("_sha256") == b.get("_sha256")


def _sign(lo: float, hi: float, lower_is_better: bool) -> int:
    """The sign of a Comparison from the interval of ``a - b`` (0 when it holds 0)."""
    if lo <= 0 <= hi:
        return 0
    return 1 if (hi < 0) == lower_is_better else -1


def compare_accuracy(a: dict, b: dict, column: str, lower_is_better: bool) -> Comparison:
    """Perplexity columns (``ppl_<stage>``): the paired interval of the per-block loss differences when both runs
    were scored on the same validation blocks, else an unpaired one from the two standard errors. lm-eval columns:
    an unpaired interval from lm-eval's standard errors (conservative: both ran on the same documents). Without
    any noise estimate (older summaries) only equal values tie."""
    va, vb = a[column], b[column]
    if same_program(a, b):
        return Comparison(0, "same .pte (sha256)")
    stage = column[len("ppl_") :] if column.startswith("ppl_") and column[len("ppl_") :] in STAGES else None
    if stage is not None:
        ba, bb = a.get("_blocks", {}).get(stage), b.get("_blocks", {}).get(stage)
        if ba and bb and len(ba) == len(bb) and len(ba) > 1 and a.get("_val") == b.get("_val"):
            r = paired_ratio(ba, bb)
            lo, hi = r["ci"]
            return Comparison(
                _sign(math.log(lo), math.log(hi), True),
                f"ppl {r['ppl_ratio'] - 1:+.2%} [{lo - 1:+.2%}, {hi - 1:+.2%}], paired over {len(ba)} blocks",
            )
        sa, sb = a.get("_loss_se", {}).get(stage), b.get("_loss_se", {}).get(stage)
        if sa is not None and sb is not None:
            d = math.log(va / vb)
            lo, hi = diff_interval(d, sa, sb)
            return Comparison(
                _sign(lo, hi, True),
                f"ppl {math.exp(d) - 1:+.2%} [{math.exp(lo) - 1:+.2%}, {math.exp(hi) - 1:+.2%}], "
                "unpaired (different validation blocks)",
            )
    elif column.startswith("eval/"):
        _, task, metric, st = column.split("/", 3)
        se_col = f"eval/{task}/{stderr_name(metric)}/{st}"
        sa, sb = a.get(se_col), b.get(se_col)
        if _number(sa) and _number(sb):
            lo, hi = diff_interval(va - vb, sa, sb)
            return Comparison(
                _sign(lo, hi, lower_is_better),
                f"{metric} {va - vb:+.4g} [{lo:+.4g}, {hi:+.4g}] (lm-eval standard errors)",
            )
    sign = 0 if va == vb else 1 if (va < vb) == lower_is_better else -1
    name = "ppl" if column == "ppl_pte" else column
    return Comparison(sign, f"{name} {va:.5g} vs {vb:.5g} (no noise estimate)")


def same_latency_class(a: dict, b: dict) -> bool:
    """Both timed as one latency class (one program structure, samples pooled: ``runtime/joint.pool_classes``)."""
    return a.get("_latency_class") is not None and a.get("_latency_class") == b.get("_latency_class")


def compare_latency(a: dict, b: dict) -> Comparison:
    """Decode ms/token. One latency class (programs of one structure, timed together as one figure): a tie by
    construction. Joint benchmarks (per-process timings of both): a tie when the ranges overlap or the exact
    rank test finds no difference (p >= 0.05). Otherwise each run's own [min, max] over repetitions in one process
    (weak evidence): a tie when they overlap. Without ranges only equal medians tie."""
    ma, mb = a["decode_ms_per_token"], b["decode_ms_per_token"]
    head = f"latency {ma:.3g} vs {mb:.3g} ms/token"
    faster = 1 if ma < mb else -1
    if same_program(a, b):
        return Comparison(0, f"{head}: the same .pte (sha256), so the difference is measurement noise")
    if same_latency_class(a, b):
        return Comparison(0, f"{head}: one latency class (one program structure, timed as one figure)")
    sa, sb = a.get("_decode_ms_samples"), b.get("_decode_ms_samples")
    if sa and sb:
        where = f"joint benchmark, {len(sa)} and {len(sb)} processes"
        if ranges_overlap((min(sa), max(sa)), (min(sb), max(sb))):
            return Comparison(0, f"{head}: ranges overlap ({where})")
        p = rank_test_p(sa, sb)
        if p >= ALPHA:
            return Comparison(0, f"{head}: ranges apart but rank test p={p:.2g} >= {ALPHA} ({where})")
        return Comparison(faster, f"{head}: ranges apart, rank test p={p:.2g} ({where})")
    ra = (a.get("decode_ms_per_token_lo"), a.get("decode_ms_per_token_hi"))
    rb = (b.get("decode_ms_per_token_lo"), b.get("decode_ms_per_token_hi"))
    if all(_number(v) for v in (*ra, *rb)):
        where = "own benchmarks, repetitions in one process: weak evidence"
        if ranges_overlap(ra, rb):
            return Comparison(0, f"{head}: ranges overlap ({where})")
        return Comparison(faster, f"{head}: ranges apart ({where})")
    return Comparison(0 if ma == mb else faster, f"{head} (no noise estimate)")


def compare_size(a: dict, b: dict) -> Comparison:
    """``.pte`` size: exact (a file size has no noise); +1 when ``a`` is smaller."""
    sa, sb = a["pte_size_mb"], b["pte_size_mb"]
    return Comparison(0 if sa == sb else 1 if sa < sb else -1, f".pte {sa:.3f} vs {sb:.3f} MB")


def dominates(acc: Comparison, lat: Comparison) -> bool:
    """``a`` dominates ``b`` (``acc``, ``lat``: a against b): better beyond the noise on one axis, not worse beyond it on the other."""
    return (acc.sign > 0 and lat.sign >= 0) or (lat.sign > 0 and acc.sign >= 0)


NEIGHBOURS = 8  # over 2 x this many runs, each run is compared with its neighbours only (``_candidates``)


class Comparisons:
    """The comparisons of one report (``compare_accuracy`` on ``column``, ``compare_latency``, ``compare_size``),
    each pair of rows computed once: both fronts and the pick ask for the same pairs."""

    def __init__(self, column: str, lower_is_better: bool):
        self.column, self.lower_is_better, self.memo = column, lower_is_better, {}

    def _get(self, kind: str, a: dict, b: dict, compute) -> Comparison:
        key = (kind, id(a), id(b))
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def accuracy(self, a: dict, b: dict) -> Comparison:
        return self._get("acc", a, b, lambda: compare_accuracy(a, b, self.column, self.lower_is_better))

    def latency(self, a: dict, b: dict) -> Comparison:
        return self._get("lat", a, b, lambda: compare_latency(a, b))

    def size(self, a: dict, b: dict) -> Comparison:
        return self._get("size", a, b, lambda: compare_size(a, b))

    def dominates(self, a: dict, b: dict, axis: str = "latency") -> bool:
        """``dominates(accuracy(a, b), latency-or-size(a, b))``, the accuracy comparison skipped when the other
        axis already decides (``a`` worse beyond the noise there)."""
        other = (self.size if axis == "size" else self.latency)(a, b)
        return other.sign >= 0 and dominates(self.accuracy(a, b), other)

    def tie(self, a: dict, b: dict, axis: str = "latency") -> bool:
        """A tie on both axes (the other axis asked first: ``.pte`` sizes tie only when equal)."""
        return (self.size if axis == "size" else self.latency)(a, b).sign == 0 and self.accuracy(a, b).sign == 0


def _window(order: list[int], pos: dict[int, int], i: int, k: int = NEIGHBOURS) -> list[int]:
    """The ``k`` runs on each side of ``i`` in ``order``."""
    p = pos[i]
    return order[max(0, p - k) : p + k + 1]


def _candidates(points: list[tuple[float, float]], lower_is_better: bool) -> list[list[int]]:
    """For each point, the others it is compared with for domination and ties. Up to ``2 * NEIGHBOURS`` points:
    all of them. Beyond: the ``NEIGHBOURS`` nearest on each side along each axis (where ties and noisy dominators
    are) and the ``NEIGHBOURS`` at each end of the run of exact-front points that dominate it (the ones better by
    the most on one axis), so a report of thousands of runs takes n log n comparisons, not n squared."""
    n = len(points)
    if n <= 2 * NEIGHBOURS:
        return [[j for j in range(n) if j != i] for i in range(n)]
    sign = 1 if lower_is_better else -1
    by_x = sorted(range(n), key=lambda i: (points[i][0], sign * points[i][1]))
    by_y = sorted(range(n), key=lambda i: (sign * points[i][1], points[i][0]))
    pos_x, pos_y = {i: p for p, i in enumerate(by_x)}, {i: p for p, i in enumerate(by_y)}
    front = pareto_front(points, lower_is_better)  # sorted by x, its metric getting better along it
    fx = [points[i][0] for i in front]
    fy = [-sign * points[i][1] for i in front]  # increasing along the front
    out = []
    for i in range(n):
        x, y = points[i][0], sign * points[i][1]
        hi = bisect.bisect_right(fx, x)  # front points at most as slow
        lo = bisect.bisect_left(fy, -y)  # front points at least as good
        doms = front[lo:hi]
        near = {*_window(by_x, pos_x, i), *_window(by_y, pos_y, i), *doms[:NEIGHBOURS], *doms[-NEIGHBOURS:]}
        near.discard(i)
        out.append(sorted(near))
    return out


def noisy_front(
    rows: list[dict], column: str, lower_is_better: bool, axis: str = "latency", cmp: Comparisons | None = None
) -> tuple[list[dict], dict[str, list[str]]]:
    """The Pareto front of the eligible rows with ties inside the noise (``compare_accuracy``, ``compare_latency``;
    ``axis="size"``: ``.pte`` size in place of latency, ``compare_size``), sorted by that axis, and each eligible
    run's ties (runs it ties with on both axes).

    Runs that tie on both axes with the same ``.pte`` size (or the same ``.pte``) are one program: they are on the
    front together or not at all (on it when any of them is undominated). Over ``2 * NEIGHBOURS`` runs each run is
    compared with its ``_candidates`` only (its neighbours and the exact front's runs that dominate it)."""
    ok = [r for r in rows if eligible(r, column, axis)]
    n = len(ok)
    sign = 1 if lower_is_better else -1
    cands = _candidates([(r[AXES[axis]], r[column]) for r in ok], lower_is_better)
    cmp = cmp or Comparisons(column, lower_is_better)
    undominated = [not any(cmp.dominates(ok[j], ok[i], axis) for j in cands[i]) for i in range(n)]
    pairs = {(min(i, j), max(i, j)) for i in range(n) for j in cands[i]}
    tie = {(i, j) for i, j in pairs if cmp.tie(ok[i], ok[j], axis)}
    tie |= {(j, i) for i, j in tie}
    group = list(range(n))  # union-find of identical programs

    def root(i):
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    for i, j in sorted(tie):
        if same_program(ok[i], ok[j]) or ok[i].get("pte_size_mb") == ok[j].get("pte_size_mb"):
            group[max(root(i), root(j))] = min(root(i), root(j))
    on_root = {root(k) for k in range(n) if undominated[k]}
    front = sorted(
        (ok[i] for i in range(n) if root(i) in on_root), key=lambda r: (r[AXES[axis]], sign * r[column], r["run"])
    )
    tied: dict[int, list[int]] = {i: [] for i in range(n)}
    for i, j in tie:
        tied[i].append(j)
    ties = {ok[i]["run"]: sorted(ok[j]["run"] for j in tied[i]) for i in range(n)}
    return front, ties


def _unbeaten(items: list[dict], key, beats) -> list[dict]:
    """The items no other beats (``beats(o, r)``); over ``2 * NEIGHBOURS`` items each is checked against the
    ``NEIGHBOURS`` best by ``key`` (lower is better) and its ``NEIGHBOURS`` neighbours on each side."""
    if len(items) <= 2 * NEIGHBOURS:
        return [r for r in items if not any(beats(o, r) for o in items if o is not r)]
    order = sorted(range(len(items)), key=lambda i: key(items[i]))
    pos = {i: p for p, i in enumerate(order)}
    return [
        items[i]
        for i in range(len(items))
        if not any(beats(items[j], items[i]) for j in {*order[:NEIGHBOURS], *_window(order, pos, i)} if j != i)
    ]


MAX_WORDED = 10  # runs of a tie worded in the pick's text


def best_choice(
    rows: list[dict],
    column: str,
    lower_is_better: bool,
    max_latency_ms: float | None = None,
    max_size_mb: float | None = None,
    cmp: Comparisons | None = None,
) -> dict:
    """The eligible run to pick within the budgets, deterministically: keep the runs no other beats on the metric
    beyond the noise, then those no other of them beats on latency beyond the noise; among the rest (a tie) the
    smallest ``.pte``, then the run name. Returns ``{"best": row or None, "tied": [rows], "text": words}``."""
    fits = [
        r
        for r in rows
        if eligible(r, column)
        and (max_latency_ms is None or r["decode_ms_per_token"] <= max_latency_ms)
        and (max_size_mb is None or (r.get("pte_size_mb") is not None and r["pte_size_mb"] <= max_size_mb))
    ]
    if not fits:
        return {"best": None, "tied": [], "text": "none"}
    sign = 1 if lower_is_better else -1
    cmp = cmp or Comparisons(column, lower_is_better)
    top = _unbeaten(fits, lambda r: sign * r[column], lambda o, r: cmp.accuracy(o, r).sign > 0)
    fast = _unbeaten(top, lambda r: r["decode_ms_per_token"], lambda o, r: cmp.latency(o, r).sign > 0)
    best = min(fast, key=lambda r: (r["pte_size_mb"] if _number(r.get("pte_size_mb")) else math.inf, r["run"]))
    others = [r for r in fast if r is not best]

    def both(o):  # accuracy and latency of best against o, in words
        lat = compare_latency(best, o).text
        return lat if same_program(best, o) else f"{compare_accuracy(best, o, column, lower_is_better).text}, {lat}"

    if others:
        shown = others[:MAX_WORDED]  # a tie of thousands is worded by its first runs and counted
        more = f" and {len(others) - len(shown)} more" if len(others) > len(shown) else ""
        names = ", ".join(label(r) for r in [best, *shown][:-1]) + f" and {label(([best, *shown])[-1])}" + more
        why = "; ".join(f"vs {label(o)}: {both(o)}" for o in shown) + more
        by = "size" if len({r.get("pte_size_mb") for r in fast}) == len(fast) else "size, then name"
        text = f"tie between {names} ({why}); pick by {by}: {describe(best, column)}"
    elif len(top) > 1:
        rivals = [o for o in top if o is not best]
        more = f"; and {len(rivals) - MAX_WORDED} more" if len(rivals) > MAX_WORDED else ""
        why = "; ".join(f"{label(o)}: {both(o)}" for o in rivals[:MAX_WORDED]) + more
        text = f"{describe(best, column)}; ties on accuracy but is faster beyond the noise ({why})"
    else:
        rest = sorted((r for r in fits if r is not best), key=lambda r: (sign * r[column], r["run"]))
        text = describe(best, column) + (
            f"; vs the runner-up {label(rest[0])}: {cmp.accuracy(best, rest[0]).text}" if rest else ""
        )
    return {"best": best, "tied": others, "text": text}


def best_under(
    rows: list[dict],
    column: str,
    lower_is_better: bool,
    max_latency_ms: float | None = None,
    max_size_mb: float | None = None,
) -> dict | None:
    """The eligible row picked within the budgets (``best_choice``); None if none fits."""
    return best_choice(rows, column, lower_is_better, max_latency_ms, max_size_mb)["best"]


def noise_notes(rows: list[dict], column: str) -> list[str]:
    """Where the noise bands are weak or missing, in words."""
    ok = [r for r in rows if eligible(r, column)]
    notes = []
    stage = column[len("ppl_") :] if column.startswith("ppl_") else None
    if stage in STAGES:
        bare = [r["run"] for r in ok if not r.get("_blocks", {}).get(stage)]
        if bare:
            notes.append(
                f"Accuracy noise: {len(bare)} of {len(ok)} runs carry no per-block losses (older summaries: {', '.join(bare)}): their perplexities "
                "are compared without a noise band."
            )
        if len({r.get("_val") for r in ok if r.get("_blocks", {}).get(stage)}) > 1:
            notes.append(
                "Accuracy noise: the runs were scored on different validation blocks (data, seq_len or eval_blocks differ): perplexities are "
                "compared unpaired (wider intervals). Give every run the same data section and parity.eval_blocks to pair them."
            )
    own = [r["run"] for r in ok if not r.get("_decode_ms_samples")]
    if own:
        notes.append(
            f"Latency noise: {len(own)} of {len(ok)} runs have no joint benchmark (bench_joint); their latency ranges are min-max over "
            "repetitions inside one process (weak evidence: they miss process-to-process and machine-state variation)."
        )
    return notes
