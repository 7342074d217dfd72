"""Which HF architectures qharness trains and deploys, checked before any long work.

qharness needs a decoder-only causal LM that ``torch.export`` traces in two forms: the logits-only
training graph (``prepare.export_for_training``, exported when ``fit`` starts) and transformers'
static-KV-cache export (``lower.export_static_cache``, run after training). Nothing in qharness is
written per architecture; ``check_architecture`` reads ``config.json``, rules out what cannot work
(encoder-decoders, no causal-LM class, a recurrent state no route carries: convolution states (LFM2), the gated
delta rule's (Qwen3.5) and Mamba2's selective scan (Falcon-H1, Granite-4.0-H) are carried, ``fastpath/state_cache.py``)
and, given the run's recipe,
deploys a copy with one layer of each layer type, random weights and a small vocabulary exactly as deployment will
after training (``check_deploy``: export, quantization, the coverage check, lowering), so a model that would fail
after hours of training (an op the backend lacks, a quantizer error, a projection the recipe would leave float)
fails at once with a named reason. Without a recipe it traces the static-cache export of a weightless (``meta``)
copy. A success is remembered under ``$QHARNESS_CACHE/architectures``, keyed by what the check ran: the copy's
config (without the model's path, unless remote code comes from it), the recipe, the cache length and the
torch/transformers/executorch/torchao versions; so models that differ only in what the copy drops (their depth, their
vocabulary beyond the probe's, their folder) share one check. Per-architecture code, if one ever needs it, belongs in
this module.

Example::

    check_architecture("/path/to/qwen2-save_pretrained-dir", recipe=load_recipe("xnnpack_8da4w"), max_seq_len=128)
    # UserError (exit 2) naming what is missing or what fails
"""

from __future__ import annotations

import copy
import hashlib
import logging

from qharness.deploy.fastpath.state_cache import rule_modules
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


# a config's per-layer fields: one entry per hidden layer, cut with the layers a probe keeps (any other list, however
# long, is a setting: Falcon-H1's two-entry time_step_limit in a two-layer model is not per layer)
PER_LAYER_FIELDS = (
    "layer_types",
    "mlp_layer_types",
    "layers_block_type",
    "indexer_types",
    "layer_rope_theta",
    "no_rope_layers",
    "activation_sparsity_pattern",
)


def probe_config(config):
    """A copy of ``config`` with one layer of each distinct layer type (same widths), for a cheap trace.

    The config's own per-layer fields (``PER_LAYER_FIELDS``: ``layer_types`` and the like) keep the entries of the
    kept layers; a layer's type is its entries in all of them (attention kind, dense or sparse MLP, ...).
    """
    config = copy.deepcopy(config)
    text = config.get_text_config()
    n = getattr(text, "num_hidden_layers", None)
    if not isinstance(n, int) or n <= 1:
        return config
    fields = [
        key
        for key in PER_LAYER_FIELDS
        if isinstance(getattr(text, key, None), (list, tuple)) and len(getattr(text, key)) == n
    ]
    types = list(zip(*(getattr(text, key) for key in fields))) if fields else ["layer"] * n
    keep = sorted({t: i for i, t in reversed(list(enumerate(types)))}.values())  # first layer of each type
    for key in fields:
        attr = getattr(type(text), getattr(text, "attribute_map", {}).get(key, key), None)  # an alias's target
        if isinstance(attr, property) and attr.fset is None:  # derived from other settings (Jamba's layer_types)
            continue
        value = getattr(text, key)
        setattr(text, key, type(value)(value[i] for i in keep))
    text.num_hidden_layers = len(keep)
    return config


PROBE_VOCAB = (
    256  # the probe's vocabulary: embeddings and the output head at this size cost nothing to quantize and lower
)


def _cache_key(copy_config, trust_remote_code: bool, recipe=None, max_seq_len: int | None = None) -> str:
    """The key of a check of the copy built from ``copy_config`` (``probe_config``; ``small_vocab`` of it for the
    deploy probe): its outcome depends on that config, not on the model's folder (``_name_or_path``, kept when remote
    code is loaded from it), and on the recipe, the cache length and the versions of the stack."""
    import json
    from importlib.metadata import version

    fields = json.loads(copy_config.to_json_string(use_diff=False))
    if not trust_remote_code:
        fields.pop("_name_or_path", None)
    stack = " ".join(version(name) for name in ("torch", "transformers", "executorch", "torchao"))
    text = json.dumps(fields, sort_keys=True) + stack + "v2"
    if recipe is not None:  # the deploy probe: per recipe and cache length
        text += f"deploy v3 {recipe!r} {max_seq_len}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _trace(model) -> None:
    """The static-KV-cache export that deployment runs after training (the training graph is exported
    at the start of ``fit``, so a failure there shows at once anyway)."""
    from qharness.deploy.lower import export_static_cache

    export_static_cache(model, max_seq_len=8)


