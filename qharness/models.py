"""Model sources: an HF transformers directory or hub id, a torchtune builder, or the embedded default.

``resolve_checkpoint("embedded")`` returns a local directory holding a small Llama and its BPE
tokenizer, pretrained in FP32 on text that ships with Python (``pydoc_data`` + stdlib sources) on first use, cached
under ``$QHARNESS_CACHE`` (default ``~/.cache/qharness``). Any other value is a local directory in
``save_pretrained`` format, ``torchtune:<builder>(...)`` (``qharness/torchtune_models.py``) or, when
online, a hub id.

Example::

    model, tokenizer = load_model_and_tokenizer(resolve_checkpoint("embedded"))
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from qharness.errors import UserError

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EOS = "<|endoftext|>"


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


def cache_dir() -> Path:
    return Path(os.environ.get("QHARNESS_CACHE", Path.home() / ".cache" / "qharness"))


def embedded_corpus(max_chars: int = 2_500_000) -> list[str]:
    """Text that ships with CPython, no download: the English documentation topics of ``pydoc_data``
    and the source of the top-level standard-library modules, in a fixed pseudo-random order (so the
    held-out tail mixes prose and code), capped at ``max_chars``."""
    import sysconfig
    from pydoc_data.topics import topics

    docs = {f"topic:{k}": v for k, v in topics.items()}
    for path in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"):
        docs[f"module:{path.name}"] = path.read_text(encoding="utf-8", errors="replace")
    out, total = [], 0
    for name in sorted(docs, key=lambda n: hashlib.sha1(n.encode()).hexdigest()):
        if total >= max_chars:
            break
        out.append(docs[name])
        total += len(docs[name])
    return out


def train_bpe_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE trained with ``tokenizers``, wrapped as a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` is BOS, EOS and PAD; prompts start with BOS (a template post-processor, which
    ExecuTorch's LLM runner also reads from ``tokenizer.json``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", special_tokens=[(EOS, eos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)


def new_llama(spec: EmbeddedSpec, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
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
    return LlamaForCausalLM(config)


def pretrain_embedded(spec: EmbeddedSpec, out_dir: Path, texts: list[str] | None = None) -> dict:
    """Train the tokenizer and pretrain the model in FP32 (plain PyTorch loop), save to ``out_dir``.

    The directory is written under a temporary name and renamed when complete, so a crash never
    leaves a half-written cache. Returns the training log (first/last loss).
    """
    import torch
    from tqdm import tqdm

    from qharness.data import tokenize_stream

    texts = texts if texts is not None else embedded_corpus()
    torch.manual_seed(spec.seed)
    tokenizer = train_bpe_tokenizer(texts, spec.vocab_size)
    stream = tokenize_stream(texts, tokenizer)
    data = stream[: len(stream) - int(len(stream) * spec.val_fraction)]  # hold out the same tail as TextDataModule
    model = new_llama(spec, len(tokenizer)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=spec.steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(spec.seed)
    val = stream[len(data) :]
    n_val = min(64, (len(val) - 1) // spec.seq_len)
    val_x = val[: n_val * spec.seq_len].view(n_val, spec.seq_len)
    val_y = val[1 : n_val * spec.seq_len + 1].view(n_val, spec.seq_len)

    @torch.no_grad()
    def val_loss() -> float:  # held-out loss: shows whether pretraining has converged
        model.eval()
        out = sum(torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
                  for x, y in zip(val_x.split(16), val_y.split(16))) / len(val_x.split(16))
        model.train()
        return out

    losses, val_curve = [], []
    bar = tqdm(range(spec.steps), desc=f"pretraining {spec.hidden_size}-dim Llama", unit="step")
    for step in bar:
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        x = torch.stack([data[s : s + spec.seq_len] for s in starts])
        y = torch.stack([data[s + 1 : s + spec.seq_len + 1] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if n_val and (step + 1) % max(1, spec.steps // 10) == 0:
            val_curve.append((step + 1, val_loss()))
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval().save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {"spec": asdict(spec), "first_loss": losses[0], "last_loss": sum(losses[-20:]) / len(losses[-20:]), "val_loss": val_curve}
    (tmp / "qharness_pretrain.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return info


def embedded_dir(spec: EmbeddedSpec = EmbeddedSpec(), source: str = EMBEDDED) -> Path:
    """The embedded default's architecture and tokenizer pretrained on ``source`` (default: the embedded
    corpus; or a ``data.source`` such as a text file), on first use, cached (keyed by the spec and the text).

    Example: ``embedded_dir(EmbeddedSpec(steps=3000), "../shared/data/tinyshakespeare/input.txt")``
    """
    from qharness.data import load_texts

    texts = embedded_corpus() if source == EMBEDDED else load_texts(source)
    h = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode())
    for doc in texts:
        h.update(doc.encode())
    name = "embedded" if source == EMBEDDED else Path(source).stem
    out = cache_dir() / f"{name}-llama-{h.hexdigest()[:12]}"
    if not (out / "config.json").is_file():
        log.info("pretraining the %s model once (cached in %s)", "embedded default" if source == EMBEDDED else source, out)
        out.parent.mkdir(parents=True, exist_ok=True)
        pretrain_embedded(spec, out, texts)
    return out


def resolve_checkpoint(checkpoint: str) -> str:
    """Turn ``model.checkpoint`` into something ``from_pretrained`` loads: a local dir or a hub id
    (``torchtune:...`` builders are converted once into a cached HF directory)."""
    if checkpoint == EMBEDDED:
        return str(embedded_dir())
    from qharness.torchtune_models import is_torchtune, torchtune_dir

    if is_torchtune(checkpoint):
        return str(torchtune_dir(checkpoint))
    path = Path(checkpoint).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"model.checkpoint {path} is a file", fix="point it at a save_pretrained directory")
        if not (path / "config.json").is_file():
            raise UserError(f"model.checkpoint {path} has no config.json", fix="point it at a save_pretrained directory")
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise UserError(f"model.checkpoint {path} has no weights (*.safetensors)", fix="save the model with save_pretrained")
        return str(path)
    if checkpoint.startswith((".", "/", "~")) or checkpoint.count("/") > 1:
        raise UserError(f"model.checkpoint {checkpoint} does not exist", fix="give an existing directory or a hub id")
    return checkpoint  # a hub id


def load_model_and_tokenizer(source: str, trust_remote_code: bool = False):
    """Load an FP32 causal LM (eval mode) and its tokenizer from a directory or hub id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise UserError(f"could not load model {source!r}: {str(e).splitlines()[0]}", fix="check model.checkpoint") from e
    except ValueError as e:
        raise UserError(f"unsupported model {source!r}: {str(e).splitlines()[0]}") from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > model.config.get_text_config().vocab_size:
        raise UserError(
            f"tokenizer of {source} has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{model.config.get_text_config().vocab_size}",
            fix="use the tokenizer the model was trained with",
        )
    return model.eval(), tokenizer
