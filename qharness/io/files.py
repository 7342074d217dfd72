"""What a path given as an input file is, asked before opening it (a FIFO would block, a device never end)."""

from __future__ import annotations

import os
import stat


def file_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be read as a file, without opening it: ``"does not exist"``, ``"is a directory"``, ``"is
    not a regular file (a FIFO)"`` (a FIFO, a device such as /dev/zero, a socket: reading one may block or never
    end), or None for a regular file (or a link to one)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except (OSError, ValueError) as e:  # permission on a parent, a name too long, a NUL byte
        return f"cannot be read ({getattr(e, 'strerror', None) or e})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    kind = (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "no regular file"
    )
    return f"is not a regular file ({kind})"
