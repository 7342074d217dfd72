"""Local text sources: mixed folders, compressed files, and one-line refusals of what is not text."""

import bz2
import gzip
import json

import pytest

from qharness.errors import UserError
from qharness.sources.text import load_texts


def test_a_folder_of_mixed_and_compressed_files_loads_every_document(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ("row one", "row two")))
    with gzip.open(tmp_path / "c.txt.gz", "wt") as f:
        f.write("gzip text")
    with bz2.open(tmp_path / "d.jsonl.bz2", "wt") as f:
        f.write(json.dumps({"text": "bz2 row"}) + "\n")
    (tmp_path / "e.csv").write_text("text,n\ncsv row,1\n")
    (tmp_path / "notes.md").write_text("not a data file: ignored")
    assert sorted(load_texts(str(tmp_path))) == sorted(
        ["plain text", "gzip text", "row one", "row two", "bz2 row", "csv row"]
    )


def test_utf8_bom_is_dropped(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufeffhello".encode("utf-8"))
    assert load_texts(str(tmp_path / "a.txt")) == ["hello"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("latin1.txt", "café au lait".encode("latin-1"), r"latin1.txt is not UTF-8 \(byte offset 3"),
        ("blob.txt", b"\x7fELF\x00\x01\x02", r"blob.txt is binary \(a NUL byte at offset 4\)"),
        ("bad.jsonl", b"{not json\n", r"bad.jsonl cannot be read as json"),
        ("fake.parquet", b"not parquet at all", r"fake.parquet cannot be read as parquet"),
        ("numbers.jsonl", b'{"text": 5}\n', r"data.text_field 'text' of .*numbers.jsonl holds int values"),
        ("other.jsonl", b'{"body": "x"}\n', r"data.text_field 'text' is not a column of .*other.jsonl.*columns: body"),
        ("broken.txt.gz", b"not gzip", r"broken.txt.gz cannot be read"),
        ("empty.txt", b"", r"empty.txt is empty"),
        ("blank.txt", b"   \n\n", r"holds no text"),
        ("data.bin", b"abc", r"unsupported file type '.bin'"),
    ],
)
def test_what_is_not_text_is_one_line_naming_the_file(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=message):
        load_texts(str(tmp_path / name))


def test_a_bad_file_in_a_folder_is_named(tmp_path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "z_latin1.txt").write_bytes("naïve".encode("latin-1"))
    with pytest.raises(UserError, match=r"z_latin1.txt is not UTF-8"):
        load_texts(str(tmp_path))
