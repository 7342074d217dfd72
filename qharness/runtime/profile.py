"""Where a ``.pte``'s time goes, operator by operator, from ExecuTorch's ETDump (its event tracer).

A prefill of ``prompt_len`` random tokens, then ``decode_tokens`` single-token steps, ``reps`` times, in this process
with the tracer on; every event is summed by name (medians over the reps and steps). XNNPACK's own events (``Fully
Connected (NC, QDU8, F32, QB4W) GEMM``, ...) are the delegate's kernels, inside its ``DELEGATE_CALL``;
``native_call_<op>`` are the operators that run outside a delegate (portable, quantized or custom kernels:
``llama::custom_sdpa``, ``update_cache``). Example::

    p = profile_pte("runs/x/model.pte", vocab_size=2048)
    p["decode"]["DELEGATE_CALL"]   # {"calls": per decode step, "ms": per decode step}
    print(format_profiles({"ours": p, "theirs": profile_pte("theirs.pte", vocab_size=2048)}, "decode"))

The tracer costs time of its own, and one kernel's traced time moved up to 2x between fresh processes here: compare
programs' structure (kernels, calls) with it, and time them with ``qharness bench``.
"""

from __future__ import annotations

import re
import statistics
import tempfile
from pathlib import Path

import torch

from qharness.upstream import imports

WRAPPERS = ("OPERATOR_CALL",)  # each wraps one native_call_<op> event: counted once, under the op's name
_INSTANCE = re.compile(r" #\d+$")  # XNNPACK numbers each operator instance: "Add (ND) #3"


def event_name(name: str) -> str:
    """The name events are summed under: XNNPACK's instance number dropped, ``native_call_`` prefix dropped.

    Example::

        event_name("Fully Connected (NC, F32) GEMM #12")   # "Fully Connected (NC, F32) GEMM"
        event_name("native_call_custom_sdpa.out")          # "custom_sdpa.out"
    """
    name = _INSTANCE.sub("", name)
    return name[len("native_call_") :] if name.startswith("native_call_") else name


def traced_events(
    path: str | Path, vocab_size: int, prompt_len: int = 128, decode_tokens: int = 16, reps: int = 3, seed: int = 0
) -> tuple[list[dict], int, int]:
    """Every traced event of one ``.pte`` whose forward is ``(tokens, start) -> logits``, in the order it ran:
    ``[{"name", "delegated", "raw": [ms per counted call]}]`` (one entry per operator instance; wrappers and events
    of loading left out), with ``reps`` prefills and ``decode_tokens`` steps each, after a warm-up of one of each;
    returns ``(events, reps, calls per rep)`` (call ``r * per_rep`` is a prefill, the others decode steps)."""
    from qharness.runtime.pte import present_data_file, runtime_threads

    runtime_threads()  # the same threadpool size as qharness bench's processes
    data = present_data_file(path)  # a tied table stored once lives there (deploy/shared_table.py)
    program = imports.executorch_profiled_program(str(path), str(data) if data else None)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (1, prompt_len), generator=g)
    tokens = torch.randint(0, vocab_size, (max(1, decode_tokens), 1), generator=g)
    for steps in [1] + [decode_tokens] * reps:  # a warm-up (first calls allocate), then the profiled calls
        program.forward((prompt, torch.tensor([0], dtype=torch.long)))
        for i in range(steps):
            program.forward((tokens[i : i + 1], torch.tensor([prompt_len + i], dtype=torch.long)))
    skip, per_rep = 2, 1 + decode_tokens  # the warm-up's two calls are not counted
    runs = skip + reps * per_rep
    events = []
    with tempfile.TemporaryDirectory() as d:
        etdump = Path(d) / "profile.etdp"
        program.write_etdump_result_to_file(str(etdump))
        for block in imports.etdump_inspector(str(etdump)).event_blocks:
            for event in block.events:
                if event.name in WRAPPERS or event.perf_data is None or len(event.perf_data.raw) != runs:
                    continue  # a wrapper, or an event of loading or another method, not of these calls
                events.append(
                    {
                        "name": event.name,
                        "delegated": bool(event.is_delegated_op),
                        "raw": list(event.perf_data.raw)[skip:],
                    }
                )
    return events, reps, per_rep


def decode_medians(events: list[dict], reps: int, per_rep: int) -> list[float]:
    """Each event's median ms over the decode steps (every call but each rep's first, the prefill)."""
    return [
        statistics.median(e["raw"][r * per_rep + k] for r in range(reps) for k in range(1, per_rep))
        if per_rep > 1
        else 0.0
        for e in events
    ]


def profile_pte(
    path: str | Path, vocab_size: int, prompt_len: int = 128, decode_tokens: int = 16, reps: int = 3, seed: int = 0
) -> dict:
    """``{"prefill": {name: {"calls", "ms"}}, "decode": {name: {"calls", "ms"}}, "delegated": [names]}`` of one
    ``.pte`` whose forward is ``(tokens, start) -> logits``: ``reps`` times a prefill and ``decode_tokens`` steps
    (after a warm-up of one of each); ``calls`` per prefill or decode step, ``ms`` the median over the reps
    (prefill) or over every decode step."""
    events, reps, per_rep = traced_events(path, vocab_size, prompt_len, decode_tokens, reps, seed)
    totals: dict[str, list[float]] = {}  # per name: ms summed over its instances, one entry per call
    calls: dict[str, int] = {}
    delegated: set[str] = set()
    for event in events:
        name = event_name(event["name"])
        if event["delegated"]:
            delegated.add(name)
        old = totals.setdefault(name, [0.0] * len(event["raw"]))
        totals[name] = [a + b for a, b in zip(old, event["raw"])]
        calls[name] = calls.get(name, 0) + 1
    prefill, decode = {}, {}
    for name, ms in totals.items():
        prefill[name] = {"calls": calls[name], "ms": statistics.median(ms[r * per_rep] for r in range(reps))}
        steps = [ms[r * per_rep + k] for r in range(reps) for k in range(1, per_rep)]
        decode[name] = {"calls": calls[name], "ms": statistics.median(steps) if steps else 0.0}
    return {"prefill": prefill, "decode": decode, "delegated": sorted(delegated)}


def format_profiles(profiles: dict[str, dict], phase: str = "decode", top: int = 25) -> str:
    """Side by side: per event name, calls and ms of each profile in ``phase`` (``prefill`` or ``decode``), the
    largest first; delegate kernels marked ``[xnnpack]``, the rest run outside the delegate."""
    names = sorted(
        {n for p in profiles.values() for n in p[phase]},
        key=lambda n: -max(p[phase].get(n, {"ms": 0.0})["ms"] for p in profiles.values()),
    )
    head = ["event (" + phase + (" step" if phase == "decode" else "") + ")"]
    for label in profiles:
        head += [f"{label} calls", f"{label} ms"]
    rows = [head]
    for n in names[:top]:
        tag = " [xnnpack]" if any(n in p["delegated"] for p in profiles.values()) else ""
        row = [n + tag]
        for p in profiles.values():
            e = p[phase].get(n)
            row += [str(e["calls"]), f"{e['ms']:.3f}"] if e else ["-", "-"]
        rows.append(row)
    width = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows)
