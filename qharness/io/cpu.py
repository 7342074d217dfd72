"""The CPU cores this process may run on and how busy they are (``/proc/stat``), for choosing thread counts on a
shared machine.

Example::

    cores = affinity()
    load = OtherLoad()
    ...                       # work
    load.update()             # -> about how many of ``cores`` other processes kept busy since the last call
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path


def affinity() -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def ticks(cpus: list[int], stat: str | None = None) -> dict[int, tuple[int, int]]:
    """``{cpu: (idle ticks, total ticks)}`` of ``cpus`` since boot (``/proc/stat``, or its text ``stat``; idle
    counts iowait, total leaves out guest time, which is counted in user time already). ``OSError`` without it."""
    out = {}
    for line in (Path("/proc/stat").read_text() if stat is None else stat).splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            n = [int(t) for t in fields]
            out[int(name[3:])] = (n[3] + n[4], sum(n[:8]))
    return out


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class OtherLoad:
    """How many of this process's cores other processes kept busy between calls of ``update``: the cores' busy time
    (``/proc/stat``) less this process's own CPU time, over the wall time. This process's own threads waiting on each
    other (spinning) count as its own time, not as load. ``read`` returns ``ticks``' dict (tests give their own)."""

    def __init__(self, cpus: list[int] | None = None, read=None):
        self.cpus = cpus or affinity()
        self._read = read or (lambda: ticks(self.cpus))
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        try:
            t = self._read()
        except (OSError, ValueError, IndexError):
            return None
        busy = sum(total - idle for idle, total in t.values()) / self._hz
        return busy, _own_cpu_s(), time.perf_counter()

    def update(self) -> float | None:
        """Cores busy with other processes since the last call (None where ``/proc/stat`` cannot be read)."""
        now, last = self._sample(), self._last
        self._last = now
        if now is None or last is None or now[2] <= last[2]:
            return None
        others = (now[0] - last[0]) - (now[1] - last[1])
        return max(0.0, min(float(len(self.cpus)), others / (now[2] - last[2])))
