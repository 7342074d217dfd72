"""The embedded chat model (``model.checkpoint: embedded-chat``): the embedded default fine-tuned on the training split
of the embedded instruction dataset (``data.source: embedded-chat``, its ``embedded`` chat template, loss on the
answers), built on first use and cached under ``$QHARNESS_CACHE`` like the embedded default. Its tokenizer carries
the chat template. No download.

The split is the runs' own (``data.seq_len: 128``, ``data.val_fraction: 0.1``, the defaults): the held-out
conversations a run answers (``eval.answers``) were never in its fine-tuning data.

Example::

    model_dir = embedded_chat_dir()                  # what model.checkpoint: embedded-chat resolves to
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from qharness.sources.cache import build_once, cache_dir
from qharness.sources.chat import ChatFormat
from qharness.sources.chat_demo import TEMPLATE, TUNED_SEQ_LEN, TUNED_VAL_FRACTION, embedded_chat_file
from qharness.sources.embedded import embedded_dir, save_model, train_windows
from qharness.sources.example_cache import example_stream


@dataclass(frozen=True)
class ChatTuneSpec:
    """How the embedded default becomes the embedded chat model: ``steps`` AdamW steps of ``batch_size`` windows of
    ``seq_len`` tokens of the training split (the last ``val_fraction`` of the examples' tokens held out)."""

    steps: int = 200
    lr: float = 5e-4
    batch_size: int = 8
    seq_len: int = TUNED_SEQ_LEN  # data.seq_len's default: the runs' split
    val_fraction: float = TUNED_VAL_FRACTION  # data.val_fraction's default
    seed: int = 1234


def chat_format(spec: ChatTuneSpec) -> ChatFormat:
    """The runs' reading of ``data.source: embedded-chat`` (instruction records, the ``embedded`` template, loss on the
    answers, long examples truncated to ``seq_len + 1`` tokens)."""
    return ChatFormat(kind="instruction", max_tokens=spec.seq_len + 1, template=TEMPLATE, train_on="answers")


def chat_split(tokenizer, spec: ChatTuneSpec):
    """``(tokens, targets, cut)``: the embedded instruction dataset's example stream and where its validation split
    starts, as ``TextDataModule.setup`` cuts it (the tokens before ``cut`` are the training split)."""
    tokens, targets, _ = example_stream(str(embedded_chat_file()), chat_format(spec), tokenizer)
    return tokens, targets, len(tokens) - int(len(tokens) * spec.val_fraction)


def tune_embedded_chat(base: Path, out_dir: Path, spec: ChatTuneSpec) -> dict:
    """Fine-tune the model in ``base`` on the training split, save it with a tokenizer carrying the chat template into
    ``out_dir`` (atomically). Returns the training log."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base).float().train()
    tokens, targets, cut = chat_split(tokenizer, spec)
    losses, val_curve = train_windows(
        model, tokens[:cut], targets[:cut], tokens[cut:], targets[cut:], spec, "fine-tuning the embedded chat model"
    )
    tokenizer.chat_template = TEMPLATE
    info = {
        "base": str(base),
        "chat_spec": asdict(spec),
        "train_tokens": cut,
        "first_loss": losses[0],
        "last_loss": sum(losses[-20:]) / len(losses[-20:]),
        "val_loss": val_curve,
    }
    save_model(model, tokenizer, out_dir, info)
    return info


def embedded_chat_dir(spec: ChatTuneSpec | None = None, base: Path | None = None) -> Path:
    """The embedded chat model's directory (``spec``: default ``ChatTuneSpec()``; ``base``: the model fine-tuned,
    default the embedded default), built on first use, cached (keyed by ``spec``, the base model, the dataset and
    the template)."""
    spec = spec if spec is not None else ChatTuneSpec()
    base = Path(base) if base is not None else embedded_dir()
    key = json.dumps([asdict(spec), str(base), embedded_chat_file().name, TEMPLATE], sort_keys=True)
    out = cache_dir() / f"embedded-chat-llama-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return build_once(out, "fine-tuning the embedded chat model", lambda: tune_embedded_chat(base, out, spec))
