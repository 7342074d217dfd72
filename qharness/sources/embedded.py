"""The embedded default model: a small Llama and its BPE tokenizer, pretrained in FP32 on first use on text that
ships with Python (or any ``data.source``), cached under ``$QHARNESS_CACHE``. No download.

Example::

    model_dir = embedded_dir()                       # what model.checkpoint: embedded resolves to
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from qharness.io.temps import remove_stale_temps, temp_dir_for
from qharness.sources.cache import build_once, cache_dir
from qharness.sources.text import EMBEDDED, embedded_corpus, load_texts, tokenize_stream
from qharness.sources.tokenizer import train_bpe_tokenizer


@dataclass(frozen=True)
class EmbeddedSpec:
    """The embedded default: a ~1M-parameter Llama (GQA, tied embeddings) and a byte-level BPE."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1000
    val_fraction: float = 0.1
    lr: float = 3e-3
    seed: int = 1234


def new_llama(spec: EmbeddedSpec, vocab_size: int):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(embedded_config(spec, vocab_size))


def embedded_config(spec: EmbeddedSpec = EmbeddedSpec(), vocab_size: int | None = None):
    """The embedded model's ``LlamaConfig`` (``vocab_size``: the trained tokenizer's size; default the spec's), known
    without pretraining (the architecture check deploys a copy of it before anything is trained)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size if vocab_size is None else vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def pretrain_embedded(spec: EmbeddedSpec, out_dir: Path, texts: list[str] | None = None) -> dict:
    """Train the tokenizer and pretrain the model in FP32 (plain PyTorch loop), save to ``out_dir``.

    The directory is written under a temporary name and renamed when complete, so a crash never
    leaves a half-written cache. Returns the training log (first/last loss).
    """
    import torch

    texts = texts if texts is not None else embedded_corpus()
    torch.manual_seed(spec.seed)
    tokenizer = train_bpe_tokenizer(texts, spec.vocab_size)
    stream = tokenize_stream(texts, tokenizer)
    cut = len(stream) - int(len(stream) * spec.val_fraction)  # hold out the same tail as TextDataModule
    model = new_llama(spec, len(tokenizer)).train()
    losses, val_curve = train_windows(
        model, stream[:cut], None, stream[cut:], None, spec, f"pretraining {spec.hidden_size}-dim Llama"
    )
    info = {
        "spec": asdict(spec),
        "first_loss": losses[0],
        "last_loss": sum(losses[-20:]) / len(losses[-20:]),
        "val_loss": val_curve,
    }
    save_model(model, tokenizer, out_dir, info)
    return info


def train_windows(model, data, targets, val, val_targets, spec, desc: str) -> tuple[list[float], list]:
    """Train ``model`` in place on random ``spec.seq_len`` windows of the token stream ``data`` (AdamW, one-cycle
    schedule, ``spec.steps`` steps of ``spec.batch_size``; ``spec`` has ``steps``, ``lr``, ``batch_size``,
    ``seq_len``, ``seed``). ``targets`` (aligned with ``data``, -100 where nothing is trained: chat data) or None
    (every next token). Returns the training losses and the held-out loss on ``val`` every tenth of the steps."""
    import torch
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=spec.steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(spec.seed)
    data_y = data if targets is None else targets
    val_y_all = val if val_targets is None else val_targets
    n_val = min(64, (len(val) - 1) // spec.seq_len)
    val_x = val[: n_val * spec.seq_len].view(n_val, spec.seq_len)
    val_y = val_y_all[1 : n_val * spec.seq_len + 1].view(n_val, spec.seq_len)

    def loss_of(x, y):  # mean over the trained targets (chat data: the answers' tokens)
        logits = model(input_ids=x).logits.flatten(0, 1)
        return torch.nn.functional.cross_entropy(logits, y.flatten(), reduction="sum") / (y != -100).sum().clamp(min=1)

    @torch.no_grad()
    def val_loss() -> float:  # held-out loss: shows whether training has converged
        model.eval()
        out = sum(loss_of(x, y).item() for x, y in zip(val_x.split(16), val_y.split(16))) / len(val_x.split(16))
        model.train()
        return out

    losses, val_curve = [], []
    bar = tqdm(range(spec.steps), desc=desc, unit="step")
    for step in bar:
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        x = torch.stack([data[s : s + spec.seq_len] for s in starts])
        y = torch.stack([data_y[s + 1 : s + spec.seq_len + 1] for s in starts])
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if n_val and (step + 1) % max(1, spec.steps // 10) == 0:
            val_curve.append((step + 1, val_loss()))
    return losses, val_curve


def save_model(model, tokenizer, out_dir: Path, info: dict) -> None:
    """``save_pretrained`` of the model and tokenizer plus ``qharness_pretrain.json`` (``info``) into ``out_dir``,
    written under a temporary name and renamed when complete (a crash never leaves a half-written cache)."""
    remove_stale_temps(out_dir.parent)  # what a killed build (of any cached model) left behind
    tmp = temp_dir_for(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval().save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "qharness_pretrain.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def embedded_dir(spec: EmbeddedSpec = EmbeddedSpec(), source: str = EMBEDDED) -> Path:
    """The embedded default's architecture and tokenizer pretrained on ``source`` (default: the embedded
    corpus; or a ``data.source`` such as a text file), on first use, cached (keyed by the spec and the text).

    Example: ``embedded_dir(EmbeddedSpec(steps=3000), "../shared/data/tinyshakespeare/input.txt")``
    """
    texts = embedded_corpus() if source == EMBEDDED else load_texts(source)
    h = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode())
    for doc in texts:
        h.update(doc.encode())
    name = "embedded" if source == EMBEDDED else Path(source).stem
    out = cache_dir() / f"{name}-llama-{h.hexdigest()[:12]}"
    what = "pretraining the " + ("embedded default model" if source == EMBEDDED else f"model on {source}")
    return build_once(out, what, lambda: pretrain_embedded(spec, out, texts))
