"""Atomic writes: a crash never leaves a half-written ``.pte``, ``summary.json``, checkpoint or report; a full disk is
one ``DiskFullError`` line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from qharness.io.disk import disk_full_cause, disk_full_error
from qharness.io.temps import temp_prefix


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, needed: int | Callable[[], int] | None = None) -> Iterator[BinaryIO]:
    """A binary file that becomes ``path`` only when the block ends without an error: written under a temporary
    name in the same directory, fsynced, then ``os.replace``d, so ``path`` holds either its old content or the whole
    new one. On an error the temporary file is removed; a full disk (quota, file-size limit) becomes a one-line
    ``DiskFullError`` naming ``path``, ``needed`` bytes (or a function giving them) and the space free.

    Example::

        with atomic_writer(run_dir / "checkpoints" / "last.ckpt", needed=lambda: 1_300_000) as f:
            torch.save(checkpoint, f)
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
    except OSError as e:
        if disk_full_cause(e) is None:
            raise
        raise disk_full_error(path, needed() if callable(needed) else needed, disk_full_cause(e).errno) from e
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600; a result file gets the mode any new file would get
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if disk_full_cause(e) is None:
            raise
        raise disk_full_error(path, needed() if callable(needed) else needed, disk_full_cause(e).errno) from e


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A directory that takes the place of ``path`` only when the block (which fills the directory it is given)
    ends without an error; on an error it is removed and ``path`` keeps its old content; a full disk is a
    one-line ``DiskFullError``.

    Example::

        with atomic_dir(run_dir / "tokenizer") as d:
            tokenizer.save_pretrained(d)
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp"))
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700
        yield tmp
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp"))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if disk_full_cause(e) is None:
            raise
        raise disk_full_error(path, err=disk_full_cause(e).errno) from e


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory and ``os.replace``
    (``atomic_writer``: a full disk is a one-line ``DiskFullError``, the old ``path`` untouched)."""
    with atomic_writer(path, needed=len(data)) as f:
        f.write(data)
    return Path(path)


def tensor_bytes(obj) -> int:
    """About the bytes ``torch.save(obj)`` writes: the storages of the tensors in ``obj`` (dicts, lists, tuples),
    each counted once."""
    import torch

    seen: dict[int, int] = {}
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return sum(seen.values())


def torch_save_atomic(obj, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` streamed into ``atomic_writer(path)`` (no second copy in memory): ``path`` keeps its old
    content unless the whole new file is written; a full disk is one ``DiskFullError`` line whose size is the
    tensors' bytes, or the file being replaced if larger (a checkpoint a few steps back holds the same state).

    Example: ``torch_save_atomic(trainer_checkpoint, "runs/x/checkpoints/last.ckpt")``
    """
    import torch

    def needed() -> int:
        return max(tensor_bytes(obj), os.path.getsize(path) if os.path.isfile(path) else 0)

    with atomic_writer(path, needed=needed) as f:
        torch.save(obj, f)
    return Path(path)


def umask() -> int:
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
