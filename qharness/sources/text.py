"""Sources of text: the embedded corpus (text that ships with Python), local files and directories, hub datasets;
and text -> one token stream.

Example::

    stream = tokenize_stream(load_texts("../shared/data/tinyshakespeare/input.txt"), tokenizer)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from qharness.errors import UserError

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


def _read_text(path: Path, compression: str | None) -> str:
    """A text file's content, strictly UTF-8 (a UTF-8 BOM is dropped). Refused, with the byte offset, when it is
    not UTF-8 text; binary content (NUL bytes) is refused too. The policy is strict so nothing is silently mangled."""
    import importlib

    opener = importlib.import_module(compression).open if compression else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise UserError(
            f"data.source {path} cannot be read ({e})", fix="check the file (a truncated or mislabelled archive?)"
        ) from e
    nul = data.find(b"\x00")
    if nul >= 0:
        raise UserError(
            f"data.source {path} is binary (a NUL byte at offset {nul}), not text",
            fix="point data.source at text files (.txt/.json/.jsonl/.parquet/.csv, optionally .gz/.bz2/.xz)",
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(
            f"data.source {path} is not UTF-8 (byte offset {e.start}: {data[e.start : e.start + 4]!r})",
            fix="convert it to UTF-8, e.g. iconv -f latin1 -t utf-8",
        ) from e


def _load_table(builder: str, files: list[Path], text_field: str) -> list[str]:
    """The ``text_field`` column of json/jsonl/parquet/csv files (``datasets``), one file at a time so an error names it."""
    import datasets

    out = []
    for f in files:
        try:
            ds = datasets.load_dataset(builder, data_files=[str(f)], split="train")
        except Exception as e:  # malformed JSON, not parquet, ...
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise UserError(
                f"data.source {f} cannot be read as {builder} ({first})", fix=f"check that the file is valid {builder}"
            ) from e
        if text_field not in ds.column_names:
            raise UserError(
                f"data.text_field {text_field!r} is not a column of {f}", fix=f"columns: {', '.join(ds.column_names)}"
            )
        values = [v for v in ds[text_field] if v is not None]
        bad = next((v for v in values if not isinstance(v, str)), None)
        if bad is not None:
            raise UserError(
                f"data.text_field {text_field!r} of {f} holds {type(bad).__name__} values, not text",
                fix="name a column of strings in data.text_field",
            )
        out.extend(v for v in values if v)
    return out


def load_texts(source: str, text_field: str = "text", split: str = "train") -> list[str]:
    """The documents of a data source, as a list of strings.

    A local source is a file or a directory (searched recursively) of ``.txt`` (one document per file),
    ``.json``/``.jsonl``/``.parquet``/``.csv`` (one document per row's ``text_field``), each optionally
    compressed (``.gz``, ``.bz2``, ``.xz``); kinds may be mixed in one directory. Text must be UTF-8.
    """
    if source == EMBEDDED:
        return embedded_corpus()
    if not source.strip():  # Path("") is the current directory
        raise UserError("data.source is empty", fix="give a text file or directory, a hub dataset id, or 'embedded'")
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and _kind(p)[0] is not None)
            if not files:
                raise UserError(
                    f"data.source {path} holds no {'/'.join(_BUILDERS)} files (optionally .gz/.bz2/.xz)",
                    fix="point data.source at a directory of text files, or at one file",
                )
        else:
            files = [path]
            if _kind(path)[0] is None:
                raise UserError(
                    f"data.source {path}: unsupported file type {''.join(path.suffixes[-2:]) or '(none)'!r}",
                    fix=f"use one of {', '.join(_BUILDERS)}, optionally compressed (.gz, .bz2, .xz)",
                )
        empty = next((f for f in files if f.stat().st_size == 0), None)
        if empty is not None:
            raise UserError(f"data.source {empty} is empty", fix="point data.source at a file with text in it")
        texts, tables = [], {}
        for f in files:
            builder, compression = _kind(f)
            if builder == "text":
                texts.append(_read_text(f, compression))
            else:
                tables.setdefault(builder, []).append(f)
        for builder, group in sorted(tables.items()):
            texts.extend(_load_table(builder, group, text_field))
        texts = [t for t in texts if t.strip()]
        if not texts:
            raise UserError(f"data.source {path} holds no text", fix="point data.source at non-empty text")
        return texts
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise UserError(
            f"data.source {path} does not exist", fix="give an existing file or directory, or a hub dataset id"
        )
    import datasets

    try:
        ds = datasets.load_dataset(source, split=split)
    except Exception as e:  # offline, unknown id, ...
        raise UserError(
            f"could not load dataset {source!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
            fix="use a local file (data.source: path/to/file.txt) or go online",
        ) from e
    if text_field not in ds.column_names:
        raise UserError(
            f"data.text_field {text_field!r} is not a column of {source}", fix=f"columns: {', '.join(ds.column_names)}"
        )
    return [t for t in ds[text_field] if isinstance(t, str) and t]


def tokenize_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """All documents as one 1-D token stream, documents separated by EOS."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)
