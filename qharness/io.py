"""Atomic file writes: a crash never leaves a half-written ``.pte``, ``summary.json`` or report."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a result file gets the mode any new file would get
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def to_jsonable(obj):
    """Plain JSON values: numpy/torch scalars become floats/ints, non-finite floats become None."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json_atomic(path: Path, obj) -> Path:
    return write_bytes_atomic(path, (json.dumps(to_jsonable(obj), indent=2) + "\n").encode())


def write_text_atomic(path: Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode())


_LOCKS: dict[str, int] = {}


def read_yaml(path: str | os.PathLike, what: str):
    """The parsed YAML of ``path``; a syntax error (with its line and column) or non-UTF-8 text is a one-line
    ``UserError`` naming ``what`` ("config", "recipe") and the file.

    Example: ``read_yaml(Path("configs/qat_xnnpack.yaml"), "config")`` -> ``{"model": {...}, ...}``
    """
    import yaml

    from qharness.errors import UserError

    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise UserError(f"{what} file {path} is not valid YAML{at}", fix="fix the YAML syntax") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{what} file {path} is not UTF-8 text", fix=f"save the {what} as UTF-8 YAML") from e


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
        raise UserError(
            f"{run_dir} is in use by another qharness process (pid {holder})",
            fix="wait for it to finish, or use another trainer.default_root_dir / sweep_dir",
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _LOCKS[str(run_dir)] = fd  # held (open) until the process exits


def release_run_locks() -> None:
    """Release every run-directory lock this process holds (``hold_run_lock``)."""
    while _LOCKS:
        os.close(_LOCKS.popitem()[1])  # closing the descriptor drops the flock
