"""Process-wide settings qharness makes: each is permanent for the process, so each is called explicitly
where it is needed (never at import time)."""

from __future__ import annotations

from collections.abc import Callable


def map_large_allocations_separately(threshold: int = 1 << 20) -> bool:
    """Have glibc's malloc serve each allocation of ``threshold`` bytes or more from its own mapping.

    By default glibc raises its mmap threshold (up to 32 MiB) after the first large free, so the many
    weight-sized temporaries of export, ``convert_pt2e`` and lowering end up in the heap, which keeps
    them (RSS stays at each stage's peak and fragments). A fixed threshold unmaps them on free: peak RSS
    of export + lowering of a 12-layer, 70M-parameter Llama went from 1.86 to 1.38 GiB. Process-wide
    and permanent; glibc only (returns False elsewhere).
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_MMAP_THRESHOLD = -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess``: the kernel sends the child SIGTERM when this process dies, however it
    dies (Linux ``PR_SET_PDEATHSIG``; None elsewhere), so a killed sweep or run leaves no run or benchmark going
    on in the background. SIGTERM lets a training run save its checkpoint first.

    Example: ``subprocess.run(cmd, preexec_fn=die_with_parent())``
    """
    import ctypes
    import os
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def pte_process_env() -> dict[str, str]:
    """Environment for a fresh process that runs ``.pte`` programs: MKL single-threaded (``MKL_NUM_THREADS=1``).

    Workaround: ExecuTorch 1.5.1's ``llama::custom_sdpa``, run by the Python runtime, calls libtorch's MKL ``sgemm``
    from inside its own threadpool's ``parallel_for`` over heads, and MKL starts a team of its own threads there
    (``MKL_VERBOSE``: ``NThr:2`` on 2 cores), threads nested in threads. Upstream de-nested its SDPA from MKL in
    pytorch/executorch#20267 (its GEMMs are already parallel by head); the 1.5.1 wheel's Python runtime still nests.
    On SmolLM2-135M (2 cores) a 64-token prefill ran about twice as fast with MKL single-threaded, decode a tie
    (docs/benchmarks/real-model.md). A deployed runtime has no MKL; the program's own kernels are untouched.
    Only for processes that run nothing but ``.pte`` programs: torch also reads ``MKL_NUM_THREADS`` for its own
    intra-op default, so an eager model in the same process would run single-threaded.
    Test that tells when to retire it: tests/test_upstream_fixes.py::test_upstream_custom_sdpa_still_nests_mkl_threads.

    Example: ``subprocess.run(cmd, env=dict(os.environ, **pte_process_env()))``
    """
    return {"MKL_NUM_THREADS": "1"}


def python_command(*args: str) -> list[str]:
    """The command line of a child Python (``sys.executable``) that never puts the current directory (or a script's
    directory) first on ``sys.path`` (``-P``, Python 3.11+): a ``yaml.py`` or ``torch.py`` lying in the directory
    a sweep is started from is not imported in place of the real module. ``PYTHONPATH`` still applies (not ``-I``).

    Example: ``python_command("-m", "qharness", "fit", "--config", "x.yaml")`` -> ``[sys.executable, "-P", "-m", ...]``
    """
    import sys

    return [sys.executable, "-P", *args]


def exit_without_final_collection() -> None:
    """Let this process exit without CPython's final garbage collection over the objects it holds.

    After an export and a lowering the interpreter holds millions of objects (FX graphs, sympy and dynamo caches);
    the collection CPython runs over them at shutdown took 2.2 s after a 2-layer model's 20-second ``qharness fit``
    and 4.4 s after SmolLM2-135M's ``qharness calibrate configs/smollm2.yaml``, with nothing left to do. ``gc.freeze()``
    puts them out of the collector's reach: those exits take 0.2 s and 0.4 s (one run each). The rest
    of the exit runs as before (atexit handlers: wandb, logging, temporary folders; objects freed by reference
    counting); only garbage in reference cycles is left to the operating system, and every qharness output is
    written atomically and closed before its command returns. Call it at the end of a process only: a process that
    goes on never collects those objects again.

    Example: ``try: main() finally: exit_without_final_collection()`` (``qharness/__main__.py``)
    """
    import gc

    gc.freeze()