def small_vocab(config, size: int = PROBE_VOCAB):
    """``config`` (a probe's copy, changed in place) with at most ``size`` tokens; a padding id beyond them is
    dropped. The projections keep their widths: only the embedding table and the output head shrink."""
    text = config.get_text_config()
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab > size:
        text.vocab_size = size
        pad = getattr(text, "pad_token_id", None)
        if isinstance(pad, int) and pad >= size:
            text.pad_token_id = None
    return config


def _deploy(model, recipe, max_seq_len: int) -> None:
    """What deployment does after training, on the probe: export with the static KV cache, quantize with the recipe
    (random calibration tokens), the coverage check (``coverage.py``), lowering to a ``.pte`` (discarded). A failure
    other than a ``UserError`` comes out as ``ProbeFailed`` naming the stage."""
    import torch

    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy

    vocab = model.config.get_text_config().vocab_size
    tokens = torch.randint(0, vocab, (1, min(8, max_seq_len - 1)), generator=torch.Generator().manual_seed(0))

    def calibrate(graph):
        with torch.no_grad():
            graph(tokens, torch.tensor([0]))

    stage = "export + quantization"
    try:
        graph = quantize_for_deploy(model, recipe, max_seq_len, calibrate)
        stage = "lowering"
        lower_to_pte(graph, recipe, max_seq_len)
    except UserError:
        raise
    except Exception as e:
        raise ProbeFailed(stage) from e


class ProbeFailed(Exception):
    """A stage of the deploy probe failed: ``stage`` names it, ``__cause__`` is the failure."""

    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


def check_deploy(probe, recipe, max_seq_len: int, what: str, trust_remote_code: bool = False) -> None:
    """Deploy a one-layer copy of the model (``probe``: ``small_vocab(probe_config(config))``, random weights) with
    ``recipe`` as deployment will after training: a ``UserError`` naming the stage and the reason when anything fails
    (an op the backend lacks, a quantizer error, a projection the recipe would leave float)."""
    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from qharness.progress import stage
    from qharness.sources.normalize import normalize_model

    # a recipe's layers: rules name the full model's layers; they are checked on the model itself before training
    probe_recipe = dataclasses.replace(recipe, layers=()) if recipe.layers else recipe
    arch = (getattr(probe, "architectures", None) or [probe.model_type])[0]  # the class, once it is built
    try:
        with torch.random.fork_rng(devices=[]):  # the run's random state stays as it was seeded
            torch.manual_seed(0)
            try:
                model = AutoModelForCausalLM.from_config(probe, trust_remote_code=trust_remote_code).eval()
            except Exception as e:
                raise ProbeFailed("building") from e
            arch = type(model).__name__
            normalize_model(model)
            _check_experts(model, recipe, what, arch)
            with stage(f"checking that {arch} deploys with {recipe.name} (a one-layer copy, once)"):
                _deploy(model, probe_recipe, max_seq_len)
    except ProbeFailed as failed:
        e = failed.__cause__
        first = str(e).strip().splitlines()[0][:600] if str(e).strip() else ""  # both exports' reasons fit
        raise UserError(
            f"{what}: {arch} cannot be deployed with recipe {recipe.name!r}: {failed.stage} of a "
            f"one-layer copy fails ({type(e).__name__}: {first})",
            fix="use another recipe (qharness recipes) or a model family that deploys with it (Llama, Qwen2/3, "
            "Mistral, ...); found now, before training, instead of after it",
        ) from e


def _check_experts(model, recipe, what: str, arch: str) -> None:
    """``UserError`` when a quantizing ``recipe`` would leave MoE experts float: batched 3-D expert weights that
    ``sources/moe.py`` does not rewrite into per-expert ``nn.Linear`` layers (the only form a quantizer takes)."""
    from qharness.sources.moe import unconverted_experts

    left = unconverted_experts(model)
    if not left or not recipe.quantized:
        return
    name, why = next(iter(left.items()))
    raise UserError(
        f"{what}: recipe {recipe.name!r} would leave the MoE experts of {arch} in floating point: {name} ({why}) "
        "holds batched 3-D expert weights that qharness/sources/moe.py does not rewrite into per-expert nn.Linear "
        "layers, the only form a quantizer takes",
        fix="use an MoE family whose experts qharness rewrites (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite-MoE, "
        "DeepSeek-V3)",
    )


