"""The ``data`` section: ``TextDataModule``'s fields and their rules, torch-free.

``TextDataModule.__init__`` takes its fields from ``DataConfig`` (``TextDataModule(**fields)`` builds one), so the CLI's
``--data.*`` options, their ``--help`` text, the pre-torch check and the config reference come from this class.
"""

from __future__ import annotations

from dataclasses import dataclass

from qharness.config import check_source
from qharness.errors import UserError
from qharness.schema.fields import typed


@dataclass
class DataConfig:
    """Language-modelling data packed into fixed-length blocks.

    Args:
        source: ``embedded`` (text shipped with Python: documentation topics and stdlib sources), a local
            .txt/.json/.jsonl/.parquet/.csv file or directory, or a hub dataset id (online only).
        text_field: Column holding the text (json/parquet/csv/hub sources).
        tokenizer: Where the tokenizer comes from; linked to ``model.checkpoint`` (you rarely set it).
        seq_len: Tokens per block: the sequence length the model is trained and evaluated on.
        batch_size: Blocks per batch. Training graphs are exported with this static batch size.
        val_fraction: Fraction of the token stream (its end) held out for validation and parity checks.
        seed: Seed of the training-batch shuffle.
        trust_remote_code: Allow the tokenizer's own code from the hub (off by default; only for sources you trust).
    """

    source: str = "embedded"
    text_field: str = "text"
    tokenizer: str = "embedded"
    seq_len: int = 128
    batch_size: int = 8
    val_fraction: float = 0.1
    seed: int = 1234
    trust_remote_code: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """``UserError`` naming the first bad field. A source that looks like a path (``./``, ``/``, ``~``) must exist.

        Example::

            DataConfig(source="embedded", seq_len=128, batch_size=8, val_fraction=0.1)   # fine
            DataConfig(source="./none.txt")   # UserError: data.source ./none.txt does not exist
        """
        typed(self, "data")
        if self.seq_len < 2:
            raise UserError(f"data.seq_len must be at least 2 (got {self.seq_len})", fix="e.g. data.seq_len: 128")
        if self.batch_size < 1:
            raise UserError(f"data.batch_size must be positive (got {self.batch_size})", fix="e.g. data.batch_size: 8")
        if not 0.0 < self.val_fraction < 1.0:
            raise UserError(
                f"data.val_fraction must lie in (0, 1) (got {self.val_fraction})", fix="e.g. data.val_fraction: 0.1"
            )
        for name, example in (("text_field", "text"), ("tokenizer", "embedded")):
            if not getattr(self, name).strip():
                raise UserError(f"data.{name} is empty", fix=f"e.g. data.{name}: {example}")
        check_source(
            "data", self.source, allow_null=False, fix="give an existing file or directory, or a hub dataset id"
        )
