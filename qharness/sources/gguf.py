"""A ``.gguf`` file (llama.cpp's format) as ``model.checkpoint``: read by transformers and converted once into a
``save_pretrained`` directory (float32 weights, the tokenizer with its chat template, the generation config), cached
under ``$QHARNESS_CACHE/gguf-<sha256 prefix>``; from there it is an ordinary HF checkpoint. A changed file (another
sha256) converts anew.

The weights are the file's, dequantized: a Q4_1 file's weights still sit on Q4_1's grid, so quantizing them onto
another 4-bit grid adds that grid's rounding error to Q4_1's.

``read_header`` checks a file without torch (the pre-check): GGUF's magic and version, the metadata, the tensor table,
and that the file holds every tensor's bytes. Whether transformers reads its architecture is transformers' answer, at
the conversion (one ``UserError`` line, before any training).

Example::

    gguf_dir("SmolLM2-135M-Instruct.Q4_1.gguf")   # -> ~/.cache/qharness/gguf-3f2a9c...  (converted on first use)
    gguf_source("SmolLM2-135M-Instruct.Q4_1.gguf").type   # -> "Q4_1"
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from qharness.errors import UserError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what transformers' reader (gguf-py) reads; version 1 predates 64-bit counts
FIX = "give a whole .gguf file as llama.cpp writes it (or a save_pretrained directory)"
# metadata value types (GGUF spec): fixed-size scalars by struct format; 8 is a string, 9 an array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS


def is_gguf(checkpoint: str) -> bool:
    """``model.checkpoint`` names a local ``.gguf`` file."""
    path = Path(checkpoint).expanduser()
    return path.suffix.lower() == ".gguf" and path.is_file()


@dataclass(frozen=True)
class Header:
    """What ``read_header`` found: the GGUF version, ``general.architecture`` and ``general.file_type`` (None when
    the file does not say)."""

    version: int
    architecture: str
    file_type: int | None


class _Cursor:
    """Little-endian reads from a buffer; ``struct.error`` past its end."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def one(self, fmt: str):
        return self.take(fmt)[0]

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise struct.error("past the end")
        self.pos += n

    def string(self) -> str:
        n = self.one("Q")
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start : self.pos]).decode("utf-8", "replace")

    def value(self, kind: int):
        """One metadata value: a scalar or a string; an array is stepped over (None)."""
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.take("IQ")
            if item in SCALARS:
                self.skip(count * struct.calcsize(SCALARS[item]))
            else:  # strings or arrays: each at least 8 bytes, so a bad count runs past the end soon
                for _ in range(count):
                    self.value(item)
            return None
        if kind not in SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.one(SCALARS[kind])


def read_header(path: Path) -> Header:
    """Check that ``path`` is a whole GGUF file, without torch: its magic and version (those transformers reads), its
    metadata and tensor table, and that it holds every tensor's bytes. Anything else is one ``UserError`` line.

    Example::

        read_header(Path("model.Q4_1.gguf")).architecture   # -> "llama"
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise UserError(f"model.checkpoint {path} is not a GGUF file (it does not start with 'GGUF')", fix=FIX)
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        cur = _Cursor(buf)
        cur.skip(4)
        version = cur.one("I")
        if version not in VERSIONS:
            raise UserError(
                f"model.checkpoint {path} is GGUF version {version}; transformers reads versions 2 and 3",
                fix="convert the model again with a current llama.cpp (convert_hf_to_gguf.py)",
            )
        n_tensors, n_kv = cur.take("QQ")
        meta = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.one("I"))
        end = 0
        for _ in range(n_tensors):
            cur.string()
            n_dims = cur.one("I")
            if n_dims > MAX_DIMS:
                raise ValueError(f"a tensor of {n_dims} dimensions")
            dims = cur.take("Q" * n_dims)
            kind, offset = cur.take("IQ")
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            elements = 1
            for d in dims:
                elements *= d
            end = max(end, offset + elements // block * block_bytes)
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
    except struct.error:
        raise UserError(f"model.checkpoint {path} is truncated ({size} bytes end inside its header)", fix=FIX) from None
    except (ValueError, KeyError) as e:  # an unknown value or tensor type
        raise UserError(f"model.checkpoint {path} is not a readable GGUF file ({e})", fix=FIX) from None
    finally:
        buf.close()
    if data_start + end > size:
        raise UserError(
            f"model.checkpoint {path} is truncated ({size} bytes; its tensors need {data_start + end})",
            fix="copy or download the file again",
        )
    architecture = meta.get("general.architecture")
    if not isinstance(architecture, str):
        raise UserError(f"model.checkpoint {path} has no general.architecture", fix=FIX)
    file_type = meta.get("general.file_type")
    return Header(version, architecture, file_type if isinstance(file_type, int) else None)


def file_type_name(file_type: int | None) -> str | None:
    """``general.file_type`` as llama.cpp names it: ``Q4_1``, ``Q4_K_M``, ``Q8_0``, ``F16``, ``F32``, ..."""
    from gguf import LlamaFileType

    if file_type is None:
        return None
    try:
        name = LlamaFileType(file_type).name
    except ValueError:
        return f"file_type {file_type}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of ``path``'s bytes, computed once per process for a file of unchanged size and mtime."""
    stat = path.stat()
    return _sha256(str(path), stat.st_size, stat.st_mtime_ns)


