"""What a run needs in memory, estimated from ``config.json`` alone, checked against what the machine has before any
work: the deployed program's static KV cache and weights at ``deploy.max_seq_len`` (``check_deploy_memory``) and a
floor of what one training step holds at ``[data.batch_size, data.seq_len]`` (``check_training_memory``), so a size
the machine cannot hold is one line at start, not an allocation of gigabytes (or a swapping machine) later.

Example::

    check_deploy_memory(AutoConfig.from_pretrained(model_dir), max_seq_len=100_000_000)
    # UserError: deploy.max_seq_len=100000000 needs a KV cache of about 25.6 GB plus ... fix: set deploy.max_seq_len <= ...
"""

from __future__ import annotations

import os

from qharness.errors import UserError
from qharness.io.disk import check_file_size_limit


def deploy_memory_bytes(config, max_seq_len: int) -> tuple[int, int]:
    """About the bytes deployment holds for ``config`` (a transformers config) at ``max_seq_len``, estimated from the
    config alone: ``(KV cache, weights)``: the fp32 static cache (keys and values of every layer, batch 1) and the
    fp32 weights (embeddings, attention and MLP of every layer, the LM head unless tied).

    Example: a 32-layer, 8 KV-head, 128-dim Llama at 8192 positions -> a KV cache of 2 x 32 x 8 x 128 x 8192 x 4 bytes
    (2.1 GB)."""
    text = config.get_text_config()

    def n(name, default=0):
        value = getattr(text, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default

    hidden, layers = n("hidden_size", 1), n("num_hidden_layers", 1)
    heads = n("num_attention_heads", 1)
    head_dim = n("head_dim") or hidden // heads or 1
    kv_heads = n("num_key_value_heads") or heads
    kv = 2 * layers * kv_heads * head_dim * max_seq_len * 4
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    mlp = 3 * hidden * (n("intermediate_size") or 4 * hidden)
    embeddings = n("vocab_size", 1) * hidden * (1 if getattr(text, "tie_word_embeddings", True) else 2)
    return kv, 4 * (embeddings + layers * (attention + mlp))


def available_memory_bytes() -> int | None:
    """The memory this machine can still give (Linux ``MemAvailable``; else free physical pages); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_deploy_memory(config, max_seq_len: int, available: int | None = None) -> None:
    """``UserError`` when the KV cache and weights of the deployed model at ``deploy.max_seq_len`` (``deploy_memory_bytes``)
    exceed the memory available now (``available``: bytes, default ``available_memory_bytes()``): one line before any
    work, instead of an allocation of gigabytes at export time. The file-size limit (``ulimit -f``) is checked against
    the least the ``.pte`` holds (``io/disk.check_file_size_limit``) at the same time."""
    available = available_memory_bytes() if available is None else available
    kv, weights = deploy_memory_bytes(config, max_seq_len)
    # the .pte holds the weights: a quarter of their float32 bytes at 8 bits, an eighth at 4 (the least any recipe writes)
    check_file_size_limit(weights // 8, "the .pte")
    if available is None or kv + weights <= available:
        return
    fits = max(0, (available - weights) * max_seq_len // max(kv, 1))
    raise UserError(
        f"deploy.max_seq_len={max_seq_len} needs a KV cache of about {kv / 1e9:.1f} GB plus {weights / 1e9:.1f} GB of "
        f"weights, more than the {available / 1e9:.1f} GB of memory available",
        fix=f"set deploy.max_seq_len <= {fits}" if fits >= 3 else "use a machine with more memory or a smaller model",
    )


def training_memory_floor(config, batch_size: int, seq_len: int) -> int:
    """A lower bound of the bytes one training step holds for ``config`` at ``[batch_size, seq_len]``, from the
    config alone: the fp32 weights with their gradients and AdamW's two moments (16 bytes a parameter), the logits
    and their gradient (``2 x B x T x vocab`` floats) and one layer's attention scores with their softmax
    (``2 x B x heads x T x T`` floats). What a step really takes is more (measured: about 27 bytes a parameter plus
    the activations, docs/tutorials/many-devices.md, "Memory per device"); a config past this floor cannot train here at all.

    Example: vocab 128256, batch 8 x 4096 tokens -> the logits alone are 2 x 8 x 4096 x 128256 x 4 bytes (33.6 GB)."""
    text = config.get_text_config()
    _, weights = deploy_memory_bytes(config, 0)
    vocab = getattr(text, "vocab_size", 1) or 1
    heads = getattr(text, "num_attention_heads", 1) or 1
    logits = 2 * batch_size * seq_len * vocab * 4
    scores = 2 * batch_size * heads * seq_len * seq_len * 4
    return 4 * weights + logits + scores


def check_training_memory(config, batch_size: int, seq_len: int, available: int | None = None) -> None:
    """``UserError`` when ``training_memory_floor`` exceeds the memory available now: one line before the model is
    loaded, instead of an allocation failure (or the machine swapping) in the first step."""
    available = available_memory_bytes() if available is None else available
    floor = training_memory_floor(config, batch_size, seq_len)
    if available is None or floor <= available:
        return
    raise UserError(
        f"data.batch_size={batch_size} x data.seq_len={seq_len} needs at least {floor / 1e9:.1f} GB to train (weights, "
        f"gradients and optimizer state, logits, one layer's attention scores), more than the {available / 1e9:.1f} GB "
        "of memory available",
        fix="lower data.batch_size or data.seq_len (trainer.accumulate_grad_batches keeps the effective batch), or "
        "use a machine with more memory",
    )
