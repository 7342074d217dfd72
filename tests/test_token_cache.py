"""The streamed token cache: the same tokens and blocks as the in-memory path, reused across
runs, rebuilt when the file changes, UTF-8 read in bounded chunks with the file and byte offset of bad bytes."""

import json
import os

import pytest
import torch

from qharness.data.datamodule import TextDataModule, pack
from qharness.errors import UserError
from qharness.sources import token_cache
from qharness.sources.text import iter_text_file, load_texts, tokenize_stream
from qharness.sources.token_cache import token_stream


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))


def test_same_tokens_and_blocks_as_the_in_memory_path(tiny_llama, tok, corpus):
    dm = TextDataModule(source=str(corpus), tokenizer=str(tiny_llama), seq_len=32, batch_size=4)
    dm.setup()
    old = tokenize_stream(load_texts(str(corpus)), tok)
    assert torch.equal(token_stream(str(corpus), "text", tok), old)
    n_val = int(len(old) * 0.1)
    for (x, y), (ox, oy) in zip(
        ((dm.train_x, dm.train_y), (dm.val_x, dm.val_y)),
        (pack(old[: len(old) - n_val], 32), pack(old[len(old) - n_val :], 32)),
    ):
        assert torch.equal(x, ox) and torch.equal(y, oy) and x.dtype == torch.long


@pytest.mark.fast
def test_a_folder_of_mixed_files_gives_the_in_memory_tokens(tok, tmp_path, corpus):
    text = corpus.read_text()[:30_000]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text(text[:10_000])
    (tmp_path / "d" / "blank.txt").write_text("  \n")
    (tmp_path / "d" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text.split("\n\n")))
    src = str(tmp_path / "d")
    assert torch.equal(token_stream(src, "text", tok), tokenize_stream(load_texts(src), tok))


@pytest.mark.fast
def test_a_long_document_cut_into_pieces_tokenizes_as_a_whole(tok, tmp_path, corpus):
    path = tmp_path / "long.txt"
    path.write_text(corpus.read_text()[:60_000])
    before = token_cache.stats["inexact_cuts"]
    streamed = token_stream(str(path), "text", tok, piece_chars=500, chunk_bytes=777)  # > 64 pieces: cut
    assert torch.equal(streamed, tokenize_stream([path.read_text()], tok))
    assert token_cache.stats["inexact_cuts"] == before


@pytest.mark.fast
def test_second_run_reads_the_cache_and_a_changed_file_is_rebuilt(tok, tmp_path, corpus, monkeypatch):
    path = tmp_path / "c.txt"
    path.write_text(corpus.read_text()[:20_000])
    builds = token_cache.stats["builds"]
    first = token_stream(str(path), "text", tok)
    (cached,) = (tmp_path / "cache" / "tokens").glob("*.i64")
    stamp = cached.stat().st_mtime_ns
    assert token_cache.stats["builds"] == builds + 1

    class NoTokenizing:  # the same fingerprint, but tokenizing fails: the second run must not tokenize
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, *a, **k):
            raise AssertionError("re-tokenized")

    monkeypatch.setattr(token_cache, "tokenizer_fingerprint", lambda t: "same")
    token_stream(str(path), "text", tok)  # cache under the patched fingerprint
    again = token_stream(str(path), "text", NoTokenizing(tok))
    assert torch.equal(again, first) and token_cache.stats["builds"] == builds + 2
    assert cached.stat().st_mtime_ns == stamp

    with path.open("a") as f:
        f.write("\nmore text at the end")
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    changed = token_stream(str(path), "text", tok)
    assert token_cache.stats["builds"] == builds + 3 and len(changed) > len(first)


@pytest.mark.fast
def test_a_killed_build_leaves_no_cache_and_its_temp_file_is_removed(tok, tmp_path, corpus, monkeypatch):
    path = tmp_path / "k.txt"
    path.write_text(corpus.read_text()[:5_000])

    def killed(*a, **k):
        yield torch.zeros(3, dtype=torch.long).numpy()
        raise KeyboardInterrupt

    monkeypatch.setattr(token_cache, "_token_arrays", killed)
    with pytest.raises(KeyboardInterrupt):
        token_stream(str(path), "text", tok)
    root = tmp_path / "cache" / "tokens"
    assert not list(root.glob("*.i64")) and not list(root.glob(".*.tmp"))
    key = token_cache.cache_key(str(path), "text", "train", tok, token_cache.PIECE_CHARS)
    (root / f".{key}.i64.abc.tmp").write_bytes(b"half")  # as a SIGKILL would leave it
    monkeypatch.undo()
    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    assert torch.equal(token_stream(str(path), "text", tok), tokenize_stream([path.read_text()], tok))
    assert not list(root.glob(".*.tmp"))


TEXT = "\ufeffhé wörld € 𝄞 naïve\nzwei\n"


@pytest.mark.fast
@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 1 << 20])
def test_multibyte_characters_across_chunk_boundaries(tmp_path, tok, chunk):
    path = tmp_path / "u.txt"
    path.write_bytes(TEXT.encode("utf-8") * 3)
    assert "".join(iter_text_file(path, None, chunk)) == TEXT[1:] + TEXT * 2
    assert torch.equal(
        token_stream(str(path), "text", tok, chunk_bytes=chunk), tokenize_stream([TEXT[1:] + TEXT * 2], tok)
    )


@pytest.mark.fast
@pytest.mark.parametrize(
    "content, message",
    [
        (b"abc" * 10 + b"\xff rest", r"bad.txt is not UTF-8 \(byte offset 30"),
        ("é".encode() * 5 + b"\xc3(", r"bad.txt is not UTF-8 \(byte offset 10"),
        (b"ab\xe2\x82", r"bad.txt is not UTF-8 \(byte offset 2"),
        (b"\xef\xbb\xbfabcd\x80", r"bad.txt is not UTF-8 \(byte offset 7"),
        (b"plain text " * 3 + b"\x00", r"bad.txt is binary \(a NUL byte at offset 33\)"),
    ],
)
def test_bad_bytes_are_reported_with_the_file_and_byte_offset_at_any_chunk_size(tmp_path, tok, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    for chunk in (1, 4, 1 << 20):
        with pytest.raises(UserError, match=message):
            token_stream(str(path), "text", tok, chunk_bytes=chunk)
    assert not list((tmp_path / "cache" / "tokens").glob("*.i64"))
