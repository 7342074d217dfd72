"""A ``.pte`` that qharness wrote, as one object: generate text, chat, logits and perplexity of token blocks, benchmark.

It runs through the same code as the CLI: ``runtime/pte.py`` (the ExecuTorch runtime), ``runtime/generate.py``
(``qharness generate``'s loop and sampling), ``runtime/chat.py`` (``qharness generate --chat``), ``checks/parity.py``
(scoring), ``runtime/bench.py`` (``qharness bench``).

Example::

    pte = qharness.Pte.load("out/model.pte")            # tokenizer: out/tokenizer/ (or Pte.load("out/"))
    print(pte.generate("def main():", max_new_tokens=32, on_token=lambda s: print(s, end="")))
    print(pte.chat([{"role": "user", "content": "What does len return?"}]))   # stops at end-of-turn
    pte.perplexity(blocks)                              # blocks: LongTensor [n, L]
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from qharness.errors import UserError
from qharness.runtime.bench_record import Bench

__all__ = ["Pte"]


def _serialized(method):
    """One call at a time on a ``Pte`` (one program method, one KV cache: calls from several threads would interleave
    their positions), after checking its file was not overwritten since it was loaded."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self._lock:
            self.check_file()
            return method(self, *args, **kwargs)

    return run


class Pte:
    """A loaded ``.pte`` and its tokenizer (``tokenizers.Tokenizer``). Build it with ``Pte.load``.

    Attributes: ``path``, ``program`` (the ``runtime.pte.PteModel``: ``program(tokens[1, n], start) -> logits``),
    ``tokenizer``, ``tokenizer_dir`` (where ``chat`` loads the transformers tokenizer and its chat template from),
    ``last`` (the statistics of the last ``generate`` or ``chat``: prompt tokens, new token ids, stop reason,
    prefill/decode tokens per second; ``chat``'s also the turns dropped and the conversation kept).
    """

    def __init__(self, program, tokenizer, tokenizer_dir: str | Path | None = None):
        self.program, self.tokenizer = program, tokenizer
        self.path = Path(program.path)
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
        self.last: dict | None = None
        self._chat_tokenizer = None
        self._cached: list[int] | None = None  # the tokens the program's KV cache holds after the last chat turn
        self._lock = threading.RLock()
        self._identity = _identity(self.path)  # the file as loaded: the runtime reads it as it runs

    @classmethod
    def load(cls, path: str | Path, tokenizer: str | Path | None = None) -> Pte:
        """Load ``path`` (a ``.pte``, or a run directory: its ``model.pte``) with the tokenizer directory ``tokenizer``
        (default: ``tokenizer/`` beside the ``.pte``, as ``qharness generate``); a missing or foreign file is one
        ``UserError`` line. Example::

        pte = qharness.Pte.load("runs/qat_xnnpack/model.pte")
        """
        from qharness.runtime.generate import load_tokenizer
        from qharness.runtime.pte import PteModel, program_in

        for name, value in (("path", path), ("tokenizer", tokenizer)):
            if not (value is None and name == "tokenizer") and (
                not isinstance(value, (str, os.PathLike)) or value == ""
            ):
                raise UserError(
                    f"Pte.load {name} must be a path (got {type(value).__name__} {value!r:.60})",
                    fix=f"pass {name} as a str or Path" + (", e.g. out/model.pte" if name == "path" else ""),
                )
        program = PteModel(program_in(path))
        tokenizer_dir = Path(tokenizer) if tokenizer else program.path.parent / "tokenizer"
        return cls(program, load_tokenizer(tokenizer_dir), tokenizer_dir)

    def check_file(self, reopen: bool = False) -> None:
        """The file is the one ``load`` read: overwritten in place since (the runtime reads the program from the
        file as it runs: it would crash or compute garbage) is one ``UserError`` line; ``reopen`` (what loads the
        path again: ``bench``, ``evaluate``): deleted or replaced since is one too, instead of another program."""
        now = _identity(self.path)
        if now == self._identity:
            return
        same_file = now is not None and now[:2] == self._identity[:2]
        if not same_file and not reopen:
            return  # deleted or moved over: the loaded program (its own inode) runs as loaded
        what = "changed on disk" if same_file else "deleted" if now is None else "replaced by another file"
        raise UserError(
            f"{self.path} was {what} since Pte.load",
            fix="qharness.Pte.load it again (a .pte being used is replaced by writing a new file and renaming it)",
        )

    @_serialized
    def metadata(self) -> dict:
        """The runner metadata: ``get_max_context_len``, ``get_vocab_size``, ``get_eos_ids``, ..."""
        return self.program.metadata()

    @_serialized
    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        on_token: Callable[[str], None] | None = None,
    ) -> str:
        """The text generated after ``prompt`` (``qharness generate``'s loop: one prefill, then a token per call until
        EOS, ``max_new_tokens`` or the end of the KV cache). ``temperature`` 0 is greedy, else softmax sampling among the
        ``top_k`` most likely (0: all), seeded by ``seed``; ``on_token`` receives each piece of text as it decodes.

        Example::

            text = pte.generate("def main():", max_new_tokens=32, temperature=0.8, top_k=40, seed=1)
        """
        from qharness.runtime.generate import generate

        self._cached = None
        self.last = generate(
            self.program, self.tokenizer, prompt, max_new_tokens, temperature, top_k, seed, on_text=on_token or _ignore
        )
        return self.last["text"]

    @_serialized
    def chat(
        self,
        messages: str | list[dict],
        system: str | None = None,
        chat_template: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int | None = None,
        on_token: Callable[[str], None] | None = None,
    ) -> str:
        """The assistant's answer to ``messages`` (``{"role", "content"}`` turns ending with a user turn; a text is one
        user turn), as ``qharness generate --chat`` answers: rendered with ``chat_template`` (a file, the template
        text, or ``embedded``; default: the tokenizer's, which a run saves with its ``data.chat_template``), ``system``
        put first when no turn is a system turn, decoded until the template's end-of-turn token or an EOS id of the
        ``.pte`` (or ``max_new_tokens``, or the end of the KV cache). A conversation too long for the KV cache loses
        its oldest exchanges first (``runtime/chat.py`` states the rule); ``last["conversation"]`` holds the turns kept
        and the answer: pass it back with the next user turn to go on. Successive turns of one conversation reuse the
        KV cache of the tokens they share. Example::

            answer = pte.chat([{"role": "user", "content": "What does len return?"}], system="Answer briefly.")
            history = [*pte.last["conversation"], {"role": "user", "content": "And sorted?"}]
            pte.chat(history, on_token=lambda s: print(s, end="", flush=True))
        """
        from qharness.runtime.chat import chat_template as template_of
        from qharness.runtime.chat import chat_turn, conversation

        turns = conversation(messages, system)
        tokenizer = self.chat_tokenizer()
        template = template_of(tokenizer, chat_template)
        cached, self._cached = self._cached, None  # a failed turn leaves the cache unknown
        self.last = chat_turn(
            self.program,
            self.tokenizer,
            tokenizer,
            turns,
            template,
            max_new_tokens,
            temperature,
            top_k,
            seed,
            on_text=on_token or _ignore,
            cached=cached,
        )
        self._cached = self.last["cached"]
        return self.last["text"]

    def chat_tokenizer(self):
        """The transformers tokenizer of ``tokenizer_dir``, which renders the chat template (loaded once)."""
        from qharness.runtime.chat import load_chat_tokenizer

        if self._chat_tokenizer is None:
            if self.tokenizer_dir is None:
                raise UserError(
                    f"{self.path}: no tokenizer directory to chat with",
                    fix="load it with Pte.load(path, tokenizer=DIR)",
                )
            self._chat_tokenizer = load_chat_tokenizer(self.tokenizer_dir)
        return self._chat_tokenizer

    @_serialized
    def logits(self, tokens) -> torch.Tensor:
        """``logits[n, vocab]`` of every position of ``tokens`` (a list of ids or a 1-D / ``[1, n]`` tensor), from a
        fresh prefill at position 0. Example::

            next_id = int(pte.logits(pte.tokenizer.encode("def").ids)[-1].argmax())
        """
        from qharness.checks.parity import block_logits

        block = _block(tokens)
        self._cached = None
        with torch.no_grad():
            return block_logits(self.program, block).float()

    @_serialized
    def perplexity(self, blocks: torch.Tensor) -> float:
        """Perplexity of ``blocks`` (``[n, L]`` token ids): each block's tokens 1..L-1 predicted from those before, scored
        as the parity gate scores the ``.pte`` (``checks/parity.score_deployed``). Example::

            ppl = pte.perplexity(torch.tensor([pte.tokenizer.encode(text).ids[:65]]))
        """
        from qharness.checks.parity import score_deployed

        if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.shape[1] < 2:
            got = tuple(blocks.shape) if isinstance(blocks, torch.Tensor) else type(blocks).__name__
            raise UserError(f"perplexity takes [n, L] token blocks (got {got})", fix="pass a 2-D LongTensor, L >= 2")
        blocks = blocks.to(torch.long)
        self._fits(blocks.shape[1] - 1)
        self._cached = None
        return score_deployed(self.program, blocks[:, :-1], blocks[:, 1:])["ppl"]

    def bench(self, prompt_len: int = 128, decode_tokens: int = 64, reps: int = 5, threads: int | None = None) -> Bench:
        """``qharness bench`` of this ``.pte`` alone: load time, prefill/decode tokens/s, peak RSS and size, each rep in a
        fresh process (median and spread), as ``runtime.bench_record.Bench``. Example::

            r = pte.bench(prompt_len=32, decode_tokens=16, reps=2); r.pte.decode_tok_s.median
        """
        from qharness.runtime.bench import bench

        self.check_file(reopen=True)  # each rep loads the path in a fresh process
        for name, value in (("prompt_len", prompt_len), ("decode_tokens", decode_tokens), ("reps", reps)):
            if value < 1:
                raise UserError(f"bench {name} must be >= 1 (got {value})", fix=f"pass {name}=1 or more")
        return bench(self.path, None, prompt_len, decode_tokens, reps, threads)

    def _fits(self, n: int) -> None:
        context = self.metadata().get("get_max_context_len")
        if context is not None and n > context:
            raise UserError(
                f"{n} tokens do not fit the .pte's KV cache of {context} positions",
                fix=f"give at most {context} tokens (or export with a larger max_seq_len)",
            )


def _identity(path: Path) -> tuple | None:
    """(device, inode, size, modification time) of ``path``, None when it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _ignore(piece: str) -> None:
    pass


def _block(tokens) -> torch.Tensor:
    t = torch.as_tensor(tokens, dtype=torch.long)
    if t.dim() == 2 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 1 or t.numel() == 0:
        raise UserError(f"tokens of shape {tuple(t.shape)}", fix="pass a list of token ids or a 1-D tensor")
    return t
