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


def load_texts(source: str, text_field: str = "text", split: str = "train") -> list[str]:
    """The documents of a data source, as a list of strings."""
    if source == EMBEDDED:
        return embedded_corpus()
    import datasets

    path = Path(source).expanduser()
    if path.exists():
        files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS) if path.is_dir() else [path]
        if not files:
            raise UserError(f"data.source {path} holds no {'/'.join(_BUILDERS)} files")
        builder = _BUILDERS.get(files[0].suffix)
        if builder is None:
            raise UserError(f"data.source {path}: unsupported file type {files[0].suffix!r}", fix=f"use one of {', '.join(_BUILDERS)}")
        if any(f.stat().st_size == 0 for f in files):
            raise UserError(f"data.source {next(f for f in files if f.stat().st_size == 0)} is empty")
        kwargs = {"sample_by": "document"} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **kwargs)
    elif source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise UserError(f"data.source {path} does not exist", fix="give an existing file or directory, or a hub dataset id")
    else:
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as e:  # offline, unknown id, ...
            raise UserError(
                f"could not load dataset {source!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                fix="use a local file (data.source: path/to/file.txt) or go online",
            ) from e
    if text_field not in ds.column_names:
        raise UserError(f"data.text_field {text_field!r} is not a column of {source}", fix=f"columns: {', '.join(ds.column_names)}")
    return [t for t in ds[text_field] if t]


def tokenize_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """All documents as one 1-D token stream, documents separated by EOS."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)

