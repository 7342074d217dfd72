"""The ``data`` section: ``TextDataModule``'s fields and their rules, torch-free.

``TextDataModule.__init__`` takes its fields from ``DataConfig`` (``TextDataModule(**fields)`` builds one), so the CLI's
``--data.*`` options, their ``--help`` text, the pre-torch check and the config reference come from this class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from qharness.config import check_source
from qharness.errors import UserError
from qharness.schema.fields import typed


@dataclass
class DataConfig:
    """Language-modelling data packed into fixed-length blocks.

    Args:
        source: ``embedded`` (text shipped with Python: documentation topics and stdlib sources),
            ``embedded-chat`` (question/answer pairs built from the stdlib's docstrings: instruction data, offline),
            ``generated`` (no data of yours: the FP model's own samples, ``generated_samples`` of them, answers to
            chat-templated generic prompts for a model with a chat template, else LLM-QAT's text from a random
            first token; QAT with it needs ``model.distill``), a local .txt/.json/.jsonl/.parquet/.csv file or
            directory (``./generated`` for a directory of that name), or a hub dataset id (online only).
        text_field: Column holding the text (json/parquet/csv/hub sources).
        tokenizer: Where the tokenizer comes from; linked to ``model.checkpoint`` (you rarely set it).
        seq_len: Tokens per block: the sequence length the model is trained and evaluated on.
        batch_size: Blocks per batch. Training graphs are exported with this static batch size.
        val_fraction: Fraction of the token stream (its end) held out for validation and parity checks.
        seed: Seed of the training-batch shuffle (and of ``source: generated``'s sampling).
        trust_remote_code: Allow the tokenizer's own code from the hub (off by default; only for sources you trust).
        format: ``text`` (language modelling on ``text_field``), ``chat`` (records with a ``messages_field`` list of
            ``role``/``content`` turns), ``instruction`` (``prompt_field``/``completion_field`` pairs, or alpaca
            ``instruction``/``input``/``output``: one user turn and the answer), or ``auto``: chat or instruction when
            the records of a .json/.jsonl source carry those fields, else text. Chat and instruction records are
            rendered with the tokenizer's chat template (or ``chat_template``). ``calibration.source`` is read in
            the same format.
        messages_field: Chat format: the column holding the list of ``{"role", "content"}`` turns.
        prompt_field: Instruction format: the column holding the prompt (alpaca files use ``instruction``/``input``).
        completion_field: Instruction format: the column holding the answer (alpaca files use ``output``).
        chat_template: Chat/instruction: a Jinja chat template (a file path or the template text) used when the
            tokenizer has none (it overrides the tokenizer's when given); ``embedded``: the embedded model's.
        train_on: Chat/instruction: ``answers`` (loss on the assistant/completion tokens only) or ``all`` (every token
            of each example). Never across example boundaries.
        long_examples: Chat/instruction: an example longer than seq_len + 1 tokens is ``truncate``d to its first
            seq_len + 1 tokens, or ``drop``ped (counted and reported).
        generated_samples: ``source: generated``: how many samples the FP model writes (each at most seq_len + 1
            tokens, prompt included; sampled once, cached). The last ``val_fraction`` of their tokens is validation.
        generated_top_p: ``source: generated``: the nucleus of each next-token distribution sampled from, in (0, 1]
            (1.0: the whole distribution, as LLM-QAT samples; 0.9-0.95 leaves out the unlikely tail).
    """

    source: str = "embedded"
    text_field: str = "text"
    tokenizer: str = "embedded"
    seq_len: int = 128
    batch_size: int = 8
    val_fraction: float = 0.1
    seed: int = 1234
    trust_remote_code: bool = False
    format: Literal["auto", "text", "chat", "instruction"] = "auto"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    chat_template: str | None = None
    train_on: Literal["answers", "all"] = "answers"
    long_examples: Literal["truncate", "drop"] = "truncate"
    generated_samples: int = 128
    generated_top_p: float = 1.0

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
        for name, example in (
            ("text_field", "text"),
            ("tokenizer", "embedded"),
            ("messages_field", "messages"),
            ("prompt_field", "prompt"),
            ("completion_field", "completion"),
        ):
            if not getattr(self, name).strip():
                raise UserError(f"data.{name} is empty", fix=f"e.g. data.{name}: {example}")
        if self.generated_samples < 1:
            raise UserError(
                f"data.generated_samples must be at least 1 (got {self.generated_samples})",
                fix="e.g. data.generated_samples: 128",
            )
        if not (math.isfinite(self.generated_top_p) and 0.0 < self.generated_top_p <= 1.0):
            raise UserError(
                f"data.generated_top_p must lie in (0, 1] (got {self.generated_top_p})",
                fix="1.0 samples the whole distribution; e.g. data.generated_top_p: 0.95",
            )
        if self.chat_template is not None and not self.chat_template.strip():
            raise UserError("data.chat_template is empty", fix="give a Jinja template (file or text), or leave it null")
        check_source(
            "data", self.source, allow_null=False, fix="give an existing file or directory, or a hub dataset id"
        )
