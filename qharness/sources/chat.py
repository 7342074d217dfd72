"""Chat and instruction records -> rendered examples with their loss mask.

A chat record holds a list of ``{"role", "content"}`` turns (system, user, assistant; multi-turn); an instruction
record a prompt and its completion (``prompt``/``completion``, or alpaca's ``instruction``/``input``/``output``),
mapped onto one user turn and one assistant turn. Each record is rendered with the tokenizer's chat template (or a
given one) and tokenized; the tokens of the assistant turns are the ones trained (``train_on: answers``).

Which rendered characters are the assistant's: with a template that marks them (``{% generation %}``), the template
says so (``return_assistant_tokens_mask``); else by prefix renders: turn ``i``'s answer is what the rendering of
turns ``0..i`` adds to the rendering of turns ``0..i-1`` with the generation prompt (its header), trailing whitespace
excluded, its end-of-turn token included.

Records come from local ``.json`` (a list of records) and ``.jsonl`` files (optionally ``.gz``/``.bz2``/``.xz``);
every error names the record (``file:line``) and the field.

Example::

    fmt = ChatFormat(kind="chat", max_tokens=129)
    ids, trained = render(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from qharness.errors import UserError
from qharness.sources.chat_demo import TEMPLATE
from qharness.sources.text import _kind, local_files
from qharness.upstream.jinja_bounds import bound_chat_templates

ROLES = ("system", "user", "assistant")
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")  # a template that marks its answers itself
ALPACA = ("instruction", "input", "output")
_RECORD_SUFFIXES = ".json/.jsonl (optionally .gz/.bz2/.xz)"


@dataclass(frozen=True)
class ChatFormat:
    """How records become examples: ``kind`` (``chat`` or ``instruction``), the field names, the chat template text
    (None: the tokenizer's), what is trained (``answers``/``all``), and the rule for examples longer than
    ``max_tokens`` (``truncate`` to the first ``max_tokens``, or ``drop``)."""

    kind: str
    max_tokens: int
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    template: str | None = None
    train_on: str = "answers"
    long_examples: str = "truncate"
    field: str = field(default="data.source", compare=False)

    def key(self) -> list:
        """What decides the examples' tokens and targets (the token cache's key)."""
        return [
            self.kind,
            self.max_tokens,
            self.messages_field,
            self.prompt_field,
            self.completion_field,
            hashlib.sha256((self.template or "").encode()).hexdigest(),
            self.train_on,
            self.long_examples,
        ]


def load_template(value: str | None, setting: str = "data.chat_template") -> str | None:
    """``data.chat_template``: a file's text, the template text itself (it holds ``{{`` or ``{%``), or ``embedded``:
    the embedded model's template (``sources.chat_demo.TEMPLATE``)."""
    if value is None:
        return None
    if value == "embedded":
        return TEMPLATE
    path = Path(value).expanduser()
    if "{{" not in value and "{%" not in value:
        if not path.is_file():
            raise UserError(
                f"{setting} {value!r} is neither a file nor a Jinja template",
                fix="give the path of a template file, or the template text (with {% ... %} / {{ ... }})",
            )
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"{setting} {path} cannot be read ({e})", fix="give a UTF-8 text file") from e
    return value


def save_template(tokenizer_dir: Path, template: str) -> None:
    """Make ``template`` the chat template of the tokenizer saved in ``tokenizer_dir``: its ``chat_template.jinja``,
    the file transformers' ``save_pretrained`` writes and ``from_pretrained`` reads (replacing the tokenizer's own)."""
    (Path(tokenizer_dir) / "chat_template.jinja").write_text(template, encoding="utf-8")


def record_files(source: str, field: str = "data.source") -> list[Path]:
    """The local ``.json``/``.jsonl`` files of a chat or instruction source; anything else is refused."""
    files = local_files(source, field)
    if files is None:
        raise UserError(
            f"{field} {source}: chat and instruction data are read from local {_RECORD_SUFFIXES} files",
            fix=f"point {field} at such a file or directory, or set data.format: text",
        )
    other = [f for f in files if _kind(f)[0] != "json"]
    if other:
        raise UserError(
            f"{field} {other[0]} is not a {_RECORD_SUFFIXES} file of chat or instruction records",
            fix=f"keep only {_RECORD_SUFFIXES} files in {field}, or set data.format: text",
        )
    return files


def iter_records(files: list[Path], field: str = "data.source") -> Iterator[tuple[str, object]]:
    """``(where, record)`` of every record: ``file:line`` of a ``.jsonl`` line, ``file[i]`` of a ``.json`` list's
    record. Blank lines are skipped; invalid JSON is refused naming ``field`` and the line."""
    for f in files:
        compression = _kind(f)[1]
        opener = importlib.import_module(compression).open if compression else open
        try:
            with opener(f, "rt", encoding="utf-8") as fh:
                if ".jsonl" in f.suffixes:
                    for n, line in enumerate(fh, 1):
                        if line.strip():
                            yield f"{f}:{n}", _json(line, f"{field} {f}:{n}")
                else:
                    data = _json(fh.read(), f"{field} {f}")
                    records = data if isinstance(data, list) else [data]
                    for i, record in enumerate(records):
                        yield f"{f}[{i}]", record
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise UserError(f"{field} {f} cannot be read ({e})", fix="give UTF-8 JSON lines") from e


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where} is not valid JSON ({e.msg} at column {e.colno})", fix="fix or remove that record"
        ) from e


