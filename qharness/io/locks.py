"""Locks between processes: the run-directory lock (one writer per run or sweep directory) and ``hold_lock``, the
shared-cache lock that says whom it waits for.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from qharness.io.temps import remove_stale_temps

_LOCKS: dict[str, int] = {}  # run directory -> the descriptor of its lock, held until the process exits


def held_run_dirs() -> list[str]:
    """The run directories this process holds the lock of (``hold_run_lock``), first taken first."""
    return list(_LOCKS)


# A run waits for another process's cache lock as long as the holder runs: building a 1 GB text's token cache took
# 24 minutes (docs/benchmarks/memory.md, data preparation), and DDP ranks wait for rank 0's build. QHARNESS_LOCK_WAIT_S bounds the wait when set.
LOCK_STOPPED_S = 10.0  # how long it waits for a holder that is stopped (SIGSTOP, Ctrl-Z) (QHARNESS_LOCK_STOPPED_S)
LOCK_NOTICE_S = 60.0  # how often it says it is still waiting


def _seconds(env: str, default: float | None) -> float | None:
    """A number of seconds >= 0 from the environment variable ``env``; ``default`` when unset or not such a number."""
    try:
        value = float(os.environ.get(env, ""))
    except ValueError:
        return default
    return value if math.isfinite(value) and value >= 0 else default


def _holder(fd: int) -> tuple[int | None, str]:
    """The pid and the task a lock file names (``"<pid> <what>"``, as ``hold_lock`` writes it)."""
    text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    pid, _, what = text.partition(" ")
    return (int(pid) if pid.isdigit() else None), what or "a qharness process"


def process_state(pid: int) -> str | None:
    """A process's state letter from ``/proc/<pid>/stat`` (``R`` running, ``S`` sleeping, ``T`` stopped, ``t``
    stopped by a tracer, ...); None when it is not running here (or not on Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :][:1] or None


def _log(message: str) -> None:
    import sys

    print(f"[qharness] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def hold_lock(path: str | os.PathLike, what: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` for the block, for a task that another process may be doing at the same
    time (building a shared cache); the file says who holds it (``"<pid> <what>"``). The kernel frees it when the
    holder exits, however it exits.

    When another process holds it, this one says at once whom it waits for (pid, task, lock file) and then waits as
    long as the holder runs, saying so every minute, and takes the lock when the holder is done. It gives up with one
    ``UserError`` line, naming the pid and how to free the lock, when the holder has been stopped (SIGSTOP, Ctrl-Z:
    it would never finish) for ``QHARNESS_LOCK_STOPPED_S`` seconds (default 10), or, when ``QHARNESS_LOCK_WAIT_S`` is
    set, when it has waited that long in all.

    Example::

        with hold_lock(cache / "tokens" / f"{key}.lock", f"tokenizing data.source {source}"):
            build()   # another run on the same data waits for this one, and says so
    """
    import fcntl

    from qharness.errors import UserError

    path = Path(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        start = stopped_since = None
        notice = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            now = time.monotonic()
            pid, task = _holder(fd)
            who = f"pid {pid if pid is not None else '?'} ({task})"
            if start is None:
                start = now
                _log(f"waiting for {who}, which holds {path}")
            state = process_state(pid) if pid is not None else None
            if state in ("T", "t"):
                stopped_since = stopped_since or now
                if now - stopped_since >= _seconds("QHARNESS_LOCK_STOPPED_S", LOCK_STOPPED_S):
                    raise UserError(
                        f"{path} is held by {who}, which is stopped (SIGSTOP or Ctrl-Z) and cannot finish",
                        fix=f"resume it (kill -CONT {pid}) or end it (kill {pid}): the lock is freed when it exits",
                    )
            else:
                stopped_since = None
            bound = _seconds("QHARNESS_LOCK_WAIT_S", None)
            if bound is not None and now - start >= bound:
                raise UserError(
                    f"gave up after waiting {now - start:.0f} s for {who}, which holds {path}",
                    fix=f"let it finish, or end it (kill {pid if pid is not None else '<pid>'}); "
                    "QHARNESS_LOCK_WAIT_S sets how long a run waits",
                )
            if now - start >= notice + LOCK_NOTICE_S:
                notice = now - start
                _log(f"still waiting for {who} after {notice:.0f} s")
            time.sleep(0.2)
        if start is not None:
            _log(f"{path} is free after {time.monotonic() - start:.1f} s: going on")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {what}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def hold_run_lock(run_dir: str | os.PathLike) -> None:
    """Make this process the one writer of ``run_dir`` until ``release_run_locks()`` (the CLI calls it when the
    command ends) or the process exits: an exclusive ``flock`` on ``<run_dir>/.qharness.lock``. The kernel drops the
    lock when the process dies, however it dies, so a crashed run never blocks the next one; the file itself
    (holding the last holder's pid) may stay.
    DDP ranks other than 0 (``LOCAL_RANK``/``RANK`` set and non-zero) share rank 0's lock and take none.

    Example::

        hold_run_lock("runs/qat_xnnpack")   # a second fit/calibrate/sweep on that directory now gets a UserError
    """
    import fcntl

    from qharness.errors import UserError

    if any(os.environ.get(k, "0") not in ("", "0") for k in ("LOCAL_RANK", "RANK")):
        return
    run_dir = Path(run_dir).resolve()
    if str(run_dir) in _LOCKS:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".qharness.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        if holder.isdigit() and process_state(int(holder)) in ("T", "t"):  # it would hold the directory forever
            raise UserError(
                f"{run_dir} is in use by another qharness process (pid {holder}), which is stopped (SIGSTOP or Ctrl-Z)",
                fix=f"resume it (kill -CONT {holder}) or end it (kill {holder}), or use another "
                "trainer.default_root_dir / sweep_dir",
            ) from None
        raise UserError(
            f"{run_dir} is in use by another qharness process (pid {holder})",
            fix="wait for it to finish, or use another trainer.default_root_dir / sweep_dir",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _LOCKS[str(run_dir)] = fd  # held (open) until the process exits
    for where in (run_dir, run_dir / "checkpoints"):  # what a killed writer of this directory left behind
        remove_stale_temps(where)


def release_run_locks() -> None:
    """Release every run-directory lock this process holds (``hold_run_lock``)."""
    while _LOCKS:
        os.close(_LOCKS.popitem()[1])  # closing the descriptor drops the flock
