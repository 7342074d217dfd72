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
    except ZeroDivisionError as e:  # a config's own checks divide by a size (e.g. num_attention_heads: 0)
        raise UserError(
            f"the config of model {source!r} has a size of 0 (e.g. num_attention_heads)",
            fix="give every size in config.json (num_attention_heads, num_key_value_heads, ...) a whole number >= 1",
        ) from e


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
