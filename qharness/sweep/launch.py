"""A run's own process: ``python -P -m qharness ...`` with this qharness on its path, its output logged to a file
and (optionally) echoed on the console, through a pseudo-terminal on a terminal so progress bars stay live."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from qharness.upstream import process


def child_env(threads: int | None = None) -> dict:
    """The environment of a run's process: it imports this same qharness (not an installed copy). ``threads``: its
    torch and ExecuTorch thread counts (``OMP_NUM_THREADS``, ``QHARNESS_THREADS``) where the environment sets none."""
    paths = [
        str(Path(__file__).resolve().parents[2]),
        *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)),
    ]
    # a run that fills the disk tells the user to move the sweep_dir (the runs' root dirs are made from it)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", QHARNESS_OUTPUT_FIELD="sweep_dir")
    if threads is not None:
        for name in ("OMP_NUM_THREADS", "QHARNESS_THREADS"):
            env.setdefault(name, str(threads))
    return env


def run_logged(cmd: list[str], log_path: Path, echo: bool = True, threads: int | None = None) -> int:
    """Run ``cmd``, its output in ``log_path`` and (``echo``) on this console; return its exit code. On a terminal the
    child gets a pseudo-terminal of the same size, so Lightning's progress bars stay live. ``threads``: ``child_env``'s."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        if echo and sys.stdout.isatty() and os.name == "posix":
            return _run_on_terminal(cmd, log, threads)
        # without echo the child writes into the log itself
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if echo else log,
            stderr=subprocess.STDOUT,
            env=child_env(threads),
            preexec_fn=process.die_with_parent(),
        )
        for chunk in iter(lambda: proc.stdout.read1(65536), b"") if echo else ():
            _tee(chunk, log)
        return proc.wait()


def _tee(chunk: bytes, log) -> None:
    out = sys.stdout.buffer
    out.write(chunk)
    out.flush()
    log.write(chunk)


def _run_on_terminal(cmd: list[str], log, threads: int | None) -> int:
    """``run_logged`` on a terminal: the child's output through a pseudo-terminal of this terminal's size."""
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(sys.stdout.fileno(), termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        pass
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=child_env(threads),
        close_fds=True,
        preexec_fn=process.die_with_parent(),
    )
    os.close(slave)
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        _tee(chunk, log)
    os.close(master)
    return proc.wait()
