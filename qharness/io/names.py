"""Names and paths from a user's value: every name from a config or a sweep file that becomes a path is one plain entry
of its run or sweep directory; an output directory is checked before any work.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# what no file or directory name that qharness makes from a user's value may hold: control characters (a newline
# splits a log line or a report row), format characters (right-to-left overrides that disguise a name) and line or
# paragraph separators
_BAD_NAME_CATEGORIES = ("Cc", "Cf", "Cs", "Zl", "Zp")

NAME_MAX_BYTES = 255  # the longest file name Linux and macOS file systems take


def bad_name_reason(name) -> str | None:
    """Why ``name`` cannot be one file or directory name inside a directory qharness writes to (None: it can): not
    a string, empty, ``.``/``..``, a path separator (so also an absolute path), a control or format character, or
    longer than ``NAME_MAX_BYTES`` bytes.

    Example: ``bad_name_reason("../../victim")`` -> ``"it holds a path separator ('/')"``
    """
    import unicodedata

    if not isinstance(name, str):
        return f"it is not a string (got {type(name).__name__})"
    if not name.strip():
        return "it is empty"
    if name in (".", ".."):
        return f"{name!r} names a directory, not an entry inside it"
    for sep in dict.fromkeys(("/", "\\", os.sep, os.altsep or "/")):
        if sep in name:
            return f"it holds a path separator ({sep!r})"
    bad = next((c for c in name if unicodedata.category(c) in _BAD_NAME_CATEGORIES), None)
    if bad is not None:
        return f"it holds the control character {bad!r}"
    if len(name.encode("utf-8", "surrogatepass")) > NAME_MAX_BYTES:
        return f"it is longer than {NAME_MAX_BYTES} bytes"
    return None


def check_name(name, field: str, example: str) -> str:
    """``name`` if it is one plain file or directory name (``bad_name_reason``), else a one-line ``UserError`` naming
    ``field`` and showing ``example``: every name that becomes a path under a run or sweep directory goes through
    here, so no value writes or deletes outside its directory.

    Example: ``check_name("../x", "sweep runs[0].name", "int8_distill")`` -> ``UserError: sweep runs[0].name
    '../x' is not a plain name (it holds a path separator ('/')). fix: use letters, digits, '-', '_' and '.', e.g. int8_distill``
    """
    from qharness.errors import UserError

    why = bad_name_reason(name)
    if why is not None:
        raise UserError(
            f"{field} {name!r} is not a plain name ({why})",
            fix=f"use a plain name without separators or control characters, e.g. {example}",
        )
    return name


def check_inside(path: str | os.PathLike, root: str | os.PathLike, field: str, fix: str) -> Path:
    """``path`` (relative paths taken from ``root``) if it lies inside ``root`` once ``..`` and symbolic links are
    resolved, else a one-line ``UserError`` naming ``field``.

    Example: ``check_inside("runs/x/../../etc", "runs/x", "checkpoint.dirpath", "leave it unset")`` -> ``UserError``
    """
    from qharness.errors import UserError

    root = Path(root)
    full = (root / path).resolve()
    if not full.is_relative_to(root.resolve()):
        raise UserError(f"{field} {str(path)!r} lies outside {root}", fix=fix)
    return full


# Directories no run, sweep, ship or report writes into: the filesystem root, system trees (nor anything under
# them), the folders that hold homes or mounts (themselves), and the user's home directory itself. (/proc and /sys
# take no directory: check_output_dir's probe says so.)
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/sbin",
    "/usr",
)
SYSTEM_DIRS = ("/", "/home", "/Users", "/mnt", "/media", "/opt", "/root", "/run", "/srv", "/var", "/tmp", "/private")


def check_not_system_dir(path: str | os.PathLike, field: str) -> None:
    """A one-line ``UserError`` naming ``field`` when ``path`` (resolved) is the filesystem root, the home directory
    itself, a folder of ``SYSTEM_DIRS`` itself or anything in a ``SYSTEM_TREES`` tree: run folders written there
    would mix with the system's.

    Example: ``check_not_system_dir("/", "sweep_dir")`` -> ``UserError: sweep_dir / is the filesystem root ...``
    """
    from qharness.errors import UserError

    where = Path(os.path.realpath(os.path.expanduser(path)))
    home = Path(os.path.realpath(os.path.expanduser("~")))
    if where == Path(where.anchor):
        what = "the filesystem root"
    elif where == home:
        what = "your home directory itself"
    elif str(where) in SYSTEM_DIRS:
        what = "a system directory"
    elif any(where == Path(t) or Path(t) in where.parents for t in SYSTEM_TREES):
        what = "in a system directory"
    else:
        return
    raise UserError(
        f"{field} {path} is {what}: its run folders and files would be written among the system's",
        fix=f"name a directory of its own for {field}, e.g. runs/my_sweep or ~/qharness-runs",
    )


def check_output_dir(path: str | os.PathLike, field: str) -> Path:
    """``path`` if it is a directory or can be made one: a one-line ``UserError`` naming ``field`` when it is a
    system directory (``check_not_system_dir``), when it, or the
    nearest of its parents that exists, is a file (``mkdir`` would raise ``FileExistsError``/``NotADirectoryError``),
    or when nothing can be made there (``/proc``, a read-only place; tried with a directory made and removed).

    Example: ``check_output_dir("report.md", "--out")`` -> ``UserError: --out report.md is a file, not a directory``
    """
    from qharness.errors import UserError

    path = Path(path)
    check_not_system_dir(path, field)
    for where in (path, *path.parents):
        if where.is_dir():
            break
        if where.exists() or where.is_symlink():
            what = "is" if where == path else f"lies under {where}, which is"
            raise UserError(
                f"{field} {path} {what} a file, not a directory", fix=f"name a directory for {field} (new or existing)"
            )
    try:  # a place that takes no directory (/proc, read-only): said now, leaving nothing behind
        os.rmdir(tempfile.mkdtemp(prefix=".qharness-probe-", dir=where))
    except OSError as e:
        raise UserError(
            f"{field} {path} cannot be made a directory ({e.strerror or type(e).__name__})",
            fix=f"name a writable directory for {field}",
        ) from e
    return path
