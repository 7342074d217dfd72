"""Programs timed jointly: ``processes`` fresh processes per program in rounds of one process each, every other
round in reverse (A B C, C B A, A B C, ...: ``round_order``), all with one thread count, each program reported as
the ``spread`` of its process medians; and the table of them.

Why reverse: a program's place in the round moves its timing (at SmolLM2-135M, one FP32 program timed first in every
round was 1.14x slower than its peer, 0.87x with the peer first; docs/benchmarks/phone-scale.md). Reversing every
other round gives every program the same mean place over each two rounds, so an effect of the place (or a drift over
the session) falls on all programs alike; ratios are still taken round by round (``spread.pair_ratios``).

Programs of one structure (``deploy/structure.py``: the same operators, shapes and delegates, only weight values
differ, e.g. a PTQ, a GPTQ and a QAT program of one recipe) are one latency class (``pool_classes``): each is timed in
the rounds like any other, and every member is reported with the spread of all members' process medians pooled,
so noise cannot rank them.
"""

from __future__ import annotations

import os
from pathlib import Path

from qharness.errors import UserError
from qharness.runtime.bench import pte_vocab
from qharness.runtime.bench_record import JointEntry, Spread
from qharness.runtime.measure import measure_in_fresh_process
from qharness.runtime.spread import format_spread, max_over_min, spread

JOINT_KEYS = ("decode_tok_s", "prefill_tok_s", "decode_ms_per_token")
TIMING_KEYS = (*JOINT_KEYS, "decode_cpu_share", "decode_tok_per_cpu_s")  # what a latency class pools


def round_order(names: list[str], k: int) -> list[str]:
    """The order of round ``k`` (from 0): ``names`` in even rounds, reversed in odd ones.

    >>> [round_order(["A", "B", "C"], k) for k in range(3)]
    [['A', 'B', 'C'], ['C', 'B', 'A'], ['A', 'B', 'C']]
    """
    return list(names) if k % 2 == 0 else list(reversed(names))


def interleaved(
    programs: dict[str, dict],
    prompt_len: int,
    decode_tokens: int,
    reps: int,
    processes: int,
    threads: int | None = None,
    log=print,
) -> dict:
    """Time every program in ``processes`` fresh processes each, in rounds of one process per program, every other
    round reversed (``round_order``: A B C, C B A, ...), all with the same thread count (default: the cores free
    now). ``programs``: name -> ``{"kind": "pte"|"eager", "path", "vocab_size"}``.

    Returns ``{"processes", "order": "alternating", "load_avg_1m": [before, after], "threads", "prompt_len",
    "decode_tokens", "reps", "sequence": [program names in the order run], "programs": {name: {"path", "kind", "decode_tok_s",
    "prefill_tok_s", "decode_ms_per_token", "decode_cpu_share", "decode_tok_per_cpu_s", "load_s", "peak_rss_mb",
    "size_bytes", "weight_bytes"}}}``;
    each timing is a ``spread`` of the per-process medians (ms/token derived per process). ``decode_cpu_share``
    (CPU time / wall time while decoding) below the thread count says the process waited for a core;
    ``decode_tok_per_cpu_s`` is decode speed per CPU-second, which such waiting does not move.
    """
    from qharness.runtime.pte import free_cores

    if processes < 1:
        raise UserError(
            f"bench processes must be >= 1 (got {processes})", fix="pass --processes 5 (or report.bench_processes: 5)"
        )
    threads = threads or free_cores()
    before = os.getloadavg()[0]
    runs = {name: [] for name in programs}
    order = []
    for k in range(processes):
        for name in round_order(list(programs), k):
            p = programs[name]
            log(f"[bench] process {k + 1}/{processes}: {name} ({threads} threads, load {os.getloadavg()[0]:.1f})")
            runs[name].append(
                measure_in_fresh_process(
                    kind=p["kind"],
                    path=str(p["path"]),
                    vocab_size=p["vocab_size"],
                    prompt_len=prompt_len,
                    decode_tokens=decode_tokens,
                    reps=reps,
                    threads=threads,
                )
            )
            order.append(name)
    out = {
        "processes": processes,
        "order": "alternating",  # round_order's rounds
        "load_avg_1m": [before, os.getloadavg()[0]],
        "threads": threads,
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "reps": reps,
        "sequence": order,
        "programs": {},
    }
    for name, ms in runs.items():
        decode = [m["decode_tok_s"]["median"] for m in ms]
        out["programs"][name] = {
            "kind": programs[name]["kind"],
            "path": str(programs[name]["path"]),
            "decode_tok_s": spread(decode),
            "prefill_tok_s": spread([m["prefill_tok_s"]["median"] for m in ms]),
            "decode_ms_per_token": spread([1e3 / d for d in decode]),
            "decode_cpu_share": spread([m["decode_cpu_share"]["median"] for m in ms]),
            "decode_tok_per_cpu_s": spread([m["decode_tok_per_cpu_s"]["median"] for m in ms]),
            **({"load_s": spread([m["load_s"]["median"] for m in ms])} if all("load_s" in m for m in ms) else {}),
            **({"peak_rss_mb": spread([m["peak_rss_mb"] for m in ms])} if all("peak_rss_mb" in m for m in ms) else {}),
            "size_bytes": ms[0]["size_bytes"],
            "weight_bytes": ms[0]["weight_bytes"],
        }
    return out


