"""Workaround: XNNPACK's wide 4-bit matmuls compute an all-zero activation row as ~1e-5, not 0.

XNNPACK quantizes a row of equal values (an all-zero row) with scale 1 and zero point 127
(``xnn_f32_qd8_asymmetric_quantization_params``), where a row with a range gets a scale of about its range / 255. Its
4-bit kernels with dynamically quantized 8-bit activations (``qd8-f32-qb4w``: groups, and torchao's per-channel
4-bit weights, ``xnnpack_bf16_scales.py``) then correct for that zero point in float, and for such a row the
correction does not cancel to 0. One 8da4w linear (groups of 32) lowered alone by ExecuTorch 1.5.1 gives an all-zero
input row outputs of 0 up to 512 inputs wide, 3.05e-5 at 1024 and 6.1e-5 at 2048 (per-channel 4-bit: 1.5e-5 at
2048; 8-bit weights: 0 at every width). The converted graph computes exact zeros. Which kernel runs depends on the
CPU: the AVX-512 ones do this (Intel Xeon with AVX-512 VNNI and AMX, and the machines before it); the AVX2 one (AMD
EPYC Zen 2, no AVX-512) computes the row as 0, and the workaround changes nothing there that matters.

Where it matters: a token whose embedding row is all zero (the padding row transformers' initialisation zeroes; with
a config's ``pad_token_id`` of 0 and a GPT-2 tokenizer that is ``!``) keeps the hidden state all zero through the
model, and the first RMSNorm after such a matmul scales the 1e-5 up to unit size: the ``.pte``'s logits there, and
through the KV cache or a recurrent state after it, are not the converted model's. A tiny Granite-4.0-H with its
default 1024-wide shared MLP missed the parity gate at 85x its rounding noise, all of it from its token 0. Trained
models have such rows too (SmolLM2-135M-Instruct's GGUF: ``<|im_end|>``), though there attention fills the hidden
state from the tokens before, so only a prompt that starts with one meets it.

The workaround, for the torchao recipes (``xnnpack_8da4w`` and its kin): in the model being deployed (a copy where
the run scores its FP model later), each all-zero row of an embedding table holds +-2**-40 (alternating) instead.
That is no row of equal values, so XNNPACK quantizes it with its own range and computes it as the converted graph
does (torchao's per-token scales go down to 1.2e-38); and it is far below the table's other values (after an RMSNorm
~1e-9; the logits at such a token stay within ~1e-6 of the uniform ones a zero row gives). Not for the PT2E recipes:
their converted graph quantizes activations per token with scales of at least 2**-23 (torch's
``choose_qparams_per_token_asymmetric``), which rounds such a row to zeros where XNNPACK keeps its values (a tiny
Gemma-2 with ``xnnpack_int8_dynamic`` then missed the gate at KL 0.067), and XNNPACK's 8-bit weights compute an
all-zero row as 0.
No upstream issue filed. Test that tells when to retire it:
tests/test_upstream_fixes.py::test_upstream_xnnpack_still_computes_a_wide_all_zero_row_as_nonzero.
Retire: when it fails, delete this module and its call in ``deploy/lower.py``.

Example::

    rows = nudge_zero_rows(model)   # {"model.embed_tokens": [0]}: the token ids whose rows were all zero
"""

from __future__ import annotations

import torch

TINY = 2.0**-40  # ~9.1e-13: a gated MLP multiplies two activations made of it (~1e-10 each after an RMSNorm), and
# 2**-100 rounded that product to 0 (under float32's 1.2e-38): the all-zero row again, one matmul later


def nudge_zero_rows(model: torch.nn.Module) -> dict[str, list[int]]:
    """Give every all-zero row of ``model``'s embedding tables (in place) the values ``+-TINY``, alternating;
    returns ``{table name: [row ids]}`` of the rows changed (empty: none). A table tied to an output head changes
    with it: that row's logit moves from 0 by ~1e-11."""
    changed, seen = {}, set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Embedding) or id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        weight = module.weight
        zero = (weight.detach() == 0).all(dim=1).nonzero().flatten()
        if zero.numel() == 0:
            continue
        signs = torch.ones(weight.shape[1], dtype=weight.dtype, device=weight.device)
        signs[1::2] = -1
        with torch.no_grad():
            weight[zero] = signs * TINY
        changed[name] = zero.tolist()
    return changed
