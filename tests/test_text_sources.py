"""Local text sources: mixed folders, compressed files, and one-line refusals of what is not text."""

import bz2
import gzip
import json

import pytest

from qharness.errors import UserError
from qharness.sources.text import load_texts


@pytest.mark.fast
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


@pytest.mark.fast
def test_utf8_bom_is_dropped(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufeffhello".encode("utf-8"))
    assert load_texts(str(tmp_path / "a.txt")) == ["hello"]


@pytest.mark.fast
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


@pytest.mark.fast
def test_a_bad_file_in_a_folder_is_named(tmp_path):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "z_latin1.txt").write_bytes("naïve".encode("latin-1"))
    with pytest.raises(UserError, match=r"z_latin1.txt is not UTF-8"):
        load_texts(str(tmp_path))


@pytest.mark.fast
def test_empty_and_special_files_in_a_folder_are_skipped_with_a_note(tmp_path, capsys):
    """One empty file no longer rejects a whole folder; a FIFO is not read (it would block) nor called empty."""
    import os

    (tmp_path / "a.txt").write_text("the text")
    (tmp_path / "b.txt").write_text("")
    os.mkfifo(tmp_path / "pipe.txt")
    assert load_texts(str(tmp_path)) == ["the text"]
    err = capsys.readouterr().err
    assert f"note: skipping {tmp_path / 'b.txt'}: empty" in err
    assert f"note: skipping {tmp_path / 'pipe.txt'}: not a regular file" in err
    (tmp_path / "a.txt").write_text("")
    with pytest.raises(UserError, match=r"holds no non-empty \.txt/\.json/\.jsonl/\.parquet/\.csv files"):
        load_texts(str(tmp_path))


@pytest.mark.fast
def test_a_fifo_is_not_called_empty(tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.txt")
    with pytest.raises(UserError, match=r"data.source .*pipe.txt is not a regular file \(a FIFO"):
        load_texts(str(tmp_path / "pipe.txt"))


@pytest.mark.fast
def test_valid_tables_without_rows_say_so(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")
    (tmp_path / "header.csv").write_text("text,n\n")
    for name in ("none.parquet", "header.csv"):
        with pytest.raises(UserError, match=rf"{name} holds no text \(no rows"):
            load_texts(str(tmp_path / name))
    (tmp_path / "rows.csv").write_text("text,n\nrow one,1\n")
    assert load_texts(str(tmp_path)) == ["row one"]  # the empty tables beside it are skipped


@pytest.mark.fast
def test_errors_name_the_field_the_source_came_from(tmp_path, monkeypatch):
    """A bare relative path (``calib.txt``) that does not exist is a missing file, not a hub dataset id, and the
    message names the setting it came from, not data.source."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"^calibration.source calib.txt does not exist \(relative to "):
        load_texts("calib.txt", field="calibration.source")
    (tmp_path / "calib.txt").write_text("calibration text")
    assert load_texts("calib.txt", field="calibration.source") == ["calibration text"]  # an existing one is a file
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match=r"^eval.text_field 'text' is not a column of bad.jsonl"):
        load_texts("bad.jsonl", field="eval.source")
