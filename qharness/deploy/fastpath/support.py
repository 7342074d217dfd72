"""Whether a model can take the fast path: static checks of its config, then an eager run of ``FastDecoder``
against the model's own logits.
"""

from __future__ import annotations

import torch

from qharness.deploy.fastpath.decoder import FastDecoder
from qharness.deploy.fastpath.rope import STATIC_ROPE, rope_types
from qharness.errors import UserError

# the layer types the fast path's cache holds: attention (a KV cache), a convolution state (LFM2), a recurrent state
# (linear attention: gated DeltaNet, Mamba2), or a recurrent state beside a KV cache (hybrid: Falcon-H1, Zamba2)
LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "conv", "linear_attention", "hybrid"})


def unsupported_reason(model, max_seq_len: int) -> str | None:
    """Why ``model`` cannot take the fast path (``None``: it can), e.g.
    ``"GPT2LMHeadModel: its attention does not use transformers' AttentionInterface"``.

    Static checks first; then a short eager run of ``FastDecoder`` (prefill, a second chunk, one decode step)
    must give the model's own logits: that is what shows a family's attention and cache go through the interfaces.
    """
    arch = type(model).__name__
    config = model.config.get_text_config()
    if getattr(config, "is_encoder_decoder", False):
        return f"{arch}: an encoder-decoder"
    if not model._can_set_attn_implementation():
        return f"{arch}: its attention does not use transformers' AttentionInterface"
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not types <= LAYER_TYPES:
        return f"{arch}: layer types {sorted(types)} (fast path: {', '.join(sorted(LAYER_TYPES))})"
    if getattr(config, "num_kv_shared_layers", 0):
        return f"{arch}: layers sharing another layer's KV cache are not implemented"
    dynamic = rope_types(config) - STATIC_ROPE
    if dynamic:
        return f"{arch}: rotary type {sorted(dynamic)[0]!r} depends on the sequence length (fast path: {', '.join(sorted(STATIC_ROPE))})"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return f"{arch}: pretraining_tp={config.pretraining_tp} is not implemented"
    return _eager_mismatch(model, max_seq_len)


def _eager_mismatch(model, max_seq_len: int) -> str | None:
    """Run ``FastDecoder`` eagerly on a few tokens against the model's own forward; the reason if they differ."""
    arch = type(model).__name__
    n = min(6, max_seq_len)
    x = torch.randint(0, model.config.get_text_config().vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            ref = model(input_ids=x, use_cache=False).logits[0].float()
    except Exception as e:  # the model fails on its own: its config, not the fast path (nor any export) is at fault
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise UserError(
            f"{arch}: the model's own forward fails on {n} tokens ({type(e).__name__}: {first})",
            fix="check its config (e.g. num_experts_per_tok against the number of experts, head sizes against "
            "hidden_size): transformers cannot run it as it is",
        ) from e
    try:
        decoder = FastDecoder(model, max_seq_len, all_logits=True)
        with torch.no_grad():
            cut = max(1, n - 3)
            got = [decoder(x[:, :cut], torch.tensor([0]))[0]]
            if n - cut > 1:
                got.append(decoder(x[:, cut : n - 1], torch.tensor([cut]))[0])
            got.append(decoder(x[:, n - 1 :], torch.tensor([n - 1]))[0])
            got = torch.cat(got).float()
    except Exception as e:  # the model's code refused our cache or attention function
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        return f"{arch}: its forward fails with the fast path's cache and attention ({type(e).__name__}: {first})"
    err = (got - ref).abs().max().item()
    if not err <= 1e-3 * max(ref.abs().max().item(), 1.0):
        return f"{arch}: the fast path's logits differ from the model's own (max abs difference {err:.3g})"
    return None