@dataclass
class GgufSource:
    """The GGUF file a run's model was converted from (``summary.json``'s ``gguf``).

    Args:
        file: The ``.gguf`` file (absolute path).
        sha256: Digest of its bytes (the conversion's cache key).
        type: Its ``general.file_type`` as llama.cpp names it (``Q4_1``, ``Q4_K_M``, ``Q8_0``, ``F16``, ...): the
            grid its weights already sit on.
        converted: The float32 ``save_pretrained`` directory it was converted into.
    """

    file: str
    sha256: str
    type: str | None
    converted: str


def gguf_source(checkpoint: str) -> GgufSource | None:
    """The ``GgufSource`` of a ``model.checkpoint`` that is a ``.gguf`` file (checked with ``read_header``); None
    for any other checkpoint."""
    from qharness.sources.cache import cache_dir

    if not is_gguf(checkpoint):
        return None
    path = Path(checkpoint).expanduser().resolve()
    header = read_header(path)
    digest = file_sha256(path)
    return GgufSource(str(path), digest, file_type_name(header.file_type), str(cache_dir() / f"gguf-{digest[:16]}"))


def gguf_dir(checkpoint: str) -> Path:
    """The cached ``save_pretrained`` directory of a ``.gguf`` ``model.checkpoint``, converted on first use (another
    process converting it is waited for)."""
    from qharness.sources.cache import build_once

    source = gguf_source(checkpoint)
    out = Path(source.converted)
    return build_once(out, f"converting {source.file} ({source.type}) to float32", lambda: convert(source, out))


def convert(source: GgufSource, out: Path) -> None:
    """Read ``source.file`` with transformers (every weight dequantized to float32) and write it to ``out`` with
    ``save_pretrained`` (atomically). transformers refuses to save the model it read from a GGUF, so its weights go
    into a fresh model of the same config; every key must match, tied embeddings stay tied."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qharness.io.atomic import atomic_dir
    from qharness.io.temps import remove_stale_temps
    from qharness.upstream import imports

    path = Path(source.file)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            dtype=torch.float32,
            quantization_config=imports.gguf_dequantized(),
        )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, IndexError, TypeError, NotImplementedError, RuntimeError, OSError) as e:
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(
            f"model.checkpoint {path}: transformers cannot read this GGUF ({first[:300].rstrip('.')})",
            fix="use a GGUF of an architecture transformers reads (e.g. llama, qwen2, qwen3, gemma3, phi3), or the "
            "model's save_pretrained directory",
        ) from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF loader's, not the float model's
    with torch.device("meta"):  # no second copy of the weights, no random init: they are the loaded model's
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    model.tie_weights()
    if missing or unexpected:
        raise UserError(
            f"model.checkpoint {path}: the weights transformers read do not fit its model (missing "
            f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})",
            fix="use the model's save_pretrained directory",
        )
    model.generation_config = loaded.generation_config
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if tied != bool(config.get_text_config().tie_word_embeddings):  # save_pretrained would write one table, or two
        raise RuntimeError(f"{path}: converted embeddings tied={tied}, against its config")
    remove_stale_temps(out.parent)  # what a killed conversion (of any cached model) left behind
    with atomic_dir(out) as tmp:
        model.eval().save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "qharness_gguf.json").write_text(json.dumps(asdict(source), indent=2))