ATTENTION_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "hybrid"})
STATE_TYPES = frozenset({"conv", "linear_attention", "mamba"})


def _check_attention_layer(layer_types: set[str], what: str) -> None:
    """Refuse (``UserError``) a hybrid config whose ``layer_types`` hold recurrent layers and no attention layer
    (a tiny LFM3 or LFM2 of two conv layers, a Granite-4.0-H of Mamba layers only): transformers' own cache for these
    families needs an attention layer (``get_seq_length`` refuses a cache of linear layers only), so neither the model
    nor its export runs with a cache. No released checkpoint of these families is built so."""
    if not layer_types & STATE_TYPES or layer_types & ATTENTION_TYPES:
        return
    raise UserError(
        f"{what}: its layer_types ({', '.join(sorted(layer_types))}) hold no attention layer; transformers' cache for "
        "this family needs one (its get_seq_length refuses a cache of recurrent layers only), so the model cannot "
        "decode with a cache, here or in a .pte",
        fix="give the config at least one full_attention (or sliding_attention) layer in layer_types, as every "
        "released checkpoint of the family has",
    )


def check_architecture(
    source: str, trust_remote_code: bool = False, recipe=None, max_seq_len: int = 64, config=None
) -> None:
    """Raise ``UserError`` unless the model at ``source`` (directory or hub id) can be trained and deployed; with
    ``recipe``, deployed with that recipe and a ``max_seq_len``-position cache (``check_deploy``). ``config``: the
    model's config when it is known without ``source`` (the embedded model before it is pretrained)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from qharness.sources.cache import cache_dir

    config = load_config(source, trust_remote_code) if config is None else config
    what = f"unsupported model {source!r} (model_type {config.model_type!r})"
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(f"{what}: it is an encoder-decoder; qharness needs a decoder-only causal LM", fix=FIX)
    try:
        probe = probe_config(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(probe, trust_remote_code=trust_remote_code).eval()
    except Exception as e:
        if isinstance(e, ValueError) and "Unrecognized configuration class" in str(e):
            raise UserError(
                f"{what}: transformers has no causal-LM class (AutoModelForCausalLM) for it", fix=FIX
            ) from e
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise UserError(
            f"{what}: the architecture check cannot build a copy of it with one layer of each type "
            f"({type(e).__name__}: {first})",
            fix="check the config's per-layer settings (layer_types and the like) against num_hidden_layers, or "
            "report the config: the check needs that copy before any work",
        ) from e
    layer_types = set(getattr(probe.get_text_config(), "layer_types", None) or [])
    # MiniMax's lightning attention keeps its state in a cache of its own, the model not marked stateful
    if (getattr(model, "_is_stateful", False) or "linear_attention" in layer_types) and not rule_modules(model):
        kinds = sorted(layer_types - {"full_attention", "conv"})
        raise UserError(
            f"{what}: {type(model).__name__} keeps a recurrent (SSM) state"
            + (f" in its {', '.join(kinds)} layers" if kinds else "")
            + "; the .pte carries KV caches, convolution states (LFM2), the gated delta rule's state (Qwen3.5, "
            "Qwen3-Next) and Mamba2's selective-scan state (Falcon-H1, Granite-4.0-H, Bamba, Nemotron-H, Zamba2), not "
            "yet this layer's recurrence (Mamba1's per-channel selective scan, or another rule) continued from call "
            "to call",
            fix="deploy a hybrid qharness carries (LFM2, Qwen3.5, Falcon-H1, Granite-4.0-H, Nemotron-H) or a "
            "KV-cache family (Llama, Qwen3, Gemma3, ...)",
        )
    _check_attention_layer(layer_types, what)
    checked = probe if recipe is None else small_vocab(copy.deepcopy(probe))  # the config of the copy checked
    marker = cache_dir() / "architectures" / _cache_key(checked, trust_remote_code, recipe, max_seq_len)
    if marker.is_file():
        return
    t = time.perf_counter()
    if recipe is not None:
        check_deploy(checked, recipe, max_seq_len, what, trust_remote_code)
    else:
        _check_trace(model, probe, source, what, trust_remote_code)
    log.info("architecture check of %s: %.1f s", source, time.perf_counter() - t)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{source}\n{type(model).__name__}\n{'' if recipe is None else recipe.name}\n")


def _check_trace(model, probe, source: str, what: str, trust_remote_code: bool) -> None:
    """The static-cache export of the weightless copy (of one with random weights when that fails)."""
    from transformers import AutoModelForCausalLM

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
