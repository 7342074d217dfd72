"""Chat and instruction examples -> one token stream and its targets, memory-mapped and cached like text.

Examples (``sources.chat``: rendered with the chat template, their answer tokens marked) are concatenated into one
token stream. Beside it, a target stream of the same length: ``targets[t]`` is ``tokens[t]`` where token ``t`` is
trained (an answer token, or any token with ``train_on: all``) and -100 (ignored by the loss) elsewhere, and always
-100 at the first token of each example, so nothing is trained across an example boundary. Blocks take their
inputs from the tokens and their next-token targets from ``targets[1:]``.

Under ``$QHARNESS_CACHE/tokens/``: ``<key>.i64`` (tokens), ``<key>.y.i64`` (targets), ``<key>.json`` (the counts:
examples, tokens, trained tokens, truncated, dropped); the key hashes the source files, the tokenizer, the template
and the format's settings (plain-text caches have other keys and are unchanged). The tokens file is renamed into
place last: it exists only once the others do.

Example::

    tokens, targets, counts = example_stream("chats.jsonl", ChatFormat(kind="chat", max_tokens=129), tokenizer)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from qharness.errors import UserError
from qharness.io.atomic import atomic_writer, write_json_atomic
from qharness.io.locks import hold_lock
from qharness.sources.cache import cache_dir
from qharness.sources.chat import ChatFormat, check_template, iter_records, record_files, render, to_messages
from qharness.sources.token_cache import FORMAT, open_tokens, source_id, stats, tokenizer_fingerprint

IGNORE = -100  # the target value the loss skips (torch's cross_entropy ignore_index)


def example_key(source: str, fmt: ChatFormat, tokenizer) -> str:
    template = fmt.template if fmt.template is not None else (tokenizer.chat_template or "")
    blob = json.dumps(
        [FORMAT, "examples", source_id(source, "train", fmt.field), fmt.key(), tokenizer_fingerprint(tokenizer)]
        + [hashlib.sha256(template.encode()).hexdigest()]
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def example_stream(source: str, fmt: ChatFormat, tokenizer) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(tokens, targets, counts)`` of a chat/instruction source (memory-mapped from the cache; built on first use)."""
    files = record_files(source, fmt.field)
    check_template(tokenizer, fmt.template)
    root = cache_dir() / "tokens"
    root.mkdir(parents=True, exist_ok=True)
    key = example_key(source, fmt, tokenizer)
    tokens, targets, counts = root / f"{key}.i64", root / f"{key}.y.i64", root / f"{key}.json"
    if not tokens.is_file():
        with hold_lock(root / f"{key}.lock", f"rendering and tokenizing {fmt.field} {source} into the token cache"):
            if not tokens.is_file():
                _build(files, fmt, tokenizer, tokens, targets, counts)
    return open_tokens(tokens), open_tokens(targets), json.loads(counts.read_text())


def _build(files: list[Path], fmt: ChatFormat, tokenizer, tokens: Path, targets: Path, counts: Path) -> None:
    """Streams the examples into both files (bounded memory); the targets and counts are in place before the tokens
    file is renamed into place, which is last."""
    stats["builds"] += 1
    with atomic_writer(tokens) as ft:
        with atomic_writer(targets) as fy:
            n = _write_examples(files, fmt, tokenizer, ft, fy)
        write_json_atomic(counts, n)


def _write_examples(files: list[Path], fmt: ChatFormat, tokenizer, ft, fy) -> dict:
    n = {"examples": 0, "tokens": 0, "trained_tokens": 0, "truncated": 0, "dropped": 0}
    longest = None
    for where, record in iter_records(files, fmt.field):
        ids, trained = render(tokenizer, to_messages(record, where, fmt), fmt.template, fmt.train_on, where)
        if len(ids) > fmt.max_tokens:
            if fmt.long_examples == "drop":
                n["dropped"] += 1
                longest = longest or (where, len(ids))
                n.setdefault("first_dropped", f"{where}: {len(ids)} tokens")
                continue
            n["truncated"] += 1
            ids, trained = ids[: fmt.max_tokens], trained[: fmt.max_tokens]
        ids_arr = np.asarray(ids, dtype="<i8")
        y = np.where(np.asarray(trained, dtype=bool), ids_arr, IGNORE).astype("<i8")
        y[0] = IGNORE  # no target crosses into an example from the one before
        ft.write(ids_arr.tobytes())
        fy.write(y.tobytes())
        n["examples"] += 1
        n["tokens"] += len(ids)
        n["trained_tokens"] += int((y != IGNORE).sum())
    if n["examples"] == 0:
        if longest is not None:
            raise UserError(
                f"{fmt.field}: every record is longer than data.seq_len + 1 = {fmt.max_tokens} tokens and "
                f"data.long_examples is drop (e.g. {longest[0]}: {longest[1]} tokens)",
                fix="raise data.seq_len, or set data.long_examples: truncate",
            )
        raise UserError(f"{fmt.field} holds no records", fix=f"point {fmt.field} at chat or instruction records")
    if n["trained_tokens"] == 0:
        raise UserError(
            f"{fmt.field}: no token is trained (every answer lies beyond the first data.seq_len + 1 = "
            f"{fmt.max_tokens} tokens of its example)",
            fix="raise data.seq_len, or set data.long_examples: drop",
        )
    return n


def describe(counts: dict, fmt: ChatFormat) -> str:
    """The data line printed at preparation."""
    line = (
        f"data: {counts['examples']:,} {fmt.kind} examples, {counts['tokens']:,} tokens, "
        f"{counts['trained_tokens']:,} trained ({'answers' if fmt.train_on == 'answers' else 'all tokens'})"
    )
    if counts["truncated"]:
        line += f", {counts['truncated']:,} truncated to their first {fmt.max_tokens} tokens"
    if counts["dropped"]:
        first = counts.get("first_dropped", "")
        line += f", {counts['dropped']:,} dropped (longer than {fmt.max_tokens} tokens; {first})"
    return line
