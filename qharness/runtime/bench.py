"""Benchmark: load time, prefill and decode tokens/s, peak RSS and size of a ``.pte`` and of the eager FP model.

``bench`` here; the timing of one model in ``measure.py``, joint timing of many in ``joint.py``, the statistics
in ``spread.py``. Each model is measured in a fresh Python process (so its peak RSS is its own): per repetition it is
loaded, prefilled with ``prompt_len`` random tokens in one call, then decodes ``decode_tokens`` tokens
one at a time through its KV cache. Medians and min/max over the repetitions are reported, after one
uncounted warm-up repetition. Every process runs with the same thread count, chosen once per benchmark
(``runtime.free_cores``: the cores idle right now), for ExecuTorch's threadpool and torch's intra-op threads.

Fresh processes of one program still differ more than repetitions inside one (docs/benchmarks/timing.md), so
comparisons of programs use ``interleaved``: ``processes`` fresh processes per program in
rounds of one process each, every other round reversed (A B C, C B A, ...: ``joint.round_order``, so a program's
place in the round weighs on all alike), reported per program as the median over processes of the per-process
median and the spread (min, max, max/min) of those process medians (``spread``). Ratios of two programs are
taken per round (process k of A against process k of B: ``pair_ratios``) and judged with ``verdict``. A measured memory-copy bandwidth gives the bound decode would hit if every
token read its weights from memory once: ``bandwidth_fraction = decode tok/s * weight bytes / bandwidth``, where the
weight bytes are what a decode step reads (the ``.pte`` less its embedding tables, of which a token reads one row;
the eager model's parameters less an untied input embedding); above 1: the weights sit in CPU caches.

Example::

    result = bench("runs/qat_xnnpack/model.pte", model_dir="~/.cache/qharness/embedded-llama-...")
    print(format_bench(result))
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from qharness.config import check_lengths
from qharness.errors import UserError
from qharness.progress import stage
from qharness.runtime.bench_record import Bench, ModelBench, PteVsEager
from qharness.runtime.measure import measure_in_fresh_process, memory_bandwidth


def pte_vocab(pte_path: str | Path, prompt_len: int, decode_tokens: int, reps: int) -> int:
    """The ``.pte``'s vocabulary size, after checking the lengths fit its KV cache (runner metadata)."""
    from qharness.runtime.pte import PteModel

    meta = PteModel(pte_path).metadata()
    if not {"get_max_context_len", "get_vocab_size"} <= meta.keys():
        raise UserError(
            f"{pte_path} carries no runner metadata (get_max_context_len, get_vocab_size)",
            fix="re-export it with qharness export",
        )
    check_lengths(prompt_len, decode_tokens, reps, meta["get_max_context_len"])
    return meta["get_vocab_size"]


def bench(
    pte_path: str | Path,
    model_dir: str | None = None,
    prompt_len: int = 128,
    decode_tokens: int = 64,
    reps: int = 5,
    threads: int | None = None,
) -> Bench:
    """Measure the ``.pte`` and, when ``model_dir`` is given, the eager FP model it came from (both with ``threads``,
    default: the cores free now)."""
    from qharness.runtime.pte import free_cores

    args = {
        "vocab_size": pte_vocab(pte_path, prompt_len, decode_tokens, reps),
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "reps": reps,
        "threads": threads or free_cores(),
    }
    machine = {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "bandwidth_gb_s": memory_bandwidth()}
    models = {"pte": str(pte_path)} | ({"eager": str(model_dir)} if model_dir else {})
    measured: dict[str, ModelBench] = {}
    for kind, path in models.items():
        with stage(
            f"benchmarking the {'.pte' if kind == 'pte' else 'eager FP model'} ({reps} reps + warm-up, {args['threads']} threads, fresh process)"
        ):
            m = ModelBench.from_json(measure_in_fresh_process(kind=kind, path=path, **args))
        fraction = m.decode_tok_s.median * m.weight_bytes / (machine["bandwidth_gb_s"] * 1e9)
        measured[kind] = replace(m, bandwidth_fraction=fraction)
    ratios = None
    if model_dir:
        p, e = measured["pte"], measured["eager"]
        ratios = PteVsEager(
            prefill_speedup=p.prefill_tok_s.median / e.prefill_tok_s.median,
            decode_speedup=p.decode_tok_s.median / e.decode_tok_s.median,
            size_ratio=p.size_bytes / e.size_bytes,
            peak_rss_ratio=p.peak_rss_mb / e.peak_rss_mb,
        )
    return Bench(**args, **machine, pte=measured["pte"], eager=measured.get("eager"), pte_vs_eager=ratios)


def format_bench(r: Bench) -> str:
    def spread(s, scale=1.0, fmt=".0f"):
        return f"{s.median * scale:{fmt}} ({s.min * scale:{fmt}}-{s.max * scale:{fmt}})"

    rows = [("model", "load ms", "prefill tok/s", "decode tok/s", "peak RSS MB", "size MB", "decode/bw bound")]
    for m, label in ((r.pte, ".pte (ExecuTorch)"), (r.eager, "eager FP (PyTorch)")):
        if m is not None:
            rows.append(
                (
                    label,
                    spread(m.load_s, 1e3, ".1f"),
                    spread(m.prefill_tok_s),
                    spread(m.decode_tok_s),
                    f"{m.peak_rss_mb:.0f} (base {m.base_rss_mb:.0f})",
                    f"{m.size_bytes / 1e6:.2f}",
                    f"{m.bandwidth_fraction:.1%}",
                )
            )
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        f"bench: prompt {r.prompt_len} tokens, {r.decode_tokens} decode steps, {r.reps} reps "
        f"(median (min-max)), {r.threads or '?'} threads; copy bandwidth {r.bandwidth_gb_s:.1f} GB/s; load average {r.load_avg_1m:.1f} on {r.cpus} CPUs"
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, width)) for row in rows]
    if r.pte_vs_eager is not None:
        x = r.pte_vs_eager
        lines.append(
            f".pte vs eager: prefill x{x.prefill_speedup:.2f}, decode x{x.decode_speedup:.2f}, "
            f"size x{x.size_ratio:.2f}, peak RSS x{x.peak_rss_ratio:.2f}"
        )
    return "\n".join(lines)
