"""Text data for training and checks: a source's token stream packed into fixed-length blocks, split deterministically.

``source`` is read by ``qharness.sources.text`` (``embedded``, local files, hub datasets) and tokenized once into a
memory-mapped token cache (``qharness.sources.token_cache``: bounded memory for any size, reused by later runs).
The token stream is cut into non-overlapping blocks of ``seq_len`` inputs (targets are the next tokens; the blocks
are views of the map); the last ``val_fraction`` of the stream is the validation split.

Chat and instruction records (``data.format``) are rendered with the chat template into examples that are packed the
same way (``qharness.sources.example_cache``); their targets are -100 wherever nothing is trained (prompts, the first
token of each example), which the loss and the scores skip. Split, resume and DDP sharding index blocks as for text.

``source: generated`` is the FP model's own samples (``qharness.sources.generated``, cached): a token stream with its
targets (-100 on each sample's prompt) packed and split the same way.

Example::

    dm = TextDataModule(source="../shared/data/tinyshakespeare/input.txt", seq_len=64, batch_size=8)
"""

from __future__ import annotations

import dataclasses
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from qharness.errors import UserError
from qharness.progress import stage as progress_stage
from qharness.schema.data import DataConfig
from qharness.sources.chat import (
    ChatFormat,
    check_template,
    detect,
    end_of_turn_ids,
    held_out_conversations,
    load_template,
    record_files,
)
from qharness.sources.chat_demo import EMBEDDED_CHAT, embedded_chat_file
from qharness.sources.example_cache import IGNORE, describe, example_stream
from qharness.sources.generated import GENERATED, GenerateSpec
from qharness.sources.generated_cache import describe as describe_generated
from qharness.sources.generated_cache import generated_stream
from qharness.sources.token_cache import token_stream


