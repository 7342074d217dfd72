"""torchtune model builders as ``model.checkpoint``: ``torchtune:<builder>[(key=value, ...)]``.

The builder is a function under ``torchtune.models`` (the prefix may be left out), called with the
literal keyword arguments in parentheses, e.g.::

    torchtune:llama3_2.llama3_2_1b
    torchtune:llama3_2.llama3_2(vocab_size=2048, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=128, max_seq_len=512, intermediate_dim=384)

It builds a random-initialised model (seed 0, or ``seed=N``), maps its state dict to HF's names with
torchtune's own ``convert_weights.tune_to_hf`` and saves an HF ``LlamaForCausalLM`` directory (config
derived from the built modules) under ``$QHARNESS_CACHE/torchtune-<hash>``; from there it is an ordinary
HF checkpoint (training graph, static-KV-cache ``.pte``, runner tokenizer). The conversion is checked:
the HF model's logits must equal torchtune's on random tokens, or the builder is refused (only
Llama-style decoders map: Llama 2/3/3.1/3.2, Code Llama, ...).

Tokenizer: ``tokenizer="<HF tokenizer directory or hub id>"`` (it must fit the model's vocabulary), or by
default a byte-level BPE (``min(vocab_size, 2048)`` tokens) trained on the embedded corpus. A model
fine-tuned with torchtune and saved by its ``FullModelHFCheckpointer`` is already an HF directory:
point ``model.checkpoint`` at that directory instead.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import shutil
from pathlib import Path

from qharness.errors import UserError
from qharness.io.temps import remove_stale_temps, temp_dir_for

PREFIX = "torchtune:"
RESERVED = ("tokenizer", "seed")  # ours, not the builder's
FIX = "use a Llama-style builder written as torchtune:<module>.<builder>(key=value, ...), e.g. torchtune:llama3_2.llama3_2_1b"


def is_torchtune(checkpoint: str) -> bool:
    return checkpoint.startswith(PREFIX)


def parse_spec(checkpoint: str) -> tuple[str, dict]:
    """``torchtune:llama3_2.llama3_2(num_layers=2)`` -> ``("torchtune.models.llama3_2.llama3_2", {"num_layers": 2})``.

    Keyword values must be Python literals (read with ``ast.literal_eval``; nothing is executed).
    """
    text = checkpoint[len(PREFIX) :].strip()
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise UserError(f"model.checkpoint {checkpoint!r} is not a builder call", fix=FIX) from e
    call = node if isinstance(node, ast.Call) else None
    target = call.func if call else node
    if call and call.args:
        raise UserError(f"model.checkpoint {checkpoint!r}: give builder arguments by keyword", fix=FIX)
    try:
        path = ast.unparse(target)
        if not all(part.isidentifier() for part in path.split(".")):
            raise ValueError(path)
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in (call.keywords if call else [])}
    except ValueError as e:
        raise UserError(
            f"model.checkpoint {checkpoint!r}: builder arguments must be literals (numbers, strings, ...)", fix=FIX
        ) from e
    if None in kwargs:
        raise UserError(f"model.checkpoint {checkpoint!r}: **kwargs are not allowed", fix=FIX)
    if not path.startswith("torchtune."):
        path = "torchtune.models." + path
    if not path.startswith("torchtune.models."):
        raise UserError(f"model.checkpoint {checkpoint!r}: the builder must live under torchtune.models", fix=FIX)
    return path, kwargs


def resolve_builder(path: str):
    """The builder named by ``path``, checked against the allow-list before anything is called.

    Allowed: a public function ``torchtune.models.<family>.<name>`` listed in the family's ``__all__`` whose return
    annotation is ``TransformerDecoder`` (the model builders; not tokenizers, weight converters, partials or
    private helpers such as ``_model_builders._get_prompt_template``, which imports and calls what it is given).
    """
    import inspect

    from qharness.upstream.torchtune import import_torchtune

    import_torchtune()
    parts = path.split(".")
    module_name, name = ".".join(parts[:-1]), parts[-1]
    if len(parts) != 4 or any(p.startswith("_") for p in parts):
        raise UserError(
            f"{path} is not a torchtune model builder (builders are torchtune.models.<family>.<name>)", fix=FIX
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(
            f"torchtune has no model family {module_name} ({e})",
            fix="see torchtune.models (e.g. torchtune:llama3_2.llama3_2_1b)",
        ) from e
    builder = getattr(module, name, None)
    if builder is None:
        raise UserError(
            f"torchtune has no model builder {path}", fix="see torchtune.models (e.g. torchtune:llama3_2.llama3_2_1b)"
        )
    from torchtune.modules import TransformerDecoder

    returns = inspect.signature(builder).return_annotation if inspect.isfunction(builder) else None
    if name not in getattr(module, "__all__", ()) or not (
        isinstance(returns, type) and issubclass(returns, TransformerDecoder)
    ):
        raise UserError(f"{path} is not a torchtune model builder (it does not return a TransformerDecoder)", fix=FIX)
    return builder


def _hf_config(tt):
    """An HF ``LlamaConfig`` read off a built torchtune ``TransformerDecoder`` (Llama-style layers)."""
    from torch import nn
    from transformers import LlamaConfig

    layer = tt.layers[0]
    attn, mlp = layer.attn, layer.mlp
    missing = [
        n for n in ("q_proj", "k_proj", "v_proj", "output_proj", "pos_embeddings") if getattr(attn, n, None) is None
    ]
    missing += [n for n in ("w1", "w2", "w3") if getattr(mlp, n, None) is None]
    if missing or getattr(attn, "q_norm", None) is not None or not isinstance(layer.sa_scale, nn.Identity):
        raise UserError(
            f"torchtune model {type(tt).__name__} is not a Llama-style decoder (missing or extra: {missing or 'q_norm/scales'})",
            fix=FIX,
        )
    rope = attn.pos_embeddings
    rope_parameters = {"rope_type": "default", "rope_theta": float(rope.base)}
    if hasattr(rope, "scale_factor"):  # Llama3ScaledRoPE
        rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": float(rope.base),
            "factor": float(rope.scale_factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": int(rope.old_context_len),
        }
    tied = not isinstance(tt.output, nn.Module)  # torchtune's TiedLinear is a plain callable over the embedding
    return LlamaConfig(
        vocab_size=tt.tok_embeddings.num_embeddings,
        hidden_size=attn.embed_dim,
        intermediate_size=mlp.w1.out_features,
        num_hidden_layers=len(tt.layers),
        num_attention_heads=attn.num_heads,
        num_key_value_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        max_position_embeddings=tt.max_seq_len,
        rms_norm_eps=layer.sa_norm.eps,
        rope_parameters=rope_parameters,
        attention_bias=attn.q_proj.bias is not None,
        mlp_bias=mlp.w1.bias is not None,
        tie_word_embeddings=tied,
    )


def to_hf_llama(tt):
    """The torchtune model as an HF ``LlamaForCausalLM`` with the same weights; refuses one whose logits differ."""
    import torch
    from transformers import LlamaForCausalLM

    from qharness.upstream.torchtune import import_torchtune

    import_torchtune()
    from torchtune.models import convert_weights

    config = _hf_config(tt)
    try:
        sd = convert_weights.tune_to_hf(
            tt.state_dict(),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            dim=config.hidden_size,
            head_dim=config.head_dim,
        )
    except Exception as e:  # torchtune raises a bare Exception for keys it cannot map (e.g. Qwen2's q_proj.bias)
        raise UserError(
            f"torchtune model does not map onto HF Llama ({str(e).strip().splitlines()[0]})", fix=FIX
        ) from e
    hf = LlamaForCausalLM(config).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise UserError(
            f"torchtune model does not map onto HF Llama: missing {missing[:4]}, unexpected {unexpected[:4]}", fix=FIX
        )
    tokens = torch.randint(
        0, config.vocab_size, (1, min(16, config.max_position_embeddings)), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want, got = tt.eval()(tokens), hf(input_ids=tokens).logits
    diff = (want - got).abs().max().item()
    if not diff <= 1e-4 * max(1.0, want.abs().max().item()):
        raise UserError(f"torchtune model converted to HF Llama gives other logits (max |diff| {diff:.3g})", fix=FIX)
    return hf


def _tokenizer(spec_tokenizer: str | None, vocab_size: int):
    from transformers import AutoTokenizer

    from qharness.sources.text import embedded_corpus
    from qharness.sources.tokenizer import train_bpe_tokenizer

    if spec_tokenizer is None:
        return train_bpe_tokenizer(embedded_corpus(max_chars=500_000), min(vocab_size, 2048))
    try:
        tok = AutoTokenizer.from_pretrained(spec_tokenizer)
    except (OSError, ValueError) as e:
        raise UserError(
            f"could not load tokenizer {spec_tokenizer!r}: {str(e).splitlines()[0]}",
            fix="give an HF tokenizer directory",
        ) from e
    if len(tok) > vocab_size:
        raise UserError(
            f"tokenizer {spec_tokenizer} has {len(tok)} tokens, more than the model's vocab_size {vocab_size}"
        )
    return tok


def torchtune_dir(checkpoint: str) -> Path:
    """The cached HF directory of a ``torchtune:`` checkpoint, built and converted on first use."""
    import torch

    from qharness.sources.cache import cache_dir

    path, kwargs = parse_spec(checkpoint)
    ours = {k: kwargs.pop(k) for k in RESERVED if k in kwargs}
    key = json.dumps([path, kwargs, ours], sort_keys=True, default=str)
    out = cache_dir() / f"torchtune-{path.rsplit('.', 1)[-1]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    builder = resolve_builder(path)
    torch.manual_seed(int(ours.get("seed", 0)))
    try:
        tt = builder(**kwargs)
    except TypeError as e:
        raise UserError(f"torchtune builder {path}: {e}", fix=FIX) from e
    hf = to_hf_llama(tt)
    tok = _tokenizer(ours.get("tokenizer"), hf.config.vocab_size)
    hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id = (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    remove_stale_temps(out.parent)  # what a killed build (of any cached model) left behind
    tmp = temp_dir_for(out)
    shutil.rmtree(tmp, ignore_errors=True)
    hf.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "qharness_torchtune.json").write_text(
        json.dumps({"checkpoint": checkpoint, "builder": path, "kwargs": kwargs, **ours}, indent=2, default=str)
    )
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
