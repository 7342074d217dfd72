"""Atomic file writes: a crash never leaves a half-written ``.pte``, ``summary.json`` or report."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``.

    The temporary file is ``.<name>.<pid>.<random>.tmp``: if this process is killed while writing, the next
    command on that directory removes it (``remove_stale_temps``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
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


def temp_dir_for(path: str | os.PathLike) -> Path:
    """The name a directory is built under before it is renamed to ``path``: ``<path>.tmp<pid>`` (this process's
    own; ``remove_stale_temps`` removes those of dead processes)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def write_dir_atomic(path: str | os.PathLike, write) -> Path:
    """Build a directory with ``write(tmp)`` under ``temp_dir_for(path)`` and put it in place of ``path``: a kill
    leaves the old directory (or none) and a stale temporary, never a half-written ``path``.

    Example: ``write_dir_atomic(run_dir / "tokenizer", tokenizer.save_pretrained)``
    """
    path = Path(path)
    tmp = temp_dir_for(path)
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    old = path.with_name(f"{path.name}.old.tmp{os.getpid()}")
    if path.exists():
        os.replace(path, old)  # a directory cannot be renamed over a non-empty one: the old one steps aside
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
    return path


# what write_bytes_atomic and temp_dir_for name their temporaries: the writer's pid is in the name
_TEMP_FILE = re.compile(r"^\..+\.(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")
_TEMP_DIR = re.compile(r"^.+\.tmp(?P<pid>\d+)$")
_OLD_TEMP_FILE = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")  # written before the pid was in the name: age only
STALE_AFTER_S = 24 * 3600  # a temporary this old is stale whoever wrote it (a pid of another host, a reused pid)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's live process / not a pid at all: leave it
        return True
    return True


def remove_stale_temps(directory: str | os.PathLike, max_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove what killed atomic writes left in ``directory`` (not below it): temporary files
    ``.<name>.<pid>.<random>.tmp`` (``write_bytes_atomic``, checkpoints) and directories ``<name>.tmp<pid>``
    (``temp_dir_for``) whose writer is no longer running, or that are older than ``max_age_s``. Another live
    process's temporary is never touched; nothing else is. Returns the paths removed.

    Example: ``remove_stale_temps("runs/qat_xnnpack")`` -> ``[PosixPath('runs/qat_xnnpack/.model.pending.pte.4711.k2j_x9ab.tmp')]``
    """
    directory = Path(directory)
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed, now = [], time.time()
    for entry in entries:
        is_dir = entry.is_dir(follow_symlinks=False)
        match = (_TEMP_DIR if is_dir else _TEMP_FILE).match(entry.name)
        old_style = not is_dir and match is None and _OLD_TEMP_FILE.match(entry.name)
        if match is None and not old_style:
            continue
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        if age < max_age_s and (old_style or _pid_alive(int(match["pid"]))):
            continue
        try:
            shutil.rmtree(entry.path) if is_dir else os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(Path(entry.path))
    return removed


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
    for where in (run_dir, run_dir / "checkpoints"):  # what a killed writer of this directory left behind
        remove_stale_temps(where)


def release_run_locks() -> None:
    """Release every run-directory lock this process holds (``hold_run_lock``)."""
    while _LOCKS:
        os.close(_LOCKS.popitem()[1])  # closing the descriptor drops the flock
