"""Which HF architectures qharness trains and deploys, checked before any long work.

qharness needs a decoder-only causal LM that ``torch.export`` traces in two forms: the logits-only
training graph (``module.export_for_training``, exported when ``fit`` starts) and transformers'
static-KV-cache export (``lower.export_static_cache``, run after training). Nothing in qharness is
written per architecture; ``check_architecture`` reads ``config.json``, rules out what cannot work
(encoder-decoders, no causal-LM class, recurrent state instead of a KV cache) and traces the
static-cache export of a weightless (``meta``) copy with one layer of each layer type, so a model that
would fail after hours of training fails at once with a named reason. A success is remembered under ``$QHARNESS_CACHE/architectures`` (keyed by the config and the
torch/transformers versions). Per-architecture code, if one ever needs it, belongs in this module.

Example::

    check_architecture("/path/to/qwen2-save_pretrained-dir")   # UserError (exit 2) naming what is missing
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os

from qharness.errors import UserError

log = logging.getLogger(__name__)

FIX = "use a decoder-only causal LM whose attention uses a KV cache (Llama, Qwen2/3, Mistral, Phi-3, Gemma/Gemma2/Gemma3, ...)"


def load_config(source: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except OSError as e:
        raise UserError(
            f"could not load the config of model {source!r}: {str(e).splitlines()[0]}", fix="check model.checkpoint"
        ) from e
    except ValueError as e:  # unknown model_type (newer transformers, or remote code without trust_remote_code)
        raise UserError(f"unsupported model {source!r}: {str(e).splitlines()[0]}", fix=FIX) from e


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
    work, instead of an allocation of gigabytes at export time."""
    available = available_memory_bytes() if available is None else available
    kv, weights = deploy_memory_bytes(config, max_seq_len)
    if available is None or kv + weights <= available:
        return
    fits = max(0, (available - weights) * max_seq_len // max(kv, 1))
    raise UserError(
        f"deploy.max_seq_len={max_seq_len} needs a KV cache of about {kv / 1e9:.1f} GB plus {weights / 1e9:.1f} GB of "
        f"weights, more than the {available / 1e9:.1f} GB of memory available",
        fix=f"set deploy.max_seq_len <= {fits}" if fits >= 3 else "use a machine with more memory or a smaller model",
    )


def probe_config(config):
    """A copy of ``config`` with one layer of each distinct layer type (same widths), for a cheap trace.

    Per-layer lists (``layer_types`` and any other list as long as the layer count) keep the entries of
    the kept layers.
    """
    config = copy.deepcopy(config)
    text = config.get_text_config()
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 1:
        return config
    types = getattr(text, "layer_types", None) or ["layer"] * n
    keep = sorted({t: i for i, t in reversed(list(enumerate(types)))}.values())  # first layer of each type
    for key, value in list(vars(text).items()):
        if isinstance(value, (list, tuple)) and len(value) == n:
            setattr(text, key, type(value)(value[i] for i in keep))
    text.num_hidden_layers = len(keep)
    return config


def _cache_key(config) -> str:
    import torch
    import transformers

    text = config.to_json_string(use_diff=False) + transformers.__version__ + torch.__version__ + "v1"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _trace(model) -> None:
    """The static-KV-cache export that deployment runs after training (the training graph is exported
    at the start of ``fit``, so a failure there shows at once anyway)."""
    from qharness.deploy.lower import export_static_cache

    export_static_cache(model, max_seq_len=8)


def check_architecture(source: str, trust_remote_code: bool = False) -> None:
    """Raise ``UserError`` unless the model at ``source`` (directory or hub id) can be trained and deployed."""
    import torch
    from transformers import AutoModelForCausalLM

    from qharness.sources.cache import cache_dir

    config = load_config(source, trust_remote_code)
    what = f"unsupported model {source!r} (model_type {config.model_type!r})"
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"{what}: it is an encoder-decoder; qharness needs a decoder-only causal LM", fix=FIX)
    marker = cache_dir() / "architectures" / _cache_key(config)
    if marker.is_file():
        return
    probe = probe_config(config)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(probe, trust_remote_code=trust_remote_code).eval()
    except ValueError as e:  # "Unrecognized configuration class ... for this kind of AutoModel"
        raise UserError(f"{what}: transformers has no causal-LM class (AutoModelForCausalLM) for it", fix=FIX) from e
    if getattr(model, "_is_stateful", False):
        raise UserError(
            f"{what}: {type(model).__name__} keeps a recurrent state, not a KV cache; "
            "transformers' static-KV-cache export (what the .pte runs) needs attention layers with a KV cache",
            fix=FIX,
        )
    try:
        try:
            _trace(model)
        except Exception:  # some models compute constants at init that a weightless copy lacks: retry with weights
            log.info("tracing a meta-device copy of %s failed; retrying with real (random) weights", source)
            model = AutoModelForCausalLM.from_config(probe, trust_remote_code=trust_remote_code).eval()
            _trace(model)
    except Exception as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise UserError(
            f"{what}: {type(model).__name__} cannot be exported with torch.export ({type(e).__name__}: {first})",
            fix=FIX,
        ) from e
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{source}\n{type(model).__name__}\n")
