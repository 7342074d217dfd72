"""A source's token stream in bounded memory: documents streamed (``text.iter_documents``), tokenized a batch at a
time, written to a memory-mapped token cache that later runs (and DDP ranks) reuse.

The cache is a raw little-endian int64 array (no pickle, no header: its length is the file size / 8) under
``$QHARNESS_CACHE/tokens/<key>.i64``, the key hashing the source (each file's path, size and mtime), ``text_field``,
the tokenizer and the piece size. It is written under a temporary name and renamed when complete, under a lock,
so a killed build leaves no cache (its temp file is removed by the next build) and concurrent ranks build it once.
int64 so the blocks are plain ``torch.long`` views of the map (8 bytes a token on disk, pages loaded on use).

Tokens are identical to ``tokenize_stream(load_texts(source), tokenizer)`` for every document of at most
``WHOLE_PIECES * piece_chars`` characters (4 Mi by default): such a document is tokenized in one call. A longer one
(a 1 GB ``.txt``) is cut into pieces of about ``piece_chars`` at ends of words where tokenizing the
surrounding text whole and in two halves agree (checked at each cut; a cut where no candidate agrees is counted in
``stats["inexact_cuts"]``).

Example::

    stream = token_stream("corpus.txt", "text", tokenizer)   # torch.long, memory-mapped
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from qharness.errors import UserError
from qharness.io.atomic import umask
from qharness.io.locks import hold_lock
from qharness.sources.cache import cache_dir
from qharness.sources.text import CHUNK_BYTES, EMBEDDED, iter_documents, local_files

PIECE_CHARS = 1 << 16  # characters tokenized per piece of a long document (smaller pieces tokenize faster)
BATCH_CHARS = 1 << 20  # characters per tokenizer call (bounds the encodings held at once)
WHOLE_PIECES = 64  # a document of at most WHOLE_PIECES * piece_chars characters is tokenized whole
CUT_WINDOW = 256  # characters either side of a cut tokenized to check it
FORMAT = 1

stats = {"builds": 0, "inexact_cuts": 0}  # this process's cache builds (tests read it)


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides the token ids: the fast tokenizer's serialized pipeline (or the vocabulary) and EOS."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()


def cache_key(source: str, text_field: str, split: str, tokenizer, piece_chars: int, field: str = "data.source") -> str:
    """The cache's name: changes when a file of the source changes (path, size, mtime), or the tokenizer/settings."""
    blob = json.dumps(
        [FORMAT, source_id(source, split, field), text_field, piece_chars, tokenizer_fingerprint(tokenizer)]
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def source_id(source: str, split: str, field: str) -> list:
    """What identifies a source's content: each local file's path, size and mtime; a hub id and split."""
    files = local_files(source, field)
    if source == EMBEDDED:
        return ["embedded", sys.version, str(Path(os.__file__).parent)]
    if files is None:
        return ["hub", source, split]
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def _clean_cut(tokenizer, left: str, right: str) -> bool:
    whole = tokenizer([left + right, left, right], add_special_tokens=False)["input_ids"]
    return whole[0] == whole[1] + whole[2]


_CUT = re.compile(r"\S(?=\s)")  # a word's end before whitespace: byte-level BPE pre-tokenizers split there


def _cut(text: str, target: int, tokenizer) -> int:
    """A position at most ``target`` (and past ``target // 2``) to cut a long document: the last end of a word
    (before whitespace) where the tokens of the surrounding text do not change by the cut; else the last end of a
    word, else ``target``."""
    lo = max(1, target // 2)
    candidates = [m.end() for m in _CUT.finditer(text, lo - 1, target + 1)]
    for c in reversed(candidates[-16:]):
        if _clean_cut(tokenizer, text[max(0, c - CUT_WINDOW) : c], text[c : c + CUT_WINDOW]):
            return c
    stats["inexact_cuts"] += 1
    return candidates[-1] if candidates else target


def document_pieces(pieces: Iterable[str], tokenizer, piece_chars: int) -> Iterator[str]:
    """One document's text as pieces to tokenize: the whole document when it has at most
    ``WHOLE_PIECES * piece_chars`` characters (blank documents: nothing), else cuts of about ``piece_chars``."""
    buf, long = "", False
    for p in pieces:
        buf += p
        if not long and len(buf) <= WHOLE_PIECES * piece_chars:
            continue
        long = True
        while len(buf) >= 2 * piece_chars:
            c = _cut(buf, piece_chars, tokenizer)
            yield buf[:c]
            buf = buf[c:]
    if buf and (long or buf.strip()):
        yield buf


def _token_arrays(source: str, text_field: str, split: str, tokenizer, piece_chars: int, chunk_bytes: int, field: str):
    """int64 arrays of the token stream, documents separated by EOS, one tokenizer batch at a time."""
    eos = tokenizer.eos_token_id
    batch, ends, size = [], [], 0

    def flush():
        ids: list[int] = []
        for enc, end in zip(tokenizer(batch, add_special_tokens=False)["input_ids"], ends):
            ids.extend(enc)
            if end and eos is not None:
                ids.append(eos)
        batch.clear(), ends.clear()
        return np.asarray(ids, dtype=np.int64)

    for doc in iter_documents(source, text_field, split, chunk_bytes, field):
        it = document_pieces(doc, tokenizer, piece_chars)
        cur = next(it, None)
        while cur is not None:
            nxt = next(it, None)
            batch.append(cur), ends.append(nxt is None)
            size += len(cur)
            if size >= BATCH_CHARS:
                yield flush()
                size = 0
            cur = nxt
    if batch:
        yield flush()


def open_tokens(path: Path) -> torch.Tensor:
    n = path.stat().st_size // 8
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.from_numpy(np.memmap(path, dtype="<i8", mode="c", shape=(n,)))  # copy-on-write: the file never changes


def token_stream(
    source: str,
    text_field: str,
    tokenizer,
    split: str = "train",
    piece_chars: int = PIECE_CHARS,
    chunk_bytes: int = CHUNK_BYTES,
    field: str = "data.source",
) -> torch.Tensor:
    """The source's 1-D token stream (``torch.long``, memory-mapped from the token cache; built on first use);
    ``field`` names the setting in errors (``calibration.source``)."""
    root = cache_dir() / "tokens"
    root.mkdir(parents=True, exist_ok=True)
    key = cache_key(source, text_field, split, tokenizer, piece_chars, field)
    path = root / f"{key}.i64"
    if path.is_file():
        return open_tokens(path)
    # another rank or run building the same cache: wait for it (saying whom for; a stopped one is given up on)
    with hold_lock(root / f"{key}.lock", f"tokenizing data.source {source} into the token cache"):
        if not path.is_file():
            for stale in root.glob(f".{key}.i64.*.tmp"):  # a killed build's (we hold the lock)
                stale.unlink(missing_ok=True)
            _build(path, source, text_field, split, tokenizer, piece_chars, chunk_bytes, field)
    return open_tokens(path)


def _build(path: Path, source, text_field, split, tokenizer, piece_chars, chunk_bytes, field) -> None:
    stats["builds"] += 1
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())  # the mode any new file gets (mkstemp makes 0600)
        n = 0
        with os.fdopen(fd, "wb") as f:
            for arr in _token_arrays(source, text_field, split, tokenizer, piece_chars, chunk_bytes, field):
                f.write(arr.astype("<i8", copy=False).tobytes())
                n += len(arr)
            f.flush()
            os.fsync(f.fileno())
        if n == 0 and local_files(source, field) is not None:
            raise UserError(
                f"{field} {Path(source).expanduser()} holds no text (no rows, or only blank ones)",
                fix=f"point {field} at non-empty text",
            )
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
