"""Where qharness caches what it builds once (the embedded default, torchtune and GGUF conversions, architecture
checks): ``$QHARNESS_CACHE``, default ``~/.cache/qharness``; ``build_once`` builds a cached model directory once."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from qharness.io.locks import hold_lock

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("QHARNESS_CACHE", Path.home() / ".cache" / "qharness"))


def build_once(out: Path, what: str, build) -> Path:
    """``build()`` writes the model directory ``out`` unless it is there (holding ``out``'s lock: another process
    building it is waited for, saying ``what`` it builds, rather than built twice). Returns ``out``."""
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with hold_lock(out.with_name(out.name + ".lock"), f"{what} cached in {out}"):
            if not (out / "config.json").is_file():
                log.info("%s once (cached in %s)", what, out)
                build()
    return out
