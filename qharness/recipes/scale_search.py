"""Weight scales chosen for the activations they meet (a recipe's ``quantizer: {rounding: weighted}``; PTQ).

Each group's scale is the one, among shrinks of its clip-nothing scale, that minimises the squared rounding error of
the group's weights weighted by the mean square of the inputs each weight multiplies on the calibration blocks
(llama.cpp's importance matrix, "imatrix"): a weight that meets large activations is rounded closer, at the cost of
weights that meet small ones. Weights stay rounded to the nearest level of their scale; only the scale moves, so the
program and its speed are the recipe's own.

On SmolLM2-135M (4-bit groups of 32, int8 activations, scored on tinyshakespeare windows) the weighted scales took
the perplexity increase from +26% to +17% with Python's documentation or the model's own text as calibration, to
+13% with Shakespeare's: calibrate on text like the deployment's. Unweighted (plain MSE) scales did worse than
clipping nothing (+31%).

Example::

    power = input_power(model, ["model.layers.0.mlp.down_proj"], blocks)   # {name: [in_features]}
    scales = search_scales(weight, power["model.layers.0.mlp.down_proj"], qmin=-8, qmax=7, group=32)
"""

from __future__ import annotations

import torch

from qharness.recipes.gptq import symmetric_scale

SHRINKS = tuple(1.0 - 0.02 * i for i in range(26)) + (1.02, 1.05)  # candidate scales, times clip-nothing's


def input_power(
    model: torch.nn.Module, names: list[str], blocks: torch.Tensor, batch: int = 4
) -> dict[str, torch.Tensor]:
    """The mean square of each input feature of the linears ``names`` over ``blocks`` ``[n, seq]`` (one pass of
    ``model``, left unchanged): ``{name: [in_features]}``."""
    return {name: power for name, (power, _) in input_statistics(model, names, blocks, batch).items()}


def input_statistics(
    model: torch.nn.Module, names: list[str], blocks: torch.Tensor, batch: int = 4
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The mean square and the largest absolute value of each input feature of the modules ``names`` over ``blocks``
    ``[n, seq]`` (one pass of ``model``, left unchanged): ``{name: ([in_features], [in_features])}``."""
    sums: dict[str, torch.Tensor] = {}
    peaks: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name in names:

        def hook(module, inputs, output, name=name):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            peak = x.abs().amax(0)
            peaks[name] = torch.maximum(peaks[name], peak) if name in peaks else peak
            counts[name] = counts.get(name, 0) + x.shape[0]

        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            for b in blocks.split(batch):
                model(input_ids=b.to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return {name: (sums[name] / counts[name], peaks[name]) for name in names}


def search_scales(
    weight: torch.Tensor,
    power: torch.Tensor,
    qmin: int,
    qmax: int,
    group: int,
    scale_dtype: torch.dtype | None = torch.bfloat16,
) -> torch.Tensor:
    """The scale ``[out, in/group]`` of each group of ``weight`` ``[out, in]`` that minimises ``sum power_j (w_j -
    q_j)^2`` among ``SHRINKS`` of the clip-nothing scale (``max(min/qmin, max/qmax)``) and, for each, the scale that
    fits its codes best (weighted least squares, then the codes rounded again: llama.cpp's ``make_qx_quants``); every
    candidate in ``scale_dtype`` as the kernel keeps it; ties keep the earlier (larger) candidate."""
    out, n = weight.shape
    w = weight.detach().float().reshape(out, n // group, group)
    imp = power.float().reshape(1, n // group, group)
    base = symmetric_scale(w.reshape(-1, group), qmin, qmax, no_clipping=True).reshape(out, n // group)

    def kept(s):
        return s.to(scale_dtype).float() if scale_dtype is not None else s

    def codes_and_error(s):
        codes = torch.clamp(torch.round(w / s[..., None]), qmin, qmax)
        return codes, (imp * (w - codes * s[..., None]) ** 2).sum(-1)

    best_err, best = None, None
    for shrink in SHRINKS:
        s = kept(base * shrink)
        codes, err = codes_and_error(s)
        fit_den = (imp * codes * codes).sum(-1)
        fit = kept(torch.where(fit_den > 0, (imp * w * codes).sum(-1) / fit_den.clamp(min=1e-30), s))
        fit = torch.where(fit > 0, fit, s)
        _, fit_err = codes_and_error(fit)
        for cand, cand_err in ((s, err), (fit, fit_err)):
            if best is None:
                best_err, best = cand_err, cand
                continue
            better = cand_err < best_err
            best_err, best = torch.where(better, cand_err, best_err), torch.where(better, cand, best)
    return best


def round_to(weight: torch.Tensor, scales: torch.Tensor, qmin: int, qmax: int, group: int) -> torch.Tensor:
    """``weight`` rounded to the nearest level of its groups' ``scales`` (the dequantized values)."""
    out, n = weight.shape
    w = weight.detach().float().reshape(out, n // group, group)
    q = torch.clamp(torch.round(w / scales[..., None]), qmin, qmax) * scales[..., None]
    return q.reshape(out, n).to(weight.dtype)
