"""Peak memory of data preparation on a large text source.

Builds (or takes) a text file of at least ``--size_gb`` GB, then prepares it in a fresh process as a run does
(``TextDataModule.setup``: stream, tokenize, write the token cache, pack blocks, split) and prints the file size,
the peak RSS of that process, the RSS of its imports alone, the time, tokens/s and peak RSS / file size.
Each run uses a fresh token cache unless ``--reuse_cache`` (then a second run shows the cost of reading the cache).

Example::

    python scripts/bench_data_memory.py --size_gb 1.0 --workdir /tmp/qh_data_bench
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def base_text() -> str:
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text(encoding="utf-8")
    from qharness.sources.text import embedded_corpus

    return "\n\n".join(embedded_corpus(1_100_000))


def make_inputs(workdir: Path, size_gb: float) -> tuple[Path, Path]:
    """``workdir/big.txt`` (the base text repeated to ``size_gb`` GB, one document) and a tiny BPE tokenizer on it."""
    from qharness.sources.tokenizer import train_bpe_tokenizer

    text = base_text()
    tok_dir = workdir / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        train_bpe_tokenizer([text], 384).save_pretrained(tok_dir)
    big = workdir / "big.txt"
    target = int(size_gb * 1e9)
    if not big.is_file() or big.stat().st_size < target:
        data, n = text.encode(), 0
        tmp = big.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            while n < target:
                f.write(data)
                n += len(data)
        os.replace(tmp, big)
    return big, tok_dir


def child(source: str, tok_dir: str) -> None:
    """One preparation, in this (fresh) process: prints a JSON line."""
    t0 = time.perf_counter()
    from transformers import AutoTokenizer

    from qharness.data.datamodule import TextDataModule
    from qharness.sources import token_cache

    imports_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    dm = TextDataModule(source=source, tokenizer=tok_dir, seq_len=128, batch_size=8)
    dm.tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    t1 = time.perf_counter()
    dm.setup()
    t2 = time.perf_counter()
    tokens = dm.train_x.numel() + dm.val_x.numel()
    print(
        json.dumps(
            dict(
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                imports_rss=imports_rss,
                setup_s=t2 - t1,
                total_s=t2 - t0,
                tokens=tokens,
                train_blocks=len(dm.train_x),
                val_blocks=len(dm.val_x),
                builds=token_cache.stats["builds"],
                inexact_cuts=token_cache.stats["inexact_cuts"],
            )
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--file", help="an existing text file (else one is built in --workdir)")
    p.add_argument("--tokenizer", help="a tokenizer directory (else a tiny BPE trained on the base text)")
    p.add_argument("--size_gb", type=float, default=1.0)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "qh_data_bench"))
    p.add_argument("--reuse_cache", action="store_true", help="keep the token cache in --workdir between runs")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(*a.child)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    big, tok = make_inputs(work, a.size_gb) if not (a.file and a.tokenizer) else (Path(a.file), Path(a.tokenizer))
    if a.file:
        big = Path(a.file)
    if a.tokenizer:
        tok = Path(a.tokenizer)
    with tempfile.TemporaryDirectory(dir=work) as fresh:
        env = dict(os.environ, QHARNESS_CACHE=str(work / "cache") if a.reuse_cache else fresh)
        env.setdefault("TOKENIZERS_PARALLELISM", "true")
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(big), str(tok)], env=env, capture_output=True, text=True
        )
        if out.returncode:
            sys.exit(out.stderr[-3000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
    size = big.stat().st_size
    gib = 1 << 30
    print(
        f"file {size / 1e9:.3f} GB | peak RSS {r['peak_rss'] / gib:.3f} GiB (imports alone {r['imports_rss'] / gib:.3f}) "
        f"| peak RSS / file size {r['peak_rss'] / size:.3f} | setup {r['setup_s']:.3f} s | "
        + (
            f"{r['tokens'] / r['setup_s'] / 1e6:.2f} M tokens/s ({size / r['setup_s'] / 1e6:.2f} MB/s) | "
            if r["builds"]
            else "read from the token cache (no tokenizing) | "
        )
        + f"{r['tokens']} tokens, {r['train_blocks']} + {r['val_blocks']} blocks | cache builds {r['builds']} "
        f"| inexact cuts {r['inexact_cuts']}"
    )


if __name__ == "__main__":
    main()