def bench_jointly(
    pte_paths: list[str | Path],
    prompt_len: int = 128,
    decode_tokens: int = 64,
    reps: int = 10,
    processes: int = 5,
    threads: int | None = None,
    names: list[str] | None = None,
    log=print,
    classes: dict[str, str | None] | None = None,
) -> dict:
    """``interleaved`` over ``.pte`` files (names: ``names`` or the paths), their lengths checked first; with
    ``classes`` (name -> structure digest), programs of one structure pooled into one latency class
    (``pool_classes``)."""
    names = names or [str(p) for p in pte_paths]
    if len(set(names)) != len(names):
        raise UserError(f"bench: the same .pte given twice ({names})", fix="pass each --pte once")
    programs = {
        n: {"kind": "pte", "path": str(p), "vocab_size": pte_vocab(p, prompt_len, decode_tokens, reps)}
        for n, p in zip(names, pte_paths)
    }
    joint = interleaved(programs, prompt_len, decode_tokens, reps, processes, threads, log)
    return pool_classes(joint, classes) if classes else joint


def latency_classes(classes: dict[str, str | None]) -> list[list[str]]:
    """The groups of two or more programs with one structure digest (``classes``: name -> digest; None: a program
    of unknown structure, a class of its own), in the order of ``classes``."""
    groups: dict[str, list[str]] = {}
    for name, digest in classes.items():
        if digest is not None:
            groups.setdefault(digest, []).append(name)
    return [members for members in groups.values() if len(members) > 1]


def pool_classes(joint: dict, classes: dict[str, str | None]) -> dict:
    """``joint`` (``interleaved``'s result) with each latency class (``latency_classes``: programs of one structure)
    reported as one figure: every member's timings become the ``spread`` of all members' process medians, pooled
    round by round (so ``per_process`` holds ``processes`` x members values), its ``latency_class`` the members and
    ``unpooled`` its own spreads (kept in ``bench_joint.json``, read by no ranking)."""
    programs = joint["programs"]
    for members in latency_classes({n: classes.get(n) for n in programs}):
        pooled = {
            k: spread([programs[m][k]["per_process"][r] for r in range(joint["processes"]) for m in members])
            for k in TIMING_KEYS
        }
        for m in members:
            programs[m] = {
                **programs[m],
                "unpooled": {k: programs[m][k] for k in TIMING_KEYS},
                **pooled,
                "latency_class": list(members),
            }
    return joint


def joint_entry(joint: dict, name: str) -> JointEntry:
    """One program's ``bench_joint`` section for its summary.json (what the report reads). ``joint`` (all programs,
    ``interleaved``'s result) stays plain data: it is written whole to ``bench_joint.json`` and keyed by program."""
    p = joint["programs"][name]
    return JointEntry(
        processes=joint["processes"],
        order=joint["order"],
        load_avg_1m=joint["load_avg_1m"],
        threads=joint["threads"],
        **{k: Spread(**p[k]) for k in JOINT_KEYS},
        latency_class=p.get("latency_class"),
    )


def format_joint(j: dict) -> str:
    rows = [
        (
            "program",
            "decode tok/s",
            "decode ms/token",
            "max/min",
            "prefill tok/s",
            "max/min",
            "CPU share",
            "decode tok/CPU-s",
            "max/min",
        )
    ]
    for name, p in j["programs"].items():
        rows.append(
            (
                name,
                format_spread(p["decode_tok_s"], ".0f"),
                format_spread(p["decode_ms_per_token"], ".3f"),
                f"{max_over_min(p['decode_tok_s']):.2f}",
                format_spread(p["prefill_tok_s"], ".0f"),
                f"{max_over_min(p['prefill_tok_s']):.2f}",
                format_spread(p["decode_cpu_share"]),
                format_spread(p["decode_tok_per_cpu_s"], ".0f"),
                f"{max_over_min(p['decode_tok_per_cpu_s']):.2f}",
            )
        )
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    classes = {tuple(p["latency_class"]) for p in j["programs"].values() if p.get("latency_class")}
    pooled = [
        f"one latency class (one structure, timed together, samples pooled, one figure): {', '.join(c)}"
        for c in sorted(classes)
    ]
    head = (
        f"bench (joint): {j['processes']} fresh processes per program, in rounds (every other one reversed), "
        f"{j['threads']} threads; prompt {j['prompt_len']} tokens, "
        f"{j['decode_tokens']} decode steps, {j['reps']} reps per process; median (min-max) of the process medians; "
        f"load average {j['load_avg_1m'][0]:.1f} -> {j['load_avg_1m'][1]:.1f} on {os.cpu_count()} CPUs"
    )
    return "\n".join([head] + ["  ".join(c.ljust(w) for c, w in zip(row, width)) for row in rows] + pooled)
