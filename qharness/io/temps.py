"""Temporaries of atomic writes: how they are named (the writer's pid in the name) and their removal once their
writer is dead or they are old.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path


def temp_dir_for(path: str | os.PathLike) -> Path:
    """The name a directory is built under before it is renamed to ``path``: ``<path>.tmp<pid>`` (this process's
    own; ``remove_stale_temps`` removes those of dead processes)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def temp_prefix(path: Path) -> str:
    """The prefix of ``atomic_writer``'s and ``atomic_dir``'s temporaries for ``path``: ``.<name>.<pid>.``."""
    return f".{path.name}.{os.getpid()}."


# what atomic_writer/atomic_dir and temp_dir_for name their temporaries: the writer's pid is in the name
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
        match = (is_dir and _TEMP_DIR.match(entry.name)) or _TEMP_FILE.match(entry.name)
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
