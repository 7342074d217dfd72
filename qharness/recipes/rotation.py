"""Rotations folded into the weights (QuaRot's / SpinQuant's R1; a recipe's ``rotation: hadamard``).

The residual stream of a pre-norm decoder is rotated by an orthogonal ``Q``: a random Hadamard matrix (Sylvester's
construction times random signs, scaled) when the hidden size is a power of two, else a random orthogonal matrix,
both seeded. Outlier channels are spread over all channels, so int4 weight groups and int8 per-token activations
lose less, while the model computes the same function: nothing runs at inference that did not before, and the
program's shape is unchanged (the fast path still applies). Folding, rows as vectors (``y = x Wᵀ``):

- every RMSNorm's weight ``g`` goes into the linears it feeds (``W <- W diag(g)``) and becomes 1, since
  ``rmsnorm(x Q) = rmsnorm(x) Q`` only without it;
- the embedding ``E <- E Q``; linears that read the stream (q/k/v, gate/up, ``lm_head``) ``W <- W Q``; linears that
  write to it (o, down) ``W <- Qᵀ W`` (and their bias ``b <- b Q``);
- a tied ``lm_head`` gets a weight of its own (the final norm's ``g`` folds into it, not into the embedding).

It applies where the decoder is exactly that (Llama, Mistral, Qwen2, Qwen3, ... : ``input_layernorm`` and
``post_attention_layernorm`` before attention and MLP, ``model.norm`` before the head, no other norm on the stream);
``rotate`` checks the rotated model's logits against the original's on random tokens and refuses (``UserError``) a
model it does not fit, before anything is trained or exported.

Example::

    model = rotate(model, seed=0)    # in place; same logits (float rounding), rotated weights
"""

from __future__ import annotations

import torch

from qharness.errors import UserError
from qharness.recipes.registry import ROTATIONS
from qharness.sources.models import put_weights, tied

STREAM_READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
MLP_READERS = ("mlp.gate_proj", "mlp.up_proj")
WRITERS = ("self_attn.o_proj", "mlp.down_proj")
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")
NEEDED = {*LAYER_NORMS, *STREAM_READERS, *MLP_READERS, *WRITERS}  # a decoder layer's modules that the folding changes
OFF_STREAM_NORMS = {"self_attn.q_norm", "self_attn.k_norm"}  # per-head norms after q/k_proj: not on the stream


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """``[n, n]`` float64: a random Hadamard matrix when ``n`` is a power of two, else a random orthogonal one."""
    g = torch.Generator().manual_seed(seed)
    if n & (n - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
        return h * signs / n**0.5
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def _layers(model):
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None or not hasattr(body, "embed_tokens") or not hasattr(body, "norm"):
        return None
    for layer in layers:
        names = {n for n, _ in layer.named_modules()}
        norms = {n for n, m in layer.named_modules() if "norm" in type(m).__name__.lower()}
        if not NEEDED <= names or not norms <= {*LAYER_NORMS, *OFF_STREAM_NORMS}:
            return None
    return body, layers


def _fold_norm(norm, linears) -> None:
    g = norm.weight.detach().to(torch.float64)
    for lin in linears:
        lin.weight.data = (lin.weight.detach().to(torch.float64) * g).to(lin.weight.dtype)
    norm.weight.data.fill_(1.0)


def _read(lin, q):  # the module reads the rotated stream (a linear's input, the embedding's rows): W <- W Q
    lin.weight.data = (lin.weight.detach().to(torch.float64) @ q).to(lin.weight.dtype)


def _write(lin, q):  # the linear writes to the rotated stream: W <- Qᵀ W, b <- b Q
    lin.weight.data = (q.T @ lin.weight.detach().to(torch.float64)).to(lin.weight.dtype)
    if lin.bias is not None:
        lin.bias.data = (lin.bias.detach().to(torch.float64) @ q).to(lin.bias.dtype)


@torch.no_grad()
def rotate(model, rotation: str = "hadamard", seed: int = 0, check_tokens: int = 32):
    """Fold a ``rotation`` of the residual stream into ``model``'s weights (in place; returns it). Raises
    ``UserError`` when the model's layout does not fold exactly (checked on its logits for random tokens)."""
    if rotation not in ROTATIONS:
        raise UserError(f"rotation {rotation!r} is unknown", fix=f"use {' or '.join(ROTATIONS)} (or null)")
    found = _layers(model)
    kind = type(model).__name__
    if found is None:
        raise UserError(
            f"rotation: {kind} is not a pre-norm decoder whose norms fold (input_layernorm, post_attention_layernorm, "
            "model.norm and no other norm on the residual stream)",
            fix="use a recipe without rotation for this model",
        )
    body, layers = found
    head = model.get_output_embeddings()
    vocab = model.config.get_text_config().vocab_size
    tokens = torch.randint(0, vocab, (1, check_tokens), generator=torch.Generator().manual_seed(seed))
    device = next(model.parameters()).device
    before = model(input_ids=tokens.to(device)).logits.double()
    if head.weight is body.embed_tokens.weight:  # untie: the head folds the final norm, the embedding does not
        put_weights(model, {name: head.weight for name in tied(model) if name.endswith("lm_head.weight")})
    q = random_orthogonal(body.embed_tokens.weight.shape[1], seed).to(device)
    for layer in layers:
        attn_in = [layer.get_submodule(n) for n in STREAM_READERS]
        mlp_in = [layer.get_submodule(n) for n in MLP_READERS]
        _fold_norm(layer.input_layernorm, attn_in)
        _fold_norm(layer.post_attention_layernorm, mlp_in)
        for lin in attn_in + mlp_in:
            _read(lin, q)
        for name in WRITERS:
            _write(layer.get_submodule(name), q)
    _fold_norm(body.norm, [head])
    _read(head, q)
    _read(body.embed_tokens, q)  # its rows enter the stream rotated: E <- E Q
    after = model(input_ids=tokens.to(device)).logits.double()
    err = ((after - before).abs().max() / before.abs().max()).item()
    if not err < 1e-4:
        raise UserError(
            f"rotation: {kind}'s logits changed by {err:.2e} (relative) when the rotation was folded in: its layers "
            "do not fold exactly",
            fix="use a recipe without rotation for this model",
        )
    return model
