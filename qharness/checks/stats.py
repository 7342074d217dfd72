"""The noise bands of the harness, in one place: intervals on perplexity over validation blocks (alone and paired
between two models scored on the same blocks), intervals on a difference of two means with standard errors,
the percentile bootstrap interval of a mean of per-item scores (answer quality over conversations), and the latency
tie tests (range overlap, an exact rank test).

Perplexity intervals are Student-t intervals on the mean of the per-block mean losses, exponentiated: blocks are
the unit of resampling (tokens inside a block are not independent). Two models scored on the same blocks are
compared through the per-block loss differences (paired), which removes the block-to-block variation they share.

Example::

    loss_interval([4.1, 4.3, 4.0, 4.2])                # {"loss_se": ..., "n_blocks": 4, "ppl_ci": [lo, hi]}
    paired_ratio(pte_blocks, fp_blocks)                 # {"ppl_ratio": ppl_a / ppl_b, "ci": [lo, hi]}
    latency_tie([0.91, 0.95, 0.93], [0.80, 0.82, 0.81]) # False: ranges apart and the rank test agrees
"""

from __future__ import annotations

import math
from functools import lru_cache

LEVEL = 0.95
Z = 1.959963984540054  # two-sided 95% normal quantile
ALPHA = 0.05  # rank-test level under which two latency samples differ


def stderr_name(metric: str) -> str:
    """lm-eval's name of a metric's standard error: ``acc`` -> ``acc_stderr``, ``exact_match,strict`` -> ``exact_match_stderr,strict``."""
    base, sep, filt = metric.partition(",")
    return f"{base}_stderr{sep}{filt}"


def is_stderr(name: str) -> bool:
    return name.partition(",")[0].endswith("_stderr")


@lru_cache(maxsize=None)
def t_quantile(df: int, level: float = LEVEL) -> float:
    """Two-sided Student-t quantile (``df`` degrees of freedom)."""
    from scipy.stats import t

    return float(t.ppf((1 + level) / 2, df))


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (None for fewer than two values)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def _exp(x: float) -> float:
    return math.exp(min(x, 50.0))


def loss_interval(block_losses: list[float]) -> dict:
    """``loss_se``, ``n_blocks`` and the 95% ``ppl_ci`` ([lo, hi], None below two blocks) of per-block mean losses."""
    mean, se = mean_se(block_losses)
    n = len(block_losses)
    if se is None:
        return {"loss_se": None, "n_blocks": n, "ppl_ci": None}
    half = t_quantile(n - 1) * se
    return {"loss_se": se, "n_blocks": n, "ppl_ci": [_exp(mean - half), _exp(mean + half)]}


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """``ppl_a / ppl_b`` and its 95% interval from per-block loss differences ``a[i] - b[i]`` (same blocks, same order)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired comparison needs the same blocks on both sides (got {len(a)} and {len(b)})")
    mean, se = mean_se([x - y for x, y in zip(a, b)])
    half = 0.0 if se is None else t_quantile(len(a) - 1) * se
    return {
        "ppl_ratio": _exp(mean),
        "ci": None if se is None else [_exp(mean - half), _exp(mean + half)],
        "n_blocks": len(a),
    }


def bootstrap_interval(
    values: list[float], iters: int = 1000, seed: int = 0, level: float = LEVEL
) -> list[float] | None:
    """Percentile bootstrap interval ``[lo, hi]`` of the mean of ``values`` (per-item scores: one per conversation),
    resampling the items ``iters`` times with a fixed ``seed`` (None below two items). Bounded scores (exact match
    is 0 or 1) keep their bounds, which a normal interval would cross."""
    n = len(values)
    if n < 2:
        return None
    import random

    rng = random.Random(seed)
    means = sorted(math.fsum(rng.choices(values, k=n)) / n for _ in range(iters))
    tail = (1 - level) / 2
    return [means[int(tail * (iters - 1))], means[int(math.ceil((1 - tail) * (iters - 1)))]]


def diff_interval(diff: float, se_a: float, se_b: float) -> list[float]:
    """95% normal interval of a difference of two independent estimates with standard errors ``se_a``, ``se_b``."""
    half = Z * math.hypot(se_a, se_b)
    return [diff - half, diff + half]


def ranges_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


@lru_cache(maxsize=None)
def _u_counts(n: int, m: int) -> tuple[int, ...]:
    """How many orderings of ``n`` + ``m`` distinct values give each Mann-Whitney U (0 .. n*m)."""
    if n == 0 or m == 0:
        return (1,)
    with_last_a = _u_counts(n - 1, m)  # the largest value is from the first sample: it beats all m others
    with_last_b = _u_counts(n, m - 1)
    counts = [0] * (n * m + 1)
    for u, c in enumerate(with_last_a):
        counts[u + m] += c
    for u, c in enumerate(with_last_b):
        counts[u] += c
    return tuple(counts)


def rank_test_p(a: list[float], b: list[float]) -> float:
    """Two-sided exact Mann-Whitney p-value of "``a`` and ``b`` come from one distribution" (ties count half;
    the exact null distribution assumes no ties, which makes the test a little conservative with them)."""
    n, m = len(a), len(b)
    u = sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in a for y in b)
    counts = _u_counts(n, m)
    total = sum(counts)
    tail = min(u, n * m - u)  # U's null distribution is symmetric about n*m/2
    p = 2 * sum(c for k, c in enumerate(counts) if k <= tail + 1e-9) / total
    return min(1.0, p)


def latency_tie(a: list[float], b: list[float]) -> bool:
    """Per-process timings ``a``, ``b`` tie: their ranges overlap, or the rank test finds no difference (p >= ALPHA)."""
    return ranges_overlap((min(a), max(a)), (min(b), max(b))) or rank_test_p(a, b) >= ALPHA


def with_intervals(metrics: dict, reference: str = "fp") -> dict:
    """``metrics`` (``{model: {"loss", "ppl", "block_losses"}}``) with ``ppl_ci``, ``loss_se``, ``n_blocks`` for
    each model and ``vs_fp`` (``paired_ratio`` against the ``reference`` model's blocks) for the others;
    ``block_losses`` stay, last. Models without block losses are left as they are."""
    ref = metrics.get(reference, {}).get("block_losses")
    out = {}
    for name, m in metrics.items():
        blocks = m.get("block_losses")
        if blocks is None:
            out[name] = m
            continue
        entry = {k: v for k, v in m.items() if k != "block_losses"} | loss_interval(blocks)
        if name != reference and ref is not None and len(ref) == len(blocks):
            r = paired_ratio(blocks, ref)
            entry["vs_fp"] = {"ppl_ratio": r["ppl_ratio"], "ci": r["ci"]}
        out[name] = entry | {"block_losses": blocks}
    return out
