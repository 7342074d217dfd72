"""Seconds per test file of a default-suite run, for ``tests/durations.json`` (the order the two xdist workers take the
files in: longest first, so that they end together; ``tests/conftest.py``).

Usage::

    .venv/bin/python -m pytest --durations=0 --durations-min=0 > suite.log   # README command 2, with every duration
    .venv/bin/python scripts/test_durations.py suite.log > tests/durations.json

Stale figures only make the two workers end less evenly; a file missing from it runs after those it lists.
"""

from __future__ import annotations

import collections
import json
import re
import sys


def per_file(log: str) -> dict[str, float]:
    """``{file: seconds}`` from pytest's ``--durations`` lines (setup, call and teardown summed), longest first."""
    seconds: collections.Counter[str] = collections.Counter()
    for m in re.finditer(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+?)::", log, re.M):
        seconds[m.group(2)] += float(m.group(1))
    return {name: round(s, 1) for name, s in seconds.most_common()}


if __name__ == "__main__":
    print(json.dumps(per_file(open(sys.argv[1]).read()), indent=0))
