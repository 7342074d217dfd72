"""Quiet, truthful output: upstream messages known to be harmless are hidden, each by its message and
origin (never a blanket ignore), so qharness's own lines, bars and tables are what a run prints. Any
other warning still shows. ``--verbose`` anywhere on the command line, or ``QHARNESS_VERBOSE=1``, hides
nothing; the flag sets the variable, so the processes a sweep starts inherit it.

Every entry below names what it hides and why that is harmless. ``install()`` runs at CLI start,
before the heavy imports that emit most of them.

Example::

    argv = take_verbose_flag(sys.argv[1:])   # "--verbose" removed, QHARNESS_VERBOSE=1 set
    install()                                # logging set up; known noise filtered unless verbose
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import warnings
from contextlib import contextmanager

VERBOSE_ENV = "QHARNESS_VERBOSE"

# (category, message regex, origin module regex, why it is harmless). The origin is the module a warning
# is attributed to (its ``stacklevel``), as ``warnings.filterwarnings(module=...)`` matches it.
WARNINGS = (
    (
        FutureWarning,
        r"_check_is_size will be removed",
        r"executorch\.extension\.llm\.custom_ops\.",
        "ExecuTorch's custom_sdpa/update_cache meta kernels call a torch API deprecated in favour of torch._check; "
        "the check they make is the same",
    ),
    (
        FutureWarning,
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        r"(copyreg|lightning\.pytorch\.utilities\._pytree)$",
        "torch's pytree deprecates building a LeafSpec, which deep copies of exported graphs (through copyreg) and "
        "Lightning's batch flattening still do; the spec built is the same",
    ),
    (
        UserWarning,
        r"Mutation on a buffer in the model is detected",
        r"executorch\.exir\.emit\._emitter$",
        "the mutated buffers of qharness's deploy graphs are the KV caches: the .pte keeps their shape, not their "
        "(zero) contents, and every cache position is written before it is read",
    ),
    (
        FutureWarning,
        r"`past_key_values` is deprecated and will be removed in version [\d.]+ for `\w+\.forward`\. Use `cache` instead",
        r"torch\.nn\.modules\.module$",
        "transformers 5.x renames the forward argument that carries the KV cache; the deploy export and the eager "
        "decoder pass the old name, which reaches the model the same way (every export and decode test checks its "
        "logits), printed once per run in the middle of its progress lines",
    ),
    (
        UserWarning,
        r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader is not resumable",
        r"lightning\.pytorch\.loops\.training_epoch_loop$",
        "Lightning knows only loaders with a state_dict (Lightning-AI/pytorch-lightning#18780); qharness's batch "
        "sampler (data/datamodule.py) continues a resumed run at its next batch, and the run ends where an "
        "uninterrupted one ends (tests/test_e2e.py)",
    ),
)

# (logger name, message regex, why it is harmless): records of that logger whose message matches are dropped.
LOG_RECORDS = (
    (
        "torch.utils._pytree",
        r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile",
        "torchao registers its config enums as pytree constants at import; torch says the registration is no longer needed",
    ),
    (
        "torchao",
        r"Failed to load \S*torchao/_C_(mxfp8|cutlass_90a)\S*\.so",
        "torchao's CUDA-only kernels (MXFP8, SM90 CUTLASS; one built for Python 3.10) that no CPU run calls",
    ),
    (
        "torchao.kernel.intmm",
        r"Warning: Detected no triton",
        "Triton kernels are GPU kernels; on CPU torchao's int matmul takes its PyTorch path either way",
    ),
    (
        "transformers.integrations.hub_kernels",
        r"`\w+` is falling back to its reference PyTorch implementation because `(causal-conv1d|mamba-ssm|causal_conv1d|mamba_ssm)` "
        r"is (either )?not installed",
        "CUDA kernels of the Mamba2 mixers (causal-conv1d, mamba-ssm) that no CPU run can use: an export takes the "
        "PyTorch path anyway, and the deployed program runs the fast path's own scan (deploy/fastpath/state_cache.py)",
    ),
    (
        "lightning.pytorch.utilities.rank_zero",
        r"💡 Tip: For seamless cloud logging",
        "an advertisement for Lightning's cloud logger, printed by every run",
    ),
)

# Environment settings of upstream tools (set only where the user has not set them).
ENVIRONMENT = (
    (
        "WANDB_SILENT",
        "true",
        "wandb's console header and run summary (~25 lines a run; the same figures are in summary.json and the "
        "run's wandb/ directory) and its warning that the `anonymous` setting Lightning passes has no effect; "
        "wandb's errors are still raised",
    ),
)


def verbose() -> bool:
    """Whether every upstream message is to be shown (``QHARNESS_VERBOSE`` set to anything but 0/false/empty)."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def take_verbose_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--verbose``; when it was there, ``QHARNESS_VERBOSE=1`` (inherited by child processes)."""
    if "--verbose" not in argv:
        return argv
    os.environ[VERBOSE_ENV] = "1"
    return [a for a in argv if a != "--verbose"]