def pack(stream: torch.Tensor, seq_len: int, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping blocks: inputs ``[n, seq_len]`` and next-token targets ``[n, seq_len]`` (taken from ``targets``,
    aligned with ``stream``, when given: chat data, whose untrained targets are -100)."""
    n = (len(stream) - 1) // seq_len
    x = stream[: n * seq_len].view(n, seq_len)
    y = (stream if targets is None else targets)[1 : n * seq_len + 1].view(n, seq_len)
    return x, y


class ResumableShuffle(Sampler):
    """Batches of a fresh seeded permutation per pass over the blocks, starting at any batch.

    Batch ``k`` of the run is always the same blocks, so a run resumed at step ``k`` sees exactly the
    batches an uninterrupted run would (a plain shuffled DataLoader restarts the epoch on resume).
    With ``world`` processes (DDP), batch ``k`` of rank ``r`` is slice ``k * world + r`` of the permutation:
    together the ranks see the blocks one process would see with ``world`` times the batch size.

    Example::

        list(ResumableShuffle(n=8, batch_size=2, seed=0, rank=1, world=2))   # 2 batches of 2 block indices
    """

    def __init__(self, n: int, batch_size: int, seed: int, start: int = 0, rank: int = 0, world: int = 1):
        self.n, self.batch_size, self.seed, self.next = n, batch_size, seed, start
        self.rank, self.world = rank, world
        self.per_pass = n // (batch_size * world)
        if self.per_pass == 0:
            raise UserError(
                f"the training split has {n} blocks, fewer than one batch on each of {world} processes (data.batch_size={batch_size})",
                fix="use more text, a smaller data.seq_len/batch_size, or fewer trainer.devices",
            )

    def __len__(self) -> int:
        return self.per_pass

    def __iter__(self):
        pass_index, first = divmod(self.next, self.per_pass)
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + pass_index))
        for b in range(first, self.per_pass):
            self.next += 1
            i = (b * self.world + self.rank) * self.batch_size
            yield perm[i : i + self.batch_size].tolist()


def batches_done(global_step: int, accumulate: int, per_pass: int) -> int:
    """Training batches consumed after ``global_step`` optimizer steps: Lightning steps after every
    ``accumulate`` batches and at the end of each pass (epoch), also with fewer batches accumulated.

    Example::

        batches_done(5, accumulate=3, per_pass=10)   # 13: one pass (4 steps) + 1 step of 3 batches
    """
    steps_per_pass = -(-per_pass // accumulate)
    passes, steps = divmod(global_step, steps_per_pass)
    return passes * per_pass + steps * accumulate


class TextDataModule(L.LightningDataModule):
    def __init__(self, **fields):
        """Language-modelling data packed into fixed-length blocks.

        Its fields are ``DataConfig``'s (``qharness.schema.data``: types, defaults, help and rules in one place; the
        CLI's ``--data.*`` options are read from there), e.g. ``TextDataModule(seq_len=64, batch_size=8)``.
        """
        config = DataConfig(**fields)  # checks every field (UserError naming it) before any work
        super().__init__()
        self.save_hyperparameters()
        self.hparams.update(dataclasses.asdict(config))
        self.source, self.text_field, self.tokenizer_source = config.source, config.text_field, config.tokenizer
        self.seq_len, self.batch_size, self.val_fraction = config.seq_len, config.batch_size, config.val_fraction
        self.seed, self.trust_remote_code = config.seed, config.trust_remote_code
        self.config = config
        self.format: ChatFormat | None = None  # set up: the chat/instruction format of data.source (None: text)
        self.counts: dict | None = None  # set up, chat/instruction: examples, tokens, trained tokens, ...
        self.sampled_chat: tuple[str | None] | None = None  # set up, generated answers: (their template,)
        self.train_x = self.train_y = self.val_x = self.val_y = self.val_tokens = None
        self.tokenizer = None

    def load_tokenizer(self):
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            from qharness.sources.models import resolve_checkpoint

            source = resolve_checkpoint(self.tokenizer_source)
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=self.trust_remote_code)
            except (OSError, ValueError) as e:
                raise UserError(
                    f"could not load the tokenizer of {source}: {str(e).splitlines()[0]}", fix="check model.checkpoint"
                ) from e
        return self.tokenizer

    def setup(self, stage: str | None = None) -> None:
        if self.train_x is not None:
            return
        self.load_tokenizer()
        what = "preparing" if self.source == GENERATED else "reading and tokenizing"
        with progress_stage(f"{what} data.source {self.source}"):
            stream, targets = self.tokens_of(self.source, self.text_field)  # memory-mapped token cache
        n_val = int(len(stream) * self.val_fraction)
        cut = len(stream) - n_val
        train_t, val_t = (None, None) if targets is None else (targets[:cut], targets[cut:])
        self.train_x, self.train_y = pack(stream[:cut], self.seq_len, train_t)
        self.val_x, self.val_y = pack(stream[cut:], self.seq_len, val_t)
        self.val_tokens = stream[cut:][: len(self.val_x) * self.seq_len + 1]  # the validation text, unmasked
        for name, x, y in (("training", self.train_x, self.train_y), ("validation", self.val_x, self.val_y)):
            if len(x) < self.batch_size:
                raise UserError(
                    f"data.source {self.source}: the {name} split has {len(x)} blocks of seq_len={self.seq_len}, "
                    f"fewer than one batch (batch_size={self.batch_size})",
                    fix=("raise data.generated_samples, or use" if self.source == GENERATED else "use more text,")
                    + " a smaller seq_len/batch_size, or another val_fraction",
                )
            if targets is not None and not bool((y != IGNORE).any()):  # its loss and perplexity would be 0 and 1
                raise UserError(
                    f"data.source {self.source}: the {name} split's {len(x)} blocks hold no trained target (only "
                    "prompts and example boundaries: no answer token reaches it)",
                    fix="use more examples or another data.val_fraction, put answers within data.seq_len, or set "
                    "data.train_on: all",
                )

    def chat_format(self, source: str, field: str = "data.source") -> ChatFormat | None:
        """The chat/instruction format of ``source`` under ``data.format`` (``auto``: detected from its records),
        None for plain text."""
        c = self.config
        kind = c.format
        if kind == "auto":
            kind = detect(source, c.messages_field, c.prompt_field, c.completion_field)
        if kind == "text":
            return None
        return ChatFormat(
            kind=kind,
            max_tokens=self.seq_len + 1,
            messages_field=c.messages_field,
            prompt_field=c.prompt_field,
            completion_field=c.completion_field,
            template=load_template(c.chat_template),
            train_on=c.train_on,
            long_examples=c.long_examples,
            field=field,
        )

    def tokens_of(self, source: str, text_field: str, field: str = "data.source"):
        """``(tokens, targets)`` of a source in this data's format: plain text (targets None: the tokens themselves)
        or chat/instruction examples (targets -100 where nothing is trained; the data line printed)."""
        tokenizer = self.load_tokenizer()
        if source == GENERATED:  # the FP model's own samples, generated once into the cache
            return self.generated(field)
        if source == EMBEDDED_CHAT:  # the offline instruction dataset, written once into the cache
            source = str(embedded_chat_file())
        fmt = self.chat_format(source, field)
        if fmt is None:
            return token_stream(source, text_field, tokenizer, field=field), None
        tokens, targets, counts = example_stream(source, fmt, tokenizer)
        if field == "data.source":
            self.format, self.counts = fmt, counts
        print(f"[qharness] {describe(counts, fmt)}", file=sys.stderr, flush=True)
        return tokens, targets

    def generated(self, field: str = "data.source"):
        """``(tokens, targets)`` of ``source: generated``: the samples of ``data.tokenizer``'s model (linked to
        ``model.checkpoint``; ``qharness.sources.generated``), cached. Answers to chat-templated prompts where there is
        a template (``data.chat_template`` or the tokenizer's) and ``data.format`` is not ``text``; else LLM-QAT text.
        The data line printed."""
        c, tokenizer = self.config, self.load_tokenizer()
        template = load_template(c.chat_template)
        chat = c.format != "text" and (template is not None or bool(getattr(tokenizer, "chat_template", None)))
        if c.format in ("chat", "instruction") and not chat:
            check_template(tokenizer, template, other="set data.format: text", what=f"{field} {GENERATED}'s prompts")
        spec = GenerateSpec(
            samples=c.generated_samples, length=self.seq_len + 1, seed=self.seed, top_p=c.generated_top_p
        )
        tokens, targets, counts = generated_stream(
            self.tokenizer_source, tokenizer, spec, chat, template, self.trust_remote_code, field
        )
        if field == "data.source" and chat:
            self.sampled_chat = (template,)
        print(f"[qharness] {describe_generated(counts, spec.length)}", file=sys.stderr, flush=True)
        return tokens, targets

    def conversations(self, source: str | None, limit: int) -> list[tuple[str, list[dict]]]:
        """Conversations to answer (``eval.answers``): the first ``limit`` records of ``source``, or (None) of the
        run's own chat data's validation split; none for a plain-text run without a ``source``. Set up first."""
        if source is None:
            if self.format is None:
                return []
            held = int(self.counts["tokens"] * self.val_fraction)  # the validation split's tokens (``setup``)
            files = record_files(self._records_source(), self.format.field)
            return held_out_conversations(files, self.format, self.tokenizer, held, limit)
        fmt = self.chat_format(source, "eval.answers.source")
        if fmt is None:
            raise UserError(
                f"eval.answers.source {source} holds no chat or instruction records (data.format reads it as text)",
                fix="give a .json/.jsonl file of chat or instruction records",
            )
        check_template(self.load_tokenizer(), fmt.template, "data.chat_template")
        return held_out_conversations(record_files(source, fmt.field), fmt, self.tokenizer, None, limit)

    def _records_source(self) -> str:
        return str(embedded_chat_file()) if self.source == EMBEDDED_CHAT else self.source

    def end_of_turn_ids(self) -> list[int]:
        """Chat/instruction data and generated answers: the template's end-of-turn tokens (the ``.pte`` stops at them);
        text: none."""
        if self.format is None:
            return [] if self.sampled_chat is None else end_of_turn_ids(self.load_tokenizer(), self.sampled_chat[0])
        return end_of_turn_ids(self.load_tokenizer(), self.format.template)

    def train_dataloader(self) -> DataLoader:
        step, accumulate, rank, world = 0, 1, 0, 1
        if self.trainer is not None:
            step, accumulate = self.trainer.global_step, self.trainer.accumulate_grad_batches
            rank, world = self.trainer.global_rank, self.trainer.world_size  # DDP: each rank its own share
        sampler = ResumableShuffle(len(self.train_x), self.batch_size, self.seed, rank=rank, world=world)
        if self.trainer is not None:
            check_val_interval(self.trainer, len(sampler))
        sampler.next = batches_done(step, accumulate, len(sampler))  # a resumed run continues where it stopped
        return DataLoader(TensorDataset(self.train_x, self.train_y), batch_sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.val_x, self.val_y), batch_size=self.batch_size, drop_last=True)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


def check_val_interval(trainer, batches: int) -> None:
    """An int ``trainer.val_check_interval`` beyond the training batches of an epoch: one line before training
    (Lightning raises a ValueError in its fit loop), with the number of batches the data gives. ``trainer``: the
    Trainer, or anything with its ``val_check_interval``, ``limit_train_batches`` and ``check_val_every_n_epoch``
    (the pre-flight passes the config's, before any model loads)."""
    interval, limit = trainer.val_check_interval, trainer.limit_train_batches
    if isinstance(limit, int):
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = int(batches * limit)
    if isinstance(interval, int) and trainer.check_val_every_n_epoch is not None and interval > batches:
        raise UserError(
            f"trainer.val_check_interval={interval} exceeds the {batches} training batches of an epoch",
            fix=f"set trainer.val_check_interval <= {batches}, or trainer.check_val_every_n_epoch: null to count "
            "batches across epochs",
        )
