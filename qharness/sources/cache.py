"""Where qharness caches what it builds once (the embedded default, torchtune conversions, architecture checks):
``$QHARNESS_CACHE``, default ``~/.cache/qharness``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("QHARNESS_CACHE", Path.home() / ".cache" / "qharness"))
