"""Benchmark: load time, prefill and decode tokens/s, peak RSS and size of a ``.pte`` and of the eager FP model.

Each model is measured in a fresh Python process (so its peak RSS is its own): per repetition it is
loaded, prefilled with ``prompt_len`` random tokens in one call, then decodes ``decode_tokens`` tokens
one at a time through its KV cache. Medians and min/max over the repetitions are reported, after one
uncounted warm-up repetition. A measured memory-copy bandwidth gives the bound decode would hit if every
token read all weights from memory once: ``bandwidth_fraction = decode tok/s * weight bytes / bandwidth``
(above 1: the weights sit in CPU caches).

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

from qharness.errors import UserError
from qharness.progress import stage


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


def check_lengths(prompt_len: int, decode_tokens: int, reps: int, max_context_len: int) -> None:
    if prompt_len < 1 or decode_tokens < 1 or reps < 1:
        raise UserError(f"bench prompt_len, decode_tokens and reps must be >= 1 (got {prompt_len}, {decode_tokens}, {reps})")
    if prompt_len + decode_tokens > max_context_len:
        raise UserError(
            f"bench prompt_len + decode_tokens = {prompt_len + decode_tokens} exceeds the .pte's KV cache ({max_context_len} positions)",
            fix=f"keep prompt_len + decode_tokens <= {max_context_len} (bench.* options), or export with a larger deploy.max_seq_len",
        )


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


def measure(kind: str, path: str, vocab_size: int, prompt_len: int, decode_tokens: int, reps: int) -> dict:
    """One model (``kind`` "pte" or "eager") in this process; call it in a fresh one (``measure_in_fresh_process``)."""
    if kind == "pte":
        from qharness.upstream import imports
        from qharness.runtime.pte import PteModel as load

        imports.executorch_runtime()  # libraries imported before the baseline RSS, as transformers is for eager
    else:
        import transformers  # noqa: F401

        load = EagerStep
    base_rss = peak_rss_mb()
    gen = torch.Generator().manual_seed(0)
    loads, prefill, decode = [], [], []
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
            t = time.perf_counter()
            for i in range(decode_tokens):
                logits = step(logits.reshape(1, -1, logits.shape[-1])[:, -1:].argmax(-1), prompt_len + i)  # [1, vocab] too
            decode_s = time.perf_counter() - t
            if rep > 0:
                loads.append(load_s)
                prefill.append(prompt_len / prefill_s)
                decode.append(decode_tokens / decode_s)
    if kind == "pte":
        weight_bytes = size_bytes = Path(path).stat().st_size
    else:
        weight_bytes = sum(p.numel() * p.element_size() for p in step.model.parameters())
        size_bytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    return {
        "load_s": _spread(loads),
        "prefill_tok_s": _spread(prefill),
        "decode_tok_s": _spread(decode),
        "peak_rss_mb": peak_rss_mb(),
        "base_rss_mb": base_rss,
        "size_bytes": size_bytes,
        "weight_bytes": weight_bytes,
    }


def measure_in_fresh_process(**kwargs) -> dict:
    """``measure(**kwargs)`` in a new interpreter that imports this same qharness (not an installed copy)."""
    paths = [str(Path(__file__).resolve().parents[2]), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    r = subprocess.run([sys.executable, "-m", "qharness.runtime.bench", json.dumps(kwargs)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"benchmark of {kwargs['path']} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


def bench(pte_path: str | Path, model_dir: str | None = None, prompt_len: int = 128, decode_tokens: int = 64, reps: int = 5) -> dict:
    """Measure the ``.pte`` and, when ``model_dir`` is given, the eager FP model it came from."""
    from qharness.runtime.pte import PteModel

    meta = PteModel(pte_path).metadata()
    if not {"get_max_context_len", "get_vocab_size"} <= meta.keys():
        raise UserError(f"{pte_path} carries no runner metadata (get_max_context_len, get_vocab_size)", fix="re-export it with qharness export")
    check_lengths(prompt_len, decode_tokens, reps, meta["get_max_context_len"])
    args = {"vocab_size": meta["get_vocab_size"], "prompt_len": prompt_len, "decode_tokens": decode_tokens, "reps": reps}
    result = {**args, "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "bandwidth_gb_s": memory_bandwidth()}
    models = {"pte": str(pte_path)} | ({"eager": str(model_dir)} if model_dir else {})
    for kind, path in models.items():
        with stage(f"benchmarking the {'.pte' if kind == 'pte' else 'eager FP model'} ({reps} reps + warm-up, fresh process)"):
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


def format_bench(r: dict) -> str:
    def spread(s, scale=1.0, fmt=".0f"):
        return f"{s['median'] * scale:{fmt}} ({s['min'] * scale:{fmt}}-{s['max'] * scale:{fmt}})"

    rows = [("model", "load ms", "prefill tok/s", "decode tok/s", "peak RSS MB", "size MB", "decode/bw bound")]
    for kind, label in (("pte", ".pte (ExecuTorch)"), ("eager", "eager FP (PyTorch)")):
        if kind in r:
            m = r[kind]
            rows.append((label, spread(m["load_s"], 1e3, ".1f"), spread(m["prefill_tok_s"]), spread(m["decode_tok_s"]),
                         f"{m['peak_rss_mb']:.0f} (base {m['base_rss_mb']:.0f})", f"{m['size_bytes'] / 1e6:.2f}", f"{m['bandwidth_fraction']:.1%}"))
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"bench: prompt {r['prompt_len']} tokens, {r['decode_tokens']} decode steps, {r['reps']} reps "
             f"(median (min-max)); copy bandwidth {r['bandwidth_gb_s']:.1f} GB/s; load average {r['load_avg_1m']:.1f} on {r['cpus']} CPUs"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, width)) for row in rows]
    if "pte_vs_eager" in r:
        x = r["pte_vs_eager"]
        lines.append(f".pte vs eager: prefill x{x['prefill_speedup']:.2f}, decode x{x['decode_speedup']:.2f}, "
                     f"size x{x['size_ratio']:.2f}, peak RSS x{x['peak_rss_ratio']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":  # the fresh process of measure_in_fresh_process
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
