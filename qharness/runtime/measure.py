"""One model timed in a fresh Python process (so its peak RSS is its own): per repetition it is loaded, prefilled
with ``prompt_len`` random tokens in one call, then decodes ``decode_tokens`` tokens one at a time through its KV
cache; medians and min/max over the repetitions, after one uncounted warm-up repetition. Also the memory-copy
bandwidth that bounds decode.
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

from qharness.runtime.spread import median_range
from qharness.upstream import process


def copy_rate(mib: int = 256, reps: int = 3) -> float:
    """GB/s (bytes read + written) of the best of ``reps`` copies between two fresh ``mib`` MiB tensors."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def memory_bandwidth(mib: int = 256, samples: int = 7) -> float:
    """Copy bandwidth in GB/s (bytes read + written), torch's threads: the median of ``samples`` ``copy_rate``s, each
    between fresh tensors. One alone is not enough: here one measurement in 16 (a pair's best of 5 copies, each in a
    fresh process) read 74 GB/s against 35-45 GB/s for the others, and a bound taken from it halves every fraction
    of it."""
    return statistics.median(copy_rate(mib) for _ in range(samples))


class EagerStep:
    """The eager FP model as ``step(tokens[1, n], start) -> logits`` over its own (dynamic) KV cache."""

    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        from qharness.deploy.fastpath.kv_cache import cache_argument

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.cache, self.cache_argument = None, cache_argument(self.model)

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        cache = None if start == 0 else self.cache
        out = self.model(input_ids=tokens, use_cache=True, **{self.cache_argument: cache})
        self.cache = out.past_key_values if "past_key_values" in out else out.get("cache")
        return out.logits


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux ``VmHWM``; ``ru_maxrss`` would include the parent's peak
    from before ``exec``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (peak RSS is measured on Linux only)")


def measure(
    kind: str, path: str, vocab_size: int, prompt_len: int, decode_tokens: int, reps: int, threads: int | None = None
) -> dict:
    """One model (``kind`` "pte" or "eager") in this process; call it in a fresh one (``measure_in_fresh_process``).
    ``threads``: ExecuTorch threadpool and torch intra-op threads (None: ``runtime_threads()``'s choice for a .pte,
    torch's default for eager)."""
    load = _loader(kind, threads)
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
    size_bytes, weight_bytes = _sizes(kind, path, step)
    return {
        "load_s": median_range(loads),
        "prefill_tok_s": median_range(prefill),
        "decode_tok_s": median_range(decode),
        "decode_cpu_share": median_range(cpu_share),
        "decode_tok_per_cpu_s": median_range(decode_cpu),
        "threads": _threads(kind),
        "peak_rss_mb": peak_rss_mb(),
        "base_rss_mb": base_rss,
        "size_bytes": size_bytes,
        "weight_bytes": weight_bytes,
    }


def _loader(kind: str, threads: int | None):
    """``load(path) -> step`` for ``kind`` ("pte" or "eager"), with its libraries imported (before the baseline RSS)
    and its thread count set."""
    if kind == "pte":
        from qharness.runtime.pte import PteModel, set_runtime_threads
        from qharness.upstream import imports

        imports.executorch_runtime()  # libraries imported before the baseline RSS, as transformers is for eager
        if threads:
            set_runtime_threads(threads)
        return PteModel
    import transformers  # noqa: F401

    if threads:
        torch.set_num_threads(threads)
    return EagerStep


def _threads(kind: str) -> int:
    """The threads the model ran with: torch's intra-op threads (eager) or ExecuTorch's threadpool (``.pte``)."""
    if kind == "eager":
        return torch.get_num_threads()
    from qharness.runtime.pte import runtime_threads

    return runtime_threads()


def _sizes(kind: str, path: str, step) -> tuple[int, int]:
    """``(size_bytes, weight_bytes)`` of the model: its file size(s), and what one decode step reads of the weights:
    all but the embedding tables (one row each), the lm_head whole (also when it shares the embedding's weight)."""
    if kind == "pte":
        from qharness.runtime.pte import embedding_bytes, program_bytes

        size_bytes = program_bytes(path)
        return size_bytes, size_bytes - embedding_bytes(path)
    model = step.model
    embedding = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)  # None: no separate output layer
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if embedding is not head:
        weight_bytes -= embedding.numel() * embedding.element_size()
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors")), weight_bytes


def measure_in_fresh_process(**kwargs) -> dict:
    """``measure(**kwargs)`` in a new interpreter that imports this same qharness (not an installed copy)."""
    paths = [
        str(Path(__file__).resolve().parents[2]),
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    if kwargs.get("kind") == "pte":
        env |= process.pte_process_env()
    r = subprocess.run(
        process.python_command("-m", "qharness.runtime.measure", json.dumps(kwargs)),
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=process.die_with_parent(),  # a killed run leaves no benchmark running on
    )
    if r.returncode != 0:
        raise RuntimeError(f"benchmark of {kwargs['path']} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.splitlines()[-1])


if __name__ == "__main__":  # the fresh process of measure_in_fresh_process
    print(json.dumps(measure(**json.loads(sys.argv[1]))))
