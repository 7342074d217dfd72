"""Sources of text: the embedded corpus (text that ships with Python), local files and directories, hub datasets;
and text -> one token stream.

Example::

    stream = tokenize_stream(load_texts("../shared/data/tinyshakespeare/input.txt"), tokenizer)
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import torch

from qharness.errors import UserError
from qharness.sources.generated import GENERATED

EMBEDDED = "embedded"

_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def embedded_corpus(max_chars: int = 2_500_000) -> list[str]:
    """Text that ships with CPython, no download: the English documentation topics of ``pydoc_data``
    and the source of the top-level standard-library modules, in a fixed pseudo-random order (so the
    held-out tail mixes prose and code), capped at ``max_chars``."""
    import sysconfig
    from pydoc_data.topics import topics

    docs = {f"topic:{k}": v for k, v in topics.items()}
    for path in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"):
        docs[f"module:{path.name}"] = path.read_text(encoding="utf-8", errors="replace")
    out, total = [], 0
    for name in sorted(docs, key=lambda n: hashlib.sha1(n.encode()).hexdigest()):
        if total >= max_chars:
            break
        out.append(docs[name])
        total += len(docs[name])
    return out


COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}


def _kind(path: Path) -> tuple[str | None, str | None]:
    """``(builder, compression)`` of a data file from its suffixes: ``a.jsonl.gz`` -> ("json", "gzip")."""
    suffixes = path.suffixes[-2:]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    data_suffix = (
        suffixes[-2] if compression and len(suffixes) == 2 else (suffixes[-1] if suffixes and not compression else None)
    )
    return _BUILDERS.get(data_suffix), compression


CHUNK_BYTES = 1 << 20  # bytes read (and decoded) at a time from a text file


def _utf8_tail(data: bytes) -> int:
    """Where the incomplete UTF-8 sequence at the end of ``data`` starts (``len(data)`` when it ends complete)."""
    for k in range(1, min(4, len(data)) + 1):
        b = data[-k]
        if b & 0xC0 == 0x80:  # a continuation byte: look further back for the lead byte
            continue
        need = 2 if 0xC0 <= b < 0xE0 else 3 if 0xE0 <= b < 0xF0 else 4 if b >= 0xF0 else 1
        return len(data) - k if need > k else len(data)
    return len(data)


def iter_text_file(
    path: Path, compression: str | None = None, chunk_bytes: int = CHUNK_BYTES, field: str = "data.source"
):
    """A text file's content as decoded pieces of about ``chunk_bytes``, strictly UTF-8 (a UTF-8 BOM is dropped);
    a multi-byte character cut by a chunk boundary is carried to the next piece. Refused, with the byte offset,
    when it is not UTF-8 text; binary content (NUL bytes) is refused too. The policy is strict so nothing is
    silently mangled. Offsets count bytes of the (decompressed) content."""
    import importlib

    opener = importlib.import_module(compression).open if compression else open
    offset, pending, first = 0, b"", True  # offset: of pending[0] in the file
    try:
        with opener(path, "rb") as f:
            while True:
                chunk = f.read(chunk_bytes)
                nul = chunk.find(b"\x00")
                if nul >= 0:
                    raise UserError(
                        f"{field} {path} is binary (a NUL byte at offset {offset + len(pending) + nul}), not text",
                        fix=f"point {field} at text files (.txt/.json/.jsonl/.parquet/.csv, optionally .gz/.bz2/.xz)",
                    )
                data = pending + chunk
                if first and len(data) < 3 and chunk:
                    pending = data  # too short to tell a BOM yet
                    continue
                skip = 3 if first and data.startswith(b"\xef\xbb\xbf") else 0
                first = False
                cut = _utf8_tail(data) if chunk else len(data)
                try:
                    text = data[skip:cut].decode("utf-8")
                except UnicodeDecodeError as e:
                    at = offset + skip + e.start
                    raise UserError(
                        f"{field} {path} is not UTF-8 (byte offset {at}: {data[skip + e.start : skip + e.start + 4]!r})",
                        fix="convert it to UTF-8, e.g. iconv -f latin1 -t utf-8",
                    ) from e
                if text:
                    yield text
                offset, pending = offset + cut, data[cut:]
                if not chunk:
                    return
    except (OSError, EOFError, *_decompress_errors(compression)) as e:
        raise UserError(
            f"{field} {path} cannot be read ({e})", fix="check the file (a truncated or mislabelled archive?)"
        ) from e


def _decompress_errors(compression: str | None) -> tuple[type[Exception], ...]:
    """What a truncated or mislabelled archive raises besides ``OSError``/``EOFError`` (``lzma.LZMAError``)."""
    if compression == "lzma":
        import lzma

        return (lzma.LZMAError,)
    return ()


def _table_values(builder: str, files: list[Path], text_field: str, batch_rows: int = 1000, field: str = "data.source"):
    """The ``text_field`` values of json/jsonl/parquet/csv files (``datasets``, whose Arrow cache is memory-mapped),
    one file at a time so an error names it, a batch of rows at a time. A table with no rows gives none."""
    import datasets

    section = field.rsplit(".", 1)[0]
    for f in files:
        try:
            ds = datasets.load_dataset(builder, data_files=[str(f)], split="train")
        except Exception as e:  # malformed JSON, not parquet, ...
            if _no_rows(builder, f):
                _skip_note(f, f"a {builder} table with no rows")  # valid; a source with no text at all is refused
                continue
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise UserError(
                f"{field} {f} cannot be read as {builder} ({first})", fix=f"check that the file is valid {builder}"
            ) from e
        if ds.num_rows == 0:
            _skip_note(f, f"a {builder} table with no rows")
            continue
        if text_field not in ds.column_names:
            raise UserError(
                f"{section}.text_field {text_field!r} is not a column of {f}",
                fix=f"columns: {', '.join(ds.column_names)}",
            )
        for batch in ds.select_columns([text_field]).iter(batch_size=batch_rows):
            values = [v for v in batch[text_field] if v is not None]
            bad = next((v for v in values if not isinstance(v, str)), None)
            if bad is not None:
                raise UserError(
                    f"{section}.text_field {text_field!r} of {f} holds {type(bad).__name__} values, not text",
                    fix=f"name a column of strings in {section}.text_field",
                )
            yield from values


def _no_rows(builder: str, path: Path) -> bool:
    """Whether a table file ``datasets`` could not load is a valid one without rows (a parquet file of zero rows,
    a CSV of only a header): those are skipped, not called unreadable."""
    try:
        if builder == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows == 0
        if builder == "csv":
            import csv

            with open(path, newline="", encoding="utf-8") as f:
                return sum(1 for _ in csv.reader(f)) <= 1
    except Exception:  # noqa: BLE001  not a valid table after all: the caller names the load error
        return False
    return False


_noted: set[Path] = set()  # files already announced as skipped (a source is listed several times per run)


def _skip_note(path: Path, why: str) -> None:
    import sys

    if path not in _noted:
        _noted.add(path)
        print(f"note: skipping {path}: {why}", file=sys.stderr)


def local_files(source: str, field: str = "data.source") -> list[Path] | None:
    """The data files of a local ``source`` (a file, or a directory searched recursively), in reading order;
    ``None`` when ``source`` is ``embedded``, ``generated`` (the model's own samples: ``sources.generated``; a
    directory of that name is ``./generated``) or names no local path (a hub dataset id). ``field`` names the setting
    in errors. A path that does not exist but looks like one (``./``, ``/``, ``~``, a data-file suffix such as
    ``calib.txt``, or more than one ``/``) is refused; in a directory, empty files are skipped with a note."""
    if source in (EMBEDDED, GENERATED):
        return None
    if not source.strip():  # Path("") is the current directory
        raise UserError(f"{field} is empty", fix="give a text file or directory, a hub dataset id, or 'embedded'")
    path = Path(source).expanduser()
    if not path.exists():
        if source.startswith((".", "/", "~")) or source.count("/") > 1 or _kind(path)[0] is not None:
            where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
            raise UserError(
                f"{field} {path} does not exist{where}", fix="give an existing file or directory, or a hub dataset id"
            )
        return None
    if path.is_dir():
        found = sorted(p for p in path.rglob("*") if _kind(p)[0] is not None and not p.is_dir())
        files = []
        for f in found:
            if not f.is_file():
                _skip_note(f, "not a regular file (a FIFO, socket or device)")
            elif f.stat().st_size == 0:
                _skip_note(f, "empty")
            else:
                files.append(f)
        if not files:
            raise UserError(
                f"{field} {path} holds no non-empty {'/'.join(_BUILDERS)} files (optionally .gz/.bz2/.xz)",
                fix=f"point {field} at a directory of text files, or at one file",
            )
    else:
        files = [path]
        if not path.is_file():
            raise UserError(
                f"{field} {path} is not a regular file (a FIFO, socket or device)",
                fix=f"point {field} at a file or a directory of text files",
            )
        if _kind(path)[0] is None:
            raise UserError(
                f"{field} {path}: unsupported file type {''.join(path.suffixes[-2:]) or '(none)'!r}",
                fix=f"use one of {', '.join(_BUILDERS)}, optionally compressed (.gz, .bz2, .xz)",
            )
        if path.stat().st_size == 0:
            raise UserError(f"{field} {path} is empty", fix=f"point {field} at a file with text in it")
    text_files = [f for f in files if _kind(f)[0] == "text"]
    tables = sorted((f for f in files if _kind(f)[0] != "text"), key=lambda f: _kind(f)[0])  # stable: by builder
    return text_files + tables


def _hub_dataset(source: str, split: str, text_field: str, field: str = "data.source"):
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # offline, unknown id, ...
        raise UserError(
            f"{field}: could not load dataset {source!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            fix=f"use a local file ({field}: path/to/file.txt) or go online",
        ) from e
    if text_field not in ds.column_names:
        raise UserError(
            f"{field.rsplit('.', 1)[0]}.text_field {text_field!r} is not a column of {source}",
            fix=f"columns: {', '.join(ds.column_names)}",
        )
    return ds


def iter_documents(
    source: str,
    text_field: str = "text",
    split: str = "train",
    chunk_bytes: int = CHUNK_BYTES,
    field: str = "data.source",
):
    """The documents of a data source, streamed: one iterator of text pieces per document (a ``.txt`` file is one
    document, read ``chunk_bytes`` at a time; a row of a table or a hub dataset is one document, one piece).
    Memory stays bounded by the chunk and batch sizes, not the source's. Blank documents are not filtered here.
    """
    if source == GENERATED:  # token ids sampled by the model, not text: read by TextDataModule.tokens_of alone
        raise UserError(
            f"{field} {GENERATED} (the FP model's own samples) is read as data.source or calibration.source only",
            fix=f"leave {field} null (the run's held-out data), or give a text file",
        )
    files = local_files(source, field)
    if source == EMBEDDED:
        for doc in embedded_corpus():
            yield iter((doc,))
    elif files is None:
        ds = _hub_dataset(source, split, text_field, field)
        for batch in ds.select_columns([text_field]).iter(batch_size=1000):
            for t in batch[text_field]:
                if isinstance(t, str) and t:
                    yield iter((t,))
    else:
        for f in files:
            builder, compression = _kind(f)
            if builder == "text":
                yield iter_text_file(f, compression, chunk_bytes, field)
        for builder, group in itertools.groupby([f for f in files if _kind(f)[0] != "text"], key=lambda f: _kind(f)[0]):
            for v in _table_values(builder, list(group), text_field, field=field):
                if v:
                    yield iter((v,))


def load_texts(source: str, text_field: str = "text", split: str = "train", field: str = "data.source") -> list[str]:
    """The documents of a data source, as a list of strings (whole in memory: ``sources.token_cache`` streams).

    A local source is a file or a directory (searched recursively) of ``.txt`` (one document per file),
    ``.json``/``.jsonl``/``.parquet``/``.csv`` (one document per row's ``text_field``), each optionally
    compressed (``.gz``, ``.bz2``, ``.xz``); kinds may be mixed in one directory. Text must be UTF-8.
    """
    if source == EMBEDDED:
        return embedded_corpus()
    local = local_files(source, field) is not None
    texts = ["".join(doc) for doc in iter_documents(source, text_field, split, field=field)]
    if not local:
        return texts
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UserError(
            f"{field} {Path(source).expanduser()} holds no text (no rows, or only blank ones)",
            fix=f"point {field} at non-empty text",
        )
    return texts


def tokenize_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """All documents as one 1-D token stream, documents separated by EOS."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)
