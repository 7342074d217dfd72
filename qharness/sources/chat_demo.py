"""An instruction dataset that needs nothing online: question/answer pairs built from the docstrings of the Python
standard library this interpreter ships (what the embedded corpus is made of), and a chat template for the embedded
model's tokenizer (which has none).

``data.source: embedded-chat`` names it; it is written once per interpreter as a ``.jsonl`` file of
``{"prompt", "completion"}`` records under ``$QHARNESS_CACHE/chat/`` and read like any instruction file.

Example::

    records = embedded_instructions()[:2]
    # [{"prompt": "What does json.dumps do?", "completion": "Serialize ``obj`` to a JSON formatted ``str``. ..."}, ...]
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import sys
from pathlib import Path

from qharness.errors import UserError
from qharness.io.atomic import write_text_atomic
from qharness.io.locks import hold_lock
from qharness.sources.cache import cache_dir

EMBEDDED_CHAT = "embedded-chat"

# The modules asked about: pure-Python standard-library modules with documented public functions.
MODULES = (
    "base64", "bisect", "calendar", "colorsys", "copy", "csv", "difflib", "fnmatch", "fractions", "functools",
    "glob", "gzip", "heapq", "html", "json", "keyword", "os.path", "pathlib", "pprint", "random", "shlex", "shutil",
    "statistics", "string", "tempfile", "textwrap", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip

# A chat template for the embedded tokenizer (plain-text headers; an answer ends with its EOS, where the runner stops).
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}### Question:\n{{ m['content'] }}\n\n"
    "{% else %}### Answer:\n{{ m['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}### Answer:\n{% endif %}"
)

MAX_ANSWER_CHARS = 400

# The split model.checkpoint: embedded-chat was fine-tuned on (data.seq_len, data.val_fraction: the defaults)
TUNED_SEQ_LEN, TUNED_VAL_FRACTION = 128, 0.1


def check_tuned_split(checkpoint: str, source: str, seq_len: int, val_fraction: float) -> None:
    """The embedded chat model on its own data: a split other than the one it was tuned on would hold out (validation
    loss, perplexity, the answered questions) records it was fine-tuned on. ``UserError`` naming the fields."""
    if checkpoint != EMBEDDED_CHAT or source != EMBEDDED_CHAT:
        return
    if seq_len != TUNED_SEQ_LEN or val_fraction > TUNED_VAL_FRACTION:
        raise UserError(
            f"model.checkpoint embedded-chat was fine-tuned on data.source embedded-chat split with data.seq_len="
            f"{TUNED_SEQ_LEN}, data.val_fraction={TUNED_VAL_FRACTION}: data.seq_len={seq_len}, "
            f"data.val_fraction={val_fraction} would hold out records it was trained on",
            fix=f"set data.seq_len: {TUNED_SEQ_LEN} and data.val_fraction <= {TUNED_VAL_FRACTION}, or give "
            "eval.answers.source and another data.source",
        )


def _summary(doc: str) -> str:
    """A docstring's first paragraph, one line, at most ``MAX_ANSWER_CHARS`` characters (cut at a sentence end)."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    if len(first) <= MAX_ANSWER_CHARS:
        return first
    cut = first.rfind(". ", 0, MAX_ANSWER_CHARS)
    return first[: cut + 1] if cut > 0 else first[:MAX_ANSWER_CHARS]


def embedded_instructions() -> list[dict]:
    """The question/answer pairs, in a fixed order: for each public, documented function of ``MODULES``, what it
    does (its docstring's first paragraph) and how it is called (its signature)."""
    records = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(getattr(module, "__all__", None) or dir(module)):
            fn = getattr(module, attr, None)
            if attr.startswith("_") or not inspect.isfunction(fn) or fn.__module__ not in (module.__name__, name):
                continue
            doc = inspect.getdoc(fn)
            if not doc or len(_summary(doc)) < 20:
                continue
            records.append({"prompt": f"What does {name}.{attr} do?", "completion": _summary(doc)})
            try:
                signature = f"{name}.{attr}{inspect.signature(fn)}"
            except (TypeError, ValueError):
                continue
            records.append({"prompt": f"How do I call {name}.{attr}?", "completion": f"Call it as {signature}."})
    order = sorted(range(len(records)), key=lambda i: hashlib.sha1(records[i]["prompt"].encode()).hexdigest())
    return [records[i] for i in order]  # questions of one module spread over the split


def embedded_chat_file() -> Path:
    """The dataset as a ``.jsonl`` file in the cache (written once per interpreter, atomically)."""
    root = cache_dir() / "chat"
    root.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(f"{sys.version}|{Path(json.__file__).parent}|{MODULES}|{MAX_ANSWER_CHARS}".encode())
    path = root / f"embedded-chat-{key.hexdigest()[:16]}.jsonl"
    if not path.is_file():
        with hold_lock(root / f"{path.name}.lock", "writing the embedded instruction dataset"):
            if not path.is_file():
                write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in embedded_instructions()))
    return path