class _Drop(logging.Filter):
    """Drops the records whose message matches ``pattern``."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


_UPSTREAM, _BARE = logging.Formatter("%(levelname)s %(name)s: %(message)s"), logging.Formatter("%(message)s")


class _Format(logging.Formatter):
    """qharness's records as ``[qharness] message`` (``[qharness] WARNING: message`` from WARNING up), other
    loggers' as ``LEVEL logger: message`` from WARNING up and as the bare message below (Lightning's info lines)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name != "qharness" and not record.name.startswith("qharness."):
            return (_UPSTREAM if record.levelno >= logging.WARNING else _BARE).format(record)
        text = record.getMessage() if record.levelno < logging.WARNING else f"{record.levelname}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return f"[qharness] {text}"


def install() -> None:
    """Logging to stderr (upstream loggers from WARNING, qharness's from INFO), then the filters unless verbose."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Format())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])  # a no-op where logging is set up already
    logging.getLogger("qharness").setLevel(logging.INFO)
    logging.getLogger("lightning").propagate = False  # Lightning prints its records with its own handler: once
    if verbose():
        return
    for name, value, _why in ENVIRONMENT:
        os.environ.setdefault(name, value)
    for category, message, module, _why in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, message, _why in LOG_RECORDS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == message for f in logger.filters):
            logger.addFilter(_Drop(message))


def quiet_lm_eval_git() -> None:
    """lm-eval records the git commit of the working directory with ``git describe``, whose ``fatal: not a git
    repository`` goes straight to the terminal outside a repository, once per evaluated model: the same
    lookup with git's stderr discarded (the result is the same; lm-eval falls back to reading ``.git``)."""
    if verbose():
        return
    import subprocess

    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def get_git_commit_hash():
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return get_commit_from_path(os.getcwd())

    lm_eval.evaluator.get_git_commit_hash = get_git_commit_hash


def quiet_executorch_threadpool() -> None:
    """ExecuTorch creates its CPU threadpool on first use (a .pte's first decode step) and then prints five lines
    from ``cpuinfo_utils.cpp`` straight to the process's stderr (``Failed to open midr file ...``, ``CPU info and
    manual query on # of cpus dont match``): its probe for ARM core types finds no such files on x86 and the pool
    takes the logical CPU count. The pool is created here, once, with those lines dropped and any other output
    passed on. Called where every ``.pte`` load sizes the pool (``qharness.runtime.pte.set_runtime_threads``)."""
    if verbose():
        return
    from qharness.upstream import imports

    with _native_stderr(drop=r"\[cpuinfo_utils\.cpp:\d+\] "):
        imports.executorch_threadpool().get_thread_count()


@contextmanager
def _native_stderr(drop: str):
    """File descriptor 2 (what native code writes to) goes to a temporary file in the block; afterwards its lines
    that do not match ``drop`` are written to stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [
                line
                for line in tmp.read().decode(errors="replace").splitlines(keepends=True)
                if not re.match(drop, line)
            ]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
