"""Benchmark: load time, prefill and decode tokens/s, peak RSS and size of a ``.pte`` and of the eager FP model.

Each model is measured in a fresh Python process (so its peak RSS is its own): per repetition it is
loaded, prefilled with ``prompt_len`` random tokens in one call, then decodes ``decode_tokens`` tokens
one at a time through its KV cache. Medians and min/max over the repetitions are reported, after one
uncounted warm-up repetition. Every process runs with the same thread count, chosen once per benchmark
(``runtime.free_cores``: the cores idle right now), for ExecuTorch's threadpool and torch's intra-op threads.

Fresh processes of one program still differ more than repetitions inside one (BENCHMARKS.md, "Timing
method"), so comparisons of programs use ``interleaved``: ``processes`` fresh processes per program in
round-robin order (A B C A B C ...), reported per program as the median over processes of the per-process
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

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from qharness.config import check_lengths
from qharness.errors import UserError
from qharness.progress import stage
from qharness.upstream import process


def memory_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Copy bandwidth in GB/s (bytes read + written, best of ``reps``) of a ``mib`` MiB tensor, torch's threads."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


class EagerStep:
    """The eager FP model as ``step(tokens[1, n], start) -> logits`` over its own (dynamic) KV cache."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cache = None

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        out = self.model(input_ids=tokens, past_key_values=None if start == 0 else self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux ``VmHWM``; ``ru_maxrss`` would include the parent's peak
    from before ``exec``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (peak RSS is measured on Linux only)")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def spread(values: list[float]) -> dict:
    """``{"median", "min", "max", "per_process"}`` of per-process values (e.g. each process's median tok/s)."""
    if not values:
        raise ValueError("spread of no values")
    return {**_spread(values), "per_process": list(values)}


def max_over_min(s: dict) -> float:
    """How far apart the processes were: max/min of a ``spread`` (1.0: identical)."""
    return s["max"] / s["min"]


def pair_ratios(a: list[float], b: list[float]) -> dict:
    """``spread`` of ``a[k] / b[k]``: program A against B process by process (the same round of an interleaved run)."""
    if len(a) != len(b):
        raise ValueError(f"pair_ratios needs as many values of A as of B ({len(a)} vs {len(b)})")
    return spread([x / y for x, y in zip(a, b)])


def verdict(s: dict, target: float, higher_is_better: bool) -> str:
    """ "MET" when the whole spread meets ``target``, "NOT MET" when none of it does, else "TIE/UNDECIDED"."""
    lo, hi = s["min"], s["max"]
    if (lo >= target) if higher_is_better else (hi <= target):
        return "MET"
    if (hi < target) if higher_is_better else (lo > target):
        return "NOT MET"
    return "TIE/UNDECIDED"


def format_spread(s: dict, fmt: str = ".2f") -> str:
    """``0.93 (0.88-0.99)``: median (min-max)."""
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def measure(
    kind: str, path: str, vocab_size: int, prompt_len: int, decode_tokens: int, reps: int, threads: int | None = None
) -> dict:
    """One model (``kind`` "pte" or "eager") in this process; call it in a fresh one (``measure_in_fresh_process``).
    ``threads``: ExecuTorch threadpool and torch intra-op threads (None: ``runtime_threads()``'s choice for a .pte,
    torch's default for eager)."""
    if kind == "pte":
        from qharness.runtime.pte import PteModel as load
        from qharness.runtime.pte import runtime_threads, set_runtime_threads
        from qharness.upstream import imports

        imports.executorch_runtime()  # libraries imported before the baseline RSS, as transformers is for eager
        if threads:
            set_runtime_threads(threads)
    else:
        import transformers  # noqa: F401

        if threads:
            torch.set_num_threads(threads)
        load = EagerStep
    base_rss = peak_rss_mb()
    gc.freeze()  # the imports' objects: each rep's gc.collect() then scans only what the reps made (0.2 s -> ~0)
    gen = torch.Generator().manual_seed(0)
    loads, prefill, decode, cpu_share, decode_cpu = [], [], [], [], []
    with torch.no_grad():
        for rep in range(reps + 1):  # rep 0 warms up (lazy imports, allocator, file cache) and is not counted
            step = None
            gc.collect()
            t = time.perf_counter()
            step = load(path)
            load_s = time.perf_counter() - t
            prompt = torch.randint(0, vocab_size, (1, prompt_len), generator=gen)
            t = time.perf_counter()
            logits = step(prompt, 0)
            prefill_s = time.perf_counter() - t
            t, cpu = time.perf_counter(), time.process_time()
            for i in range(decode_tokens):
                logits = step(
                    logits.reshape(1, -1, logits.shape[-1])[:, -1:].argmax(-1), prompt_len + i
                )  # [1, vocab] too
            decode_s = time.perf_counter() - t
            if rep > 0:
                loads.append(load_s)
                prefill.append(prompt_len / prefill_s)
                decode.append(decode_tokens / decode_s)
                cpu_s = time.process_time() - cpu
                cpu_share.append(cpu_s / decode_s)  # < threads: the process waited for a core
                decode_cpu.append(
                    decode_tokens / max(cpu_s, 1e-9)
                )  # tokens per CPU-second: blind to waiting for a core
    # weight_bytes: what one decode step reads of the weights: all but the embedding tables (one row each), the lm_head
    # whole (also when it shares the embedding's weight)
    if kind == "pte":
        from qharness.runtime.pte import embedding_bytes

        size_bytes = Path(path).stat().st_size
        weight_bytes = size_bytes - embedding_bytes(path)
    else:
        model = step.model
        embedding = model.get_input_embeddings().weight
        head = getattr(model.get_output_embeddings(), "weight", None)  # None: no separate output layer
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if embedding is not head:
            weight_bytes -= embedding.numel() * embedding.element_size()
        size_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    return {
        "load_s": _spread(loads),
        "prefill_tok_s": _spread(prefill),
        "decode_tok_s": _spread(decode),
        "decode_cpu_share": _spread(cpu_share),
        "decode_tok_per_cpu_s": _spread(decode_cpu),
        "threads": torch.get_num_threads() if kind == "eager" else runtime_threads(),
        "peak_rss_mb": peak_rss_mb(),
        "base_rss_mb": base_rss,
        "size_bytes": size_bytes,
        "weight_bytes": weight_bytes,
    }


def measure_in_fresh_process(**kwargs) -> dict:
    """``measure(**kwargs)`` in a new interpreter that imports this same qharness (not an installed copy)."""
    paths = [
        str(Path(__file__).resolve().parents[2]),
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    r = subprocess.run(
        process.python_command("-m", "qharness.runtime.bench", json.dumps(kwargs)),
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=process.die_with_parent(),  # a killed run leaves no benchmark running on
    )
    if r.returncode != 0:
        raise RuntimeError(f"benchmark of {kwargs['path']} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


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
) -> dict:
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
    result = {**args, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "bandwidth_gb_s": memory_bandwidth()}
    models = {"pte": str(pte_path)} | ({"eager": str(model_dir)} if model_dir else {})
    for kind, path in models.items():
        with stage(
            f"benchmarking the {'.pte' if kind == 'pte' else 'eager FP model'} ({reps} reps + warm-up, {args['threads']} threads, fresh process)"
        ):
            m = measure_in_fresh_process(kind=kind, path=path, **args)
        m["bandwidth_fraction"] = m["decode_tok_s"]["median"] * m["weight_bytes"] / (result["bandwidth_gb_s"] * 1e9)
        result[kind] = m
    if model_dir:
        p, e = result["pte"], result["eager"]
        result["pte_vs_eager"] = {
            "prefill_speedup": p["prefill_tok_s"]["median"] / e["prefill_tok_s"]["median"],
            "decode_speedup": p["decode_tok_s"]["median"] / e["decode_tok_s"]["median"],
            "size_ratio": p["size_bytes"] / e["size_bytes"],
            "peak_rss_ratio": p["peak_rss_mb"] / e["peak_rss_mb"],
        }
    return result


JOINT_KEYS = ("decode_tok_s", "prefill_tok_s", "decode_ms_per_token")


def interleaved(
    programs: dict[str, dict],
    prompt_len: int,
    decode_tokens: int,
    reps: int,
    processes: int,
    threads: int | None = None,
    log=print,
) -> dict:
    """Time every program in ``processes`` fresh processes each, round-robin (A B C A B C ...), all with the same
    thread count (default: the cores free now). ``programs``: name -> ``{"kind": "pte"|"eager", "path", "vocab_size"}``.

    Returns ``{"processes", "order": "round-robin", "load_avg_1m": [before, after], "threads", "prompt_len",
    "decode_tokens", "reps", "sequence": [program names in the order run], "programs": {name: {"path", "kind", "decode_tok_s",
    "prefill_tok_s", "decode_ms_per_token", "decode_cpu_share", "decode_tok_per_cpu_s", "size_bytes", "weight_bytes"}}}``;
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
        for name, p in programs.items():
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
        "order": "round-robin",
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
) -> dict:
    """``interleaved`` over ``.pte`` files (names: ``names`` or the paths), their lengths checked first."""
    names = names or [str(p) for p in pte_paths]
    if len(set(names)) != len(names):
        raise UserError(f"bench: the same .pte given twice ({names})", fix="pass each --pte once")
    programs = {
        n: {"kind": "pte", "path": str(p), "vocab_size": pte_vocab(p, prompt_len, decode_tokens, reps)}
        for n, p in zip(names, pte_paths)
    }
    return interleaved(programs, prompt_len, decode_tokens, reps, processes, threads, log)


def joint_entry(joint: dict, name: str) -> dict:
    """One program's ``bench_joint`` section for its summary.json (the shape the report reads)."""
    p = joint["programs"][name]
    return {
        "processes": joint["processes"],
        "order": joint["order"],
        "load_avg_1m": joint["load_avg_1m"],
        "threads": joint["threads"],
        **{k: p[k] for k in JOINT_KEYS},
    }


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
    head = (
        f"bench (joint): {j['processes']} fresh processes per program, round-robin, {j['threads']} threads; prompt {j['prompt_len']} tokens, "
        f"{j['decode_tokens']} decode steps, {j['reps']} reps per process; median (min-max) of the process medians; "
        f"load average {j['load_avg_1m'][0]:.1f} -> {j['load_avg_1m'][1]:.1f} on {os.cpu_count()} CPUs"
    )
    return "\n".join([head] + ["  ".join(c.ljust(w) for c, w in zip(row, width)) for row in rows])


def format_bench(r: dict) -> str:
    def spread(s, scale=1.0, fmt=".0f"):
        return f"{s['median'] * scale:{fmt}} ({s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}})"

    rows = [("model", "load ms", "prefill tok/s", "decode tok/s", "peak RSS MB", "size MB", "decode/bw bound")]
    for kind, label in (("pte", ".pte (ExecuTorch)"), ("eager", "eager FP (PyTorch)")):
        if kind in r:
            m = r[kind]
            rows.append(
                (
                    label,
                    spread(m["load_s"], 1e3, ".1f"),
                    spread(m["prefill_tok_s"]),
                    spread(m["decode_tok_s"]),
                    f"{m['peak_rss_mb']:.0f} (base {m['base_rss_mb']:.0f})",
                    f"{m['size_bytes'] / 1e6:.2f}",
                    f"{m['bandwidth_fraction']:.1%}",
                )
            )
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        f"bench: prompt {r['prompt_len']} tokens, {r['decode_tokens']} decode steps, {r['reps']} reps "
        f"(median (min-max)), {r.get('threads', '?')} threads; copy bandwidth {r['bandwidth_gb_s']:.1f} GB/s; load average {r['load_avg_1m']:.1f} on {r['cpus']} CPUs"
    ]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, width)) for row in rows]
    if "pte_vs_eager" in r:
        x = r["pte_vs_eager"]
        lines.append(
            f".pte vs eager: prefill x{x['prefill_speedup']:.2f}, decode x{x['decode_speedup']:.2f}, "
            f"size x{x['size_ratio']:.2f}, peak RSS x{x['peak_rss_ratio']:.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # the fresh process of measure_in_fresh_process
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
