"""Model sources: an HF transformers directory or hub id, a torchtune builder, or the embedded default.

``resolve_checkpoint("embedded")`` returns the embedded default's directory (``qharness/sources/embedded.py``);
any other value is a local directory in ``save_pretrained`` format, a ``.gguf`` file (converted once:
``qharness/sources/gguf.py``), ``torchtune:<builder>(...)`` (``qharness/sources/torchtune.py``) or, when online, a
hub id.

Example::

    model, tokenizer = load_model_and_tokenizer(resolve_checkpoint("embedded"))
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from qharness.errors import UserError
from qharness.sources.gguf import gguf_dir, is_gguf, read_header

EMBEDDED = "embedded"  # model.checkpoint of the built-in default (as data.source "embedded" names its corpus)
EMBEDDED_CHAT = "embedded-chat"  # the built-in default fine-tuned on the embedded instruction data (its data.source)
EMBEDDED_MODELS = (EMBEDDED, EMBEDDED_CHAT)  # built on first use, cached: nothing to download


def resolve_checkpoint(checkpoint: str) -> str:
    """Turn ``model.checkpoint`` into something ``from_pretrained`` loads: a local dir or a hub id
    (``torchtune:...`` builders and ``.gguf`` files are converted once into a cached HF directory)."""
    if checkpoint == EMBEDDED:
        from qharness.sources.embedded import embedded_dir

        return str(embedded_dir())
    if checkpoint == EMBEDDED_CHAT:
        from qharness.sources.embedded_chat import embedded_chat_dir

        return str(embedded_chat_dir())
    from qharness.sources.torchtune import is_torchtune, torchtune_dir

    if is_torchtune(checkpoint):
        return str(torchtune_dir(checkpoint))
    local = check_local_checkpoint(checkpoint)
    if local is not None and is_gguf(local):
        return str(gguf_dir(local))
    return local or checkpoint  # else a hub id


def check_local_checkpoint(checkpoint: str) -> str | None:
    """A ``model.checkpoint`` that names a local directory or ``.gguf`` file: the path if it holds a
    ``save_pretrained`` model or is a whole GGUF file (``gguf.read_header``), else a ``UserError``; None for a hub id.
    Torch-free (the CLI's pre-check runs it).

    Example::

        check_local_checkpoint("./no/such/dir")   # UserError: model.checkpoint ./no/such/dir does not exist
    """
    if not checkpoint.strip():
        raise UserError(
            "model.checkpoint is empty", fix="give a save_pretrained directory, a .gguf file, a hub id, or 'embedded'"
        )
    path = Path(checkpoint).expanduser()
    if path.exists():
        if is_gguf(checkpoint):
            read_header(path)
            return str(path)
        if not path.is_dir():
            raise UserError(
                f"model.checkpoint {path} is a file", fix="point it at a save_pretrained directory or a .gguf file"
            )
        if not (path / "config.json").is_file():
            raise UserError(
                f"model.checkpoint {path} has no config.json", fix="point it at a save_pretrained directory"
            )
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise UserError(
                f"model.checkpoint {path} has no weights (*.safetensors)", fix="save the model with save_pretrained"
            )
        check_config_sizes(path / "config.json")
        for weights in sorted(path.glob("*.safetensors")):
            check_safetensors(weights)
        return str(path)
    check_embedded_name(checkpoint)
    if checkpoint.lower().endswith(".gguf"):
        raise UserError(f"model.checkpoint {checkpoint} does not exist", fix="give an existing .gguf file")
    if checkpoint.startswith((".", "/", "~")) or checkpoint.count("/") > 1:
        raise UserError(f"model.checkpoint {checkpoint} does not exist", fix="give an existing directory or a hub id")
    return None


def check_embedded_name(checkpoint: str) -> None:
    """A ``model.checkpoint`` that looks like a misspelt built-in model (``embeded-chat``, ``embedded_chat``) is
    refused with the known names, rather than looked up on the hub."""
    import difflib

    if checkpoint in EMBEDDED_MODELS or "/" in checkpoint:
        return
    if checkpoint.lower().startswith("embed") or difflib.get_close_matches(checkpoint, EMBEDDED_MODELS, cutoff=0.8):
        raise UserError(
            f"model.checkpoint {checkpoint!r} is not a built-in model",
            fix=f"use one of {', '.join(EMBEDDED_MODELS)}, a save_pretrained directory or a hub id",
        )


# config.json fields that count things (GPT-2 style names too): each must be a whole number >= 1 where it is set
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
)


def check_config_sizes(path: Path) -> None:
    """``config.json``'s sizes (``SIZE_FIELDS``, at the top and in a ``text_config``) read without torch: a number that
    is not a whole number >= 1 (zero attention heads divide by zero deep in transformers) is a ``UserError`` naming the
    field, before anything loads. Unreadable JSON is one too."""
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(
            f"model.checkpoint {path} is not valid JSON ({e})", fix="save the model with save_pretrained"
        ) from e
    if not isinstance(config, dict):
        raise UserError(f"model.checkpoint {path} must hold a JSON object", fix="save the model with save_pretrained")
    sections = [("", config)] + [
        (f"{k}.", v) for k, v in config.items() if k.endswith("_config") and isinstance(v, dict)
    ]
    for prefix, section in sections:
        for field in SIZE_FIELDS:
            value = section.get(field)
            if value is None:
                continue
            if isinstance(value, (list, tuple, dict)):
                continue  # a per-layer list or the like: transformers judges it
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value >= 1 and value == int(value))
            ):
                raise UserError(
                    f"model.checkpoint {path}: {prefix}{field} must be a whole number >= 1 (got {value!r})",
                    fix=f"set {prefix}{field} in config.json to the model's real size (as save_pretrained wrote it)",
                )
        _check_rope(path, prefix, section)


# config.json's rotary bases: a base <= 0 (or not finite) makes the rotary frequencies inf/NaN, which surfaced as
# "non-finite weights" of the loaded model
ROPE_FIELDS = ("rope_theta", "rope_local_base_freq")


def _check_rope(path: Path, prefix: str, section: dict) -> None:
    """Each rotary base of a config section (at its top, in ``rope_parameters``/``rope_scaling``, also per attention
    type) a finite number > 0, else a ``UserError`` naming the field."""
    places = [(prefix, section)]
    for key in ("rope_parameters", "rope_scaling"):
        sub = section.get(key)
        if isinstance(sub, dict):
            places.append((f"{prefix}{key}.", sub))
            places += [(f"{prefix}{key}.{k}.", v) for k, v in sub.items() if isinstance(v, dict)]
    for where, values in places:
        for field in ROPE_FIELDS:
            value = values.get(field)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise UserError(
                    f"model.checkpoint {path}: {where}{field} must be a finite number > 0 (got {value!r}): it is the "
                    "base of the rotary position frequencies",
                    fix=f"set {where}{field} in config.json to the model's own value (e.g. 10000.0, as its "
                    "save_pretrained wrote it)",
                )


def check_safetensors(path: Path) -> None:
    """A ``.safetensors`` file's header (8-byte length, JSON) read without torch: a truncated or damaged file is a
    ``UserError`` naming it, before anything loads."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        header = f.read(n) if 0 < n <= min(size - 8, 100_000_000) else b""
    try:
        tensors = json.loads(header) if header else None
        ends = [t["data_offsets"][1] for k, t in tensors.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        tensors = None
    if tensors is None or 8 + n + max(ends, default=0) > size:
        raise UserError(
            f"model.checkpoint {path.parent}: {path.name} is truncated or not a safetensors file ({size} bytes)",
            fix="copy or download the weights again (save_pretrained writes them whole)",
        )


def load_model_and_tokenizer(source: str, trust_remote_code: bool = False):
    """Load an FP32 causal LM (eval mode, its projections and MoE experts plain ``nn.Linear`` modules:
    ``normalize.py``, ``moe.py``) and its tokenizer from a directory or hub id."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        model, info = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, trust_remote_code=trust_remote_code, output_loading_info=True
        )
    except OSError as e:
        raise UserError(
            f"could not load model {source!r}: {str(e).splitlines()[0]}", fix="check model.checkpoint"
        ) from e
    except ValueError as e:
        raise UserError(f"unsupported model {source!r}: {str(e).splitlines()[0]}") from e
    except (RuntimeError, SafetensorError) as e:  # weights of other shapes than config.json says; a damaged file
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(
            f"model.checkpoint {source}: the weights do not load ({first[:300]})",
            fix="use weights saved with this config.json (save_pretrained), complete and undamaged",
        ) from e
    check_loaded_weights(source, info)
    check_finite_weights(model, f"model.checkpoint {source}")
    from qharness.sources.normalize import normalize_model

    normalize_model(model)  # Conv1D, FalconLinear, batched MoE experts -> nn.Linear: what quantizers see, every stage
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) > model.config.get_text_config().vocab_size:
        raise UserError(
            f"tokenizer of {source} has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{model.config.get_text_config().vocab_size}",
            fix="use the tokenizer the model was trained with",
        )
    return model.eval(), tokenizer


def check_loaded_weights(source: str, info: dict) -> None:
    """Refuse a checkpoint whose weights do not cover its ``config.json`` (HF would fill the gap with random
    weights, or drop the extra ones, and only log it): e.g. a config saying 6 layers beside weights for 4."""
    missing, unexpected = sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ()))
    mismatched = [k for k, *_ in info.get("mismatched_keys", ())]
    for what, keys in (("lacks", missing), ("has extra", unexpected), ("has wrongly shaped", mismatched)):
        if keys:
            raise UserError(
                f"model.checkpoint {source}: its weights do not match its config.json (the checkpoint {what} "
                f"{len(keys)} tensors, e.g. {keys[0]})",
                fix="make config.json describe the saved weights (e.g. num_hidden_layers), or re-save with save_pretrained",
            )


def check_finite_weights(model, where: str) -> None:
    """Refuse a model with a NaN/inf value in any floating-point weight, or a NaN in a buffer (masks may hold -inf),
    ``where`` naming its source: nothing trained, calibrated or exported from it could be right, and NaN compares
    as no number does."""
    import torch

    tensors = [(n, t, torch.isfinite) for n, t in model.named_parameters()]
    tensors += [(n, t, lambda x: ~torch.isnan(x)) for n, t in model.named_buffers()]
    for name, t, ok in tensors:
        if t.is_floating_point() and not bool(ok(t).all()):
            bad = (~ok(t)).sum().item()
            raise UserError(
                f"{where}: {name} holds {bad} NaN/inf value(s) of {t.numel()}",
                fix="use weights that are all finite (a checkpoint saved before training diverged, or the original)",
            )


# --- a loaded model's parameters ---------------------------------------------------------------
def parameter_names(model) -> list[list[str]]:
    """The names of each of ``model``'s parameter tensors: one list per tensor, several names where it is tied."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return list(names.values())


def tied(model) -> set[str]:
    """Names of ``model``'s parameters that share their tensor with another name (e.g. a tied ``lm_head.weight``)."""
    return {n for group in parameter_names(model) if len(group) > 1 for n in group}


UNTIED_TABLES = "_qharness_untied_tables"  # the model attribute where put_weights keeps the tables it untied


def tied_tables(model) -> frozenset[str]:
    """Names of ``model``'s embedding tables whose weight is its output projection's (``get_output_embeddings()``);
    empty for a model without one (``qharness sensitivity``'s copies of single layers). A table that ``put_weights``
    untied (a step that chose the head's weights itself: GPTQ, weighted scales, zero points) still counts: tiedness
    is the loaded model's, so a recipe's tied-table settings and the summary's ``tied_to`` do not depend on the head's
    scheme.

    Example::

        tied_tables(smollm2)  # frozenset({'model.embed_tokens'}); a model whose lm_head has its own weight: frozenset()
    """
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    untied = getattr(model, UNTIED_TABLES, frozenset())
    if weight is None:
        return untied
    return untied | {n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding) and m.weight is weight}


def put_weights(model, weights: dict) -> None:
    """Give ``model`` the ``weights`` (by name), each as a parameter of its own: a tied weight gets untied (and the
    config says so, so nothing ties it again)."""
    import torch

    shared, tables = tied(model), tied_tables(model)
    for name, w in weights.items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        old = getattr(module, attr)
        setattr(module, attr, torch.nn.Parameter(w.detach().clone().to(old.device), requires_grad=old.requires_grad))
    if shared & set(weights):
        setattr(model, UNTIED_TABLES, tables)  # still tied for the recipe's table settings (tied_tables)
        for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            config.tie_word_embeddings = False