def detect(source: str, messages_field: str, prompt_field: str, completion_field: str) -> str:
    """``data.format: auto``: ``chat`` or ``instruction`` when the first record of a local ``.json``/``.jsonl``
    source has those fields, else ``text``."""
    files = local_files(source)
    if not files or any(_kind(f)[0] != "json" for f in files):
        return "text"
    first = next(iter_records(files[:1]), None)
    record = first[1] if first else None
    if not isinstance(record, dict):
        return "text"
    if messages_field in record:
        return "chat"
    if (prompt_field in record and completion_field in record) or ("instruction" in record and "output" in record):
        return "instruction"
    return "text"


def to_messages(record, where: str, fmt: ChatFormat) -> list[dict]:
    """A record's turns, checked: each a ``role`` among system/user/assistant and a text ``content``, at least one
    assistant turn, none empty. An instruction record is one user turn and one assistant turn."""
    if not isinstance(record, dict):
        raise UserError(f"{where} is a {type(record).__name__}, not a record", fix="give one JSON object per record")
    if fmt.kind == "instruction":
        return _instruction_messages(record, where, fmt)
    name = fmt.messages_field
    if name not in record:
        raise UserError(
            f"{where} has no {name!r} field (fields: {', '.join(map(str, record)) or 'none'})",
            fix="give each record a list of turns there, or set data.messages_field",
        )
    turns = record[name]
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: {name!r} is not a non-empty list of turns", fix='e.g. [{"role": "user", ...}, ...]')
    for i, turn in enumerate(turns):
        at = f"{where}: {name}[{i}]"
        if not isinstance(turn, dict):
            raise UserError(f"{at} is not a mapping", fix='give {"role": ..., "content": ...}')
        if "role" not in turn:
            raise UserError(f"{at} has no 'role'", fix=f"give each turn a role: one of {', '.join(ROLES)}")
        if turn["role"] not in ROLES:
            raise UserError(f"{at} has the unknown role {turn['role']!r}", fix=f"use one of {', '.join(ROLES)}")
        if not isinstance(turn.get("content"), str):
            raise UserError(f"{at} has no text 'content'", fix="give each turn its text in 'content'")
        if turn["role"] == "assistant" and not turn["content"].strip():
            raise UserError(f"{at} is an empty assistant turn", fix="give the answer's text, or remove the record")
    if not any(t["role"] == "assistant" for t in turns):
        raise UserError(f"{where}: {name!r} has no assistant turn", fix="end each conversation with the answer")
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def _instruction_messages(record: dict, where: str, fmt: ChatFormat) -> list[dict]:
    if fmt.prompt_field in record or fmt.completion_field in record:
        names = (fmt.prompt_field, fmt.completion_field)
        prompt, answer = record.get(fmt.prompt_field), record.get(fmt.completion_field)
    else:
        names = ("instruction", "output")
        extra = record.get("input")
        prompt, answer = record.get("instruction"), record.get("output")
        if isinstance(prompt, str) and isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
    for name, value in zip(names, (prompt, answer)):
        if not isinstance(value, str):
            raise UserError(
                f"{where} has no text {name!r} field (fields: {', '.join(map(str, record)) or 'none'})",
                fix="give prompt/completion (data.prompt_field, data.completion_field) or instruction/input/output",
            )
    if not answer.strip():
        raise UserError(f"{where}: {names[1]!r} is empty", fix="give the answer's text, or remove the record")
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def check_template(
    tokenizer,
    template: str | None,
    setting: str = "data.chat_template",
    other: str = "set data.format: text",
    what: str = "chat/instruction records",
) -> None:
    """A chat template to render ``what`` with: the given one or the tokenizer's (``other``: the fix besides
    ``setting``)."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"the tokenizer has no chat template to render {what} with",
            fix=f"give one in {setting} (a Jinja file or string), or {other}",
        )


def _render_text(
    tokenizer,
    messages: list[dict],
    template: str | None,
    where: str,
    generation: bool = False,
    fix: str = "fix that record, or give a template that renders it in data.chat_template",
) -> str:
    bound_chat_templates()  # a template's output bounded before it is allocated
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=generation
        )
    except Exception as e:  # jinja2's TemplateError, a template's raise_exception(...), a KeyError in it, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the chat template does not render {where} ({type(e).__name__}: {first})", fix=fix) from e


def generation_prompt(tokenizer, messages: list[dict], template: str | None, setting: str = "--chat_template"):
    """The token ids that ask for the next assistant turn: ``messages`` rendered with the template and its generation
    prompt, tokenized as ``render`` tokenizes a training example (no special tokens added besides the template's)."""
    text = _render_text(
        tokenizer,
        messages,
        template,
        "the conversation",
        generation=True,
        fix=f"give a template that renders system/user/assistant turns in {setting}",
    )
    return _tokens_in_spans(tokenizer, text, [])[0]


def answer_spans(
    tokenizer, messages: list[dict], template: str | None, where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans of its assistant turns (prefix renders; see the module's doc)."""
    text = _render_text(tokenizer, messages, template, where)
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        head = _render_text(tokenizer, messages[:i], template, where, generation=True) if i else ""
        done = _render_text(tokenizer, messages[: i + 1], template, where)
        start = len(head)
        if not text.startswith(head) or not text.startswith(done) or start > len(done.rstrip()):
            raise UserError(
                f"{where}: the chat template renders the turns before messages[{i}] differently from the whole "
                "conversation, so the answer's tokens cannot be told apart",
                fix="give a template with {% generation %} markers in data.chat_template, or data.train_on: all",
            )
        spans.append((start, len(done.rstrip())))
    return text, spans


def render(
    tokenizer, messages: list[dict], template: str | None = None, train_on: str = "answers", where: str = "a record"
):
    """``(ids, trained)``: the rendered conversation's token ids and, per token, whether it is trained (an assistant
    token; every token with ``train_on="all"``)."""
    if template is None:
        template = tokenizer.chat_template
    if train_on == "all":
        ids, _ = _tokens_in_spans(tokenizer, _render_text(tokenizer, messages, template, where), [])
        return ids, [True] * len(ids)
    if _GENERATION.search(template):
        return _render_generation(tokenizer, messages, template, where)
    text, spans = answer_spans(tokenizer, messages, template, where)
    return _tokens_in_spans(tokenizer, text, spans)


def _tokens_in_spans(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """The tokens of ``text`` and whether each starts inside a span: the whole text tokenized with offsets (a fast
    tokenizer), else piece by piece between the span ends (a slow one)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
    ids, trained, at = [], [], 0
    for a, b in [*spans, (len(text), len(text))]:
        for piece, inside in ((text[at:a], False), (text[a:b], True)):
            if piece:
                piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                ids += piece_ids
                trained += [inside] * len(piece_ids)
        at = b
    return ids, trained


def _render_generation(tokenizer, messages, template, where):
    bound_chat_templates()
    try:
        enc = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
    except Exception as e:  # noqa: BLE001  as in _render_text
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"the chat template does not render {where} ({type(e).__name__}: {first})",
            fix="fix that record, or give a template that renders it in data.chat_template",
        ) from e
    return list(enc["input_ids"]), [bool(m) for m in enc["assistant_masks"]]


def end_of_turn_ids(tokenizer, template: str | None = None) -> list[int]:
    """The special tokens that end an assistant turn in the template's rendering (``<|im_end|>``, ``<|eot_id|>``):
    the special tokens at the end of a rendered answer. What the ``.pte``'s runner should stop at."""
    if template is None and not getattr(tokenizer, "chat_template", None):
        return []
    marker = "qharness-answer"
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}]
    try:
        text, spans = answer_spans(tokenizer, messages, template, "a probe conversation")
    except UserError:
        return []
    tail = text[text.rfind(marker) + len(marker) : spans[-1][1]]
    special = set(tokenizer.all_special_ids) | {
        i for t, i in tokenizer.get_added_vocab().items() if t in tail and i is not None
    }
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    return sorted({i for i in ids if i in special})


def held_out_conversations(
    files: list[Path], fmt: ChatFormat, tokenizer, held_tokens: int | None, limit: int
) -> list[tuple[str, list[dict]]]:
    """``(where, turns)`` of the first ``limit`` records whose whole example lies in the last ``held_tokens`` tokens of
    the example stream (the validation split, which training never saw), in their order; ``held_tokens`` None: every
    record (a source of its own). Each example's length is its rendering's, cut or dropped as the stream does."""
    records = list(iter_records(files, fmt.field))
    if held_tokens is None:
        return [(where, to_messages(record, where, fmt)) for where, record in records[:limit]]
    held, used = [], 0
    for where, record in reversed(records):
        messages = to_messages(record, where, fmt)
        n = len(render(tokenizer, messages, fmt.template, "all", where)[0])
        if n > fmt.max_tokens:
            n = 0 if fmt.long_examples == "drop" else fmt.max_tokens
        used += n
        if used > held_tokens:
            break
        if n:
            held.append((where, messages))
    return held[::-1][:limit]


def prompt_and_reference(tokenizer, messages: list[dict], template: str | None, where: str) -> tuple[str, str]:
    """A conversation's prompt (the turns before its last assistant turn, rendered with the generation prompt) and
    its reference answer (that turn's text)."""
    last = max(i for i, t in enumerate(messages) if t["role"] == "assistant")
    return _render_text(tokenizer, messages[:last], template, where, generation=True), messages[last]["content"]
