"""The ``data`` group's own checks (``TextDataModule``'s arguments), without torch: the CLI runs them before it loads anything."""

from __future__ import annotations

from pathlib import Path

from qharness.errors import UserError


def check_data_args(source: str, seq_len: int, batch_size: int, val_fraction: float) -> None:
    """``UserError`` naming the first bad field. A source that looks like a path (``./``, ``/``, ``~``) must exist.

    Example::

        check_data_args("embedded", seq_len=128, batch_size=8, val_fraction=0.1)   # fine
        check_data_args("./none.txt", 128, 8, 0.1)   # UserError: data.source ./none.txt does not exist
    """
    if not source.strip():
        raise UserError("data.source is empty", fix="give a text file or directory, a hub dataset id, or 'embedded'")
    if seq_len < 2:
        raise UserError(f"data.seq_len must be at least 2 (got {seq_len})", fix="e.g. data.seq_len: 128")
    if batch_size < 1:
        raise UserError(f"data.batch_size must be positive (got {batch_size})", fix="e.g. data.batch_size: 8")
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"data.val_fraction must lie in (0, 1) (got {val_fraction})", fix="e.g. data.val_fraction: 0.1")
    if source.startswith((".", "/", "~")) and not Path(source).expanduser().exists():
        raise UserError(
            f"data.source {source} does not exist", fix="give an existing file or directory, or a hub dataset id"
        )
