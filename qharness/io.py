"""Atomic file writes: a crash never leaves a half-written ``.pte``, ``summary.json`` or report."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

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
    return None if cause is None else disk_full_error(cause.filename or next(iter(_LOCKS), None))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}" if n < 10e6 else f"{n / 1e6:.0f}"


def _field_for(path: Path | None) -> str:
    """The field that moves ``path``: ``QHARNESS_CACHE`` for the model/data cache, else the command's output field."""
    cache = Path(os.environ.get("QHARNESS_CACHE") or Path.home() / ".cache" / "qharness")  # as sources/cache.py
    if path is not None and path.absolute().is_relative_to(cache.absolute()):
        return "QHARNESS_CACHE"
    return _OUTPUT_FIELD[0]


def disk_full_error(path: str | os.PathLike | None, needed: int | None = None):
    """The one-line ``DiskFullError`` for a write of about ``needed`` bytes to ``path`` that ran out of space, with
    the space now free on that device.

    Example: ``disk_full_error("runs/x/model.pte", 250_000)`` -> ``no space left on device writing runs/x/model.pte
    (needs about 0.3 MB, 0.1 MB free). fix: free space or point trainer.default_root_dir elsewhere``
    """
    from qharness.errors import DiskFullError

    where = Path(path) if path else None
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
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    except OSError as e:
        if disk_full_cause(e) is None:
            raise
        raise disk_full_error(path, needed() if callable(needed) else needed) from e
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a result file gets the mode any new file would get
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if disk_full_cause(e) is None:
            raise
        raise disk_full_error(path, needed() if callable(needed) else needed) from e


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
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp"))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
        yield tmp
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp"))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if disk_full_cause(e) is None:
            raise
        raise disk_full_error(path) from e


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


def temp_dir_for(path: str | os.PathLike) -> Path:
    """The name a directory is built under before it is renamed to ``path``: ``<path>.tmp<pid>`` (this process's
    own; ``remove_stale_temps`` removes those of dead processes)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


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


def check_output_dir(path: str | os.PathLike, field: str) -> Path:
    """``path`` if it is a directory or can be made one: a one-line ``UserError`` naming ``field`` when it, or the
    nearest of its parents that exists, is a file (``mkdir`` would raise ``FileExistsError``/``NotADirectoryError``),
    or when nothing can be made there (``/proc``, a read-only place; tried with a directory made and removed).

    Example: ``check_output_dir("report.md", "--out")`` -> ``UserError: --out report.md is a file, not a directory``
    """
    from qharness.errors import UserError

    path = Path(path)
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


_LOCKS: dict[str, int] = {}


@functools.cache
def _unique_key_loader():
    """PyYAML's ``SafeLoader`` that refuses a mapping with the same key twice (plain PyYAML keeps the last one,
    silently): a ``yaml.constructor.ConstructorError`` naming the key and both lines."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # `<<: *base`: merged keys may be overridden, as YAML means them to be
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.setdefault(key, key_node)
                    except TypeError:  # an unhashable key: SafeLoader's own error follows
                        continue
                    if first is not key_node:
                        raise yaml.constructor.ConstructorError(
                            None,
                            None,
                            f"duplicate key {key!r} (lines {first.start_mark.line + 1} and {key_node.start_mark.line + 1})",
                            key_node.start_mark,
                        )
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def load_yaml(text: str):
    """``yaml.safe_load(text)``, except that a key given twice in one mapping is an error (``yaml.YAMLError``) instead
    of the last one silently winning. Every YAML qharness reads (run configs, recipes, sweep files) goes through it.

    Example: ``load_yaml("lr: 1\nlr: 2")`` raises ``ConstructorError: duplicate key 'lr' (lines 1 and 2)``
    """
    import yaml

    return yaml.load(text, Loader=_unique_key_loader())


def read_yaml(path: str | os.PathLike, what: str):
    """The parsed YAML of ``path`` (``load_yaml``); a syntax error (with its line and column), a key given twice or
    non-UTF-8 text is a one-line ``UserError`` naming ``what`` ("config", "recipe", "sweep config") and the file.

    Example: ``read_yaml(Path("configs/qat_xnnpack.yaml"), "config")`` -> ``{"model": {...}, ...}``
    """
    import yaml

    from qharness.errors import UserError

    try:
        return load_yaml(Path(path).read_text())
    except yaml.YAMLError as e:
        if str(getattr(e, "problem", "")).startswith("duplicate key"):
            raise UserError(
                f"{what} file {path} has the {e.problem}", fix="keep one of them (YAML would silently use the last)"
            ) from e
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise UserError(f"{what} file {path} is not valid YAML{at}", fix="fix the YAML syntax") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{what} file {path} is not UTF-8 text", fix=f"save the {what} as UTF-8 YAML") from e


# A run waits for another process's cache lock as long as the holder runs: building a 1 GB text's token cache took
# 24 minutes (BENCHMARKS.md 8), and DDP ranks wait for rank 0's build. QHARNESS_LOCK_WAIT_S bounds the wait when set.
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
