"""A full disk as one line: the ``DiskFullError`` naming the path, about how much it needed, what is free and the
field or option that moves the output elsewhere.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from qharness.io.locks import held_run_dirs

DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, past the file-size limit

# what the user changes to write elsewhere: main sets it per subcommand; a sweep names its own field to its runs
_OUTPUT_FIELD = [os.environ.get("QHARNESS_OUTPUT_FIELD") or "trainer.default_root_dir"]


def name_output_field(field: str) -> str:
    """The config field or option a disk-full error tells the user to point elsewhere (``main`` sets it per
    subcommand: ``trainer.default_root_dir`` for run configs, ``sweep_dir``, ``--out``); returns the previous one."""
    previous, _OUTPUT_FIELD[0] = _OUTPUT_FIELD[0], field
    return previous


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def disk_full_cause(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` meaning "the disk is full" (ENOSPC, EDQUOT, EFBIG) that ``exc`` is or was raised from or while
    handling (``torch.save`` wraps it in a ``RuntimeError``); None if there is none."""
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in DISK_FULL), None)


def disk_full_error_of(exc: BaseException):
    """The ``DiskFullError`` behind ``exc``: one already raised (and then wrapped, or followed by another full-disk
    error while Lightning cleaned up), else one made from the full-disk ``OSError`` in its chain; None if the disk
    did not fill."""
    from qharness.errors import DiskFullError

    raised = next((e for e in _chain(exc) if isinstance(e, DiskFullError)), None)
    if raised is not None:
        return raised
    cause = disk_full_cause(exc)
    if cause is None:
        return None
    return disk_full_error(cause.filename or next(iter(held_run_dirs()), None), err=cause.errno)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}" if n < 10e6 else f"{n / 1e6:.0f}"


def _field_for(path: Path | None) -> str:
    """The field that moves ``path``: ``QHARNESS_CACHE`` for the model/data cache, else the command's output field."""
    cache = Path(os.environ.get("QHARNESS_CACHE") or Path.home() / ".cache" / "qharness")  # as sources/cache.py
    if path is not None and path.absolute().is_relative_to(cache.absolute()):
        return "QHARNESS_CACHE"
    return _OUTPUT_FIELD[0]


def file_size_limit() -> int | None:
    """The largest file this process may write (``RLIMIT_FSIZE``'s soft limit, ``ulimit -f``), in bytes; None when
    unlimited (or unknown)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


def check_file_size_limit(needed: int, what: str) -> None:
    """A one-line ``UserError`` before any work when the file-size limit (``ulimit -f``) is below ``needed`` bytes,
    the least the run writes in one file (``what``: e.g. ``the .pte``)."""
    from qharness.errors import UserError

    limit = file_size_limit()
    if limit is not None and needed > limit:
        raise UserError(
            f"the file-size limit (ulimit -f) is {_mb(limit)} MB, less than {what} needs (at least {_mb(needed)} MB); "
            "the run would stop at that write",
            fix=f"raise the limit (ulimit -f unlimited, or at least {needed // 1024 + 1} blocks of 1 KB) and run again",
        )


def disk_full_error(path: str | os.PathLike | None, needed: int | None = None, err: int | None = None):
    """The one-line ``DiskFullError`` for a write of about ``needed`` bytes to ``path`` that ran out of space, with
    the space now free on that device.

    ``err``: the write's errno: ``EFBIG`` (past the file-size limit, ``ulimit -f``) says so instead of the space.

    Example: ``disk_full_error("runs/x/model.pte", 250_000)`` -> ``no space left on device writing runs/x/model.pte
    (needs about 0.3 MB, 0.1 MB free). fix: free space or point trainer.default_root_dir elsewhere``
    """
    from qharness.errors import DiskFullError

    where = Path(path) if path else None
    limit = file_size_limit()
    if err == errno.EFBIG:  # the write passed the largest file allowed: a limit, not the space free
        what = (
            f"the file-size limit (ulimit -f, {_mb(limit)} MB)"
            if limit is not None
            else "the file system's largest file"
        )
        return DiskFullError(
            f"{what} stopped writing {where or 'the run directory'}"
            + (f" (needs about {_mb(max(needed, 100_000))} MB)" if needed else ""),
            fix="raise the limit (ulimit -f unlimited)"
            if limit is not None
            else f"point {_field_for(where)} at a file system that takes larger files",
            path=where,
        )
    free = None
    for parent in (where, *where.parents) if where else ():
        try:
            free = shutil.disk_usage(parent).free
            break
        except OSError:
            continue
    sizes = [f"needs about {_mb(max(needed, 100_000))} MB" if needed else None]
    sizes.append(f"{_mb(free)} MB free" if free is not None else None)
    sizes = ", ".join(s for s in sizes if s)
    return DiskFullError(
        f"no space left on device writing {where or 'the run directory'}" + (f" ({sizes})" if sizes else ""),
        fix=f"free space or point {_field_for(where)} elsewhere",
        path=where,
    )
