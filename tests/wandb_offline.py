"""Read an offline wandb run back: the tables it logged (JSON files) and the records of its ``.wandb`` file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 7-byte header, then records in 32 KiB blocks
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def offline_run(parent: Path) -> Path:
    runs = sorted(Path(parent).glob("wandb/offline-run-*"))
    assert runs, f"no offline wandb run under {parent}/wandb"
    return runs[-1]


def tables(run: Path, key: str) -> list[dict]:
    """The JSON of every table logged under ``key`` (``files/media/table/<key>_<step>_<hash>.table.json``)."""
    base = run / "files" / "media" / "table"
    return [json.loads(p.read_text()) for p in sorted(base.glob(f"{key}_*.table.json"))]


def records(run: Path):
    """The protobuf records (``wandb_internal_pb2.Record``) of the run's ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run.glob("*.wandb")).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the next block
            pos += left
            continue
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def history(run: Path) -> list[dict]:
    """Every logged history row as {key: value} (JSON-decoded)."""
    rows = []
    for r in records(run):
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def config(run: Path) -> dict:
    """The run's config (``wandb.init(config=...)`` and later updates), values JSON-decoded."""
    out = {}
    for r in records(run):
        kind = r.WhichOneof("record_type")
        items = r.run.config.update if kind == "run" else r.config.update if kind == "config" else []
        for i in items:
            out[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    return out
