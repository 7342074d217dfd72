"""The benchmark records ``summary.json`` holds (``bench``: ``bench.bench``; ``bench_joint``: ``joint.joint_entry``),
as frozen dataclasses whose fields are the JSON keys (``RunSummary`` reads and writes them; no torch here). A field
that is None was not measured (a benchmark written before it was, or the eager model not timed) and is left out of
the JSON."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MedianRange:
    """Median, min and max over the repetitions in one process (``spread.median_range``)."""

    median: float
    min: float
    max: float


@dataclass(frozen=True)
class Spread(MedianRange):
    """Median, min and max of per-process values, and the values (``per_process``, process order)."""

    per_process: list[float] | None = None


@dataclass(frozen=True)
class ModelBench:
    """One model timed in a fresh process (``measure.measure``): load seconds, prefill and decode tokens/s, CPU
    time per wall time while decoding, decode tokens per CPU-second, its threads, peak and baseline RSS (MB), file
    size and the weight bytes one decode step reads, and decode speed against the memory-bandwidth bound."""

    load_s: MedianRange | None = None
    prefill_tok_s: MedianRange | None = None
    decode_tok_s: MedianRange | None = None
    decode_cpu_share: MedianRange | None = None
    decode_tok_per_cpu_s: MedianRange | None = None
    threads: int | None = None
    peak_rss_mb: float | None = None
    base_rss_mb: float | None = None
    size_bytes: int | None = None
    weight_bytes: int | None = None
    bandwidth_fraction: float | None = None

    @classmethod
    def from_json(cls, m: dict) -> ModelBench:
        """``measure``'s JSON line (from its fresh process), its ranges as ``MedianRange``."""
        return cls(**{k: MedianRange(**v) if isinstance(v, dict) else v for k, v in m.items()})


@dataclass(frozen=True)
class PteVsEager:
    """The ``.pte`` over the eager FP model: prefill and decode speed-ups, size and peak RSS ratios."""

    prefill_speedup: float
    decode_speedup: float
    size_ratio: float
    peak_rss_ratio: float


@dataclass(frozen=True)
class Bench:
    """A run's own benchmark (``qharness bench``): the lengths and threads it ran with, the machine (CPUs, load
    average, copy bandwidth GB/s), the ``.pte``'s figures and, when timed, the eager model's and the ratios."""

    vocab_size: int | None = None
    prompt_len: int | None = None
    decode_tokens: int | None = None
    reps: int | None = None
    threads: int | None = None
    cpus: int | None = None
    load_avg_1m: float | None = None
    bandwidth_gb_s: float | None = None
    pte: ModelBench | None = None
    eager: ModelBench | None = None
    pte_vs_eager: PteVsEager | None = None


@dataclass(frozen=True)
class JointEntry:
    """One program's part of a joint benchmark (``joint.interleaved``: fresh processes, alternating rounds): how it ran
    (``processes`` per program, ``order``, load average before and after, ``threads``) and the ``spread`` of its
    process medians (None: not recorded; the report then falls back to the run's own ``bench``). ``latency_class``:
    the programs of one structure timed as one latency class with this one (itself included), whose process medians
    the spreads pool (``joint.pool_classes``); None: a class of its own."""

    processes: int
    order: str | None = None
    load_avg_1m: list[float] | None = None
    threads: int | None = None
    decode_tok_s: Spread | None = None
    prefill_tok_s: Spread | None = None
    decode_ms_per_token: Spread | None = None
    latency_class: list[str] | None = None
