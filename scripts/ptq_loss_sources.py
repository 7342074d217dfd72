"""Where a real model's 4-bit PTQ loss comes from: eager fake quantization, one source at a time.

Each row quantizes the float model one way (weights rounded, activations rounded to int8 per token as XNNPACK's 8da
GEMMs do, the tied table at int8 per row as ``xnnpack_8da4w_tied8`` stores it) and scores the last 10% of a text in
windows of 256 tokens, the second half of each scored (llama-perplexity's protocol, as ``bench_llamacpp.py``): the
perplexity increase over the float model, by what is rounded. The weights come from qharness's own functions
(``recipes/zero_points.split``, ``recipes/scale_search.search_scales``), so a row is what those settings deploy, less
the kernels' own float rounding (the parity gate's subject). Minutes on 2 cores for SmolLM2-135M.

Example::

    .venv/bin/python scripts/ptq_loss_sources.py --model ~/.cache/qharness/gguf-<hash> \\
        --text ../shared/data/tinyshakespeare/input.txt --windows 16
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from qharness.recipes.gptq import symmetric_scale
from qharness.recipes.scale_search import input_power, round_to, search_scales
from qharness.recipes.smoothing import gated_mlps, smoothed, smoothing_factors
from qharness.recipes.zero_points import ALPHA, split

GROUP = 32


def act_int8(x: torch.Tensor) -> torch.Tensor:
    """int8 per token, asymmetric (torchao's 8da activations)."""
    low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((high - low) / 255).clamp(min=1e-9)
    zero = (-128 - torch.round(low / scale)).clamp(-128, 127)
    return (torch.clamp(torch.round(x / scale) + zero, -128, 127) - zero) * scale


class Fake(torch.nn.Module):
    """``y = W x`` with ``W`` already rounded; ``acts``: the input rounded to int8 per token first. With ``offsets``
    (a zero-point layer): ``+ offsets @ (ALPHA * group means)``, the means rounded with the input as the program's
    second GEMM rounds them."""

    def __init__(self, weight, acts=True, offsets=None):
        super().__init__()
        self.weight, self.acts, self.offsets = weight, acts, offsets

    def forward(self, x):
        xq = act_int8(x) if self.acts else x
        y = torch.nn.functional.linear(xq, self.weight)
        if self.offsets is not None:
            means = x.reshape(*x.shape[:-1], -1, GROUP).mean(-1) * ALPHA
            y = y + torch.nn.functional.linear(act_int8(means) if self.acts else means, self.offsets)
        return y


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """int8 per row with the clip-nothing scale (the tied table and its lm_head)."""
    scale = symmetric_scale(w, -128, 127, no_clipping=True)[:, None]
    return torch.clamp(torch.round(w / scale), -128, 127) * scale


def clip_nothing(w: torch.Tensor) -> torch.Tensor:
    """The clip-nothing 4-bit scale of each group of ``w``, in bf16 as XNNPACK keeps it."""
    scale = symmetric_scale(w.reshape(-1, GROUP), -8, 7, no_clipping=True).reshape(w.shape[0], -1)
    return scale.to(torch.bfloat16).float()


def quantize(model, weights: str, acts: bool | tuple[str, ...], zero: tuple[str, ...], power: dict | None):
    """``weights``: fp, nearest (clip-nothing scales), mse (unweighted scale search), weighted; ``acts``: int8
    activations everywhere (True), nowhere, or for the linears named (suffixes, ``lm_head`` among them); ``zero``:
    layer suffixes whose groups take zero points."""
    rounds = (lambda n: acts) if isinstance(acts, bool) else (lambda n: n in acts)  # noqa: E731
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, torch.nn.Linear) or child_name == "lm_head":
                continue
            w = child.weight.detach().float()
            if child_name in zero:
                main, _, offsets = split(w, GROUP)
                setattr(module, child_name, Fake(main, rounds(child_name), offsets))
                continue
            if weights == "fp":
                q = w
            elif weights == "nearest":
                q = round_to(w, clip_nothing(w), -8, 7, GROUP)
            else:
                imp = power[full] if weights == "weighted" else torch.ones(w.shape[1])
                q = round_to(w, search_scales(w, imp, -8, 7, GROUP), -8, 7, GROUP)
            setattr(module, child_name, Fake(q, rounds(child_name)))
    table = int8_rows(model.get_input_embeddings().weight.detach().float())
    model.get_input_embeddings().weight.data = table
    model.lm_head = Fake(table, rounds("lm_head"))
    return model


def smooth(model, alpha: float, blocks: torch.Tensor):
    """``model`` with its MLPs' ``down_proj`` inputs smoothed as ``quantizer: {smoothing: alpha}`` smooths them."""
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    mlps = gated_mlps(model, names)
    for mlp, s in smoothing_factors(model, mlps, blocks, alpha, GROUP).items():
        m = model.get_submodule(mlp)
        m.up_proj.weight.data, m.down_proj.weight.data = smoothed(m.up_proj.weight, m.down_proj.weight, s)
    return model


@torch.no_grad()
def window_nll(model, windows: torch.Tensor) -> torch.Tensor:
    half = windows.shape[1] // 2
    out = []
    for batch in windows.split(4):
        logits = model(batch).logits[:, half - 1 : -1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, half:], reduction="none")
        out.append(nll.mean(1))
    return torch.cat(out)


ZP_KVUD = ("k_proj", "v_proj", "up_proj", "down_proj")
ROWS = {  # name: (weights, activations int8, zero-point layers[, smoothing])
    "int8 activations + int8 table, float linears": ("fp", True, ()),
    "  int8 table, int8 activations of the lm_head only": ("fp", ("lm_head",), ()),
    "  int8 table, int8 activations of the down projections only": ("fp", ("down_proj",), ()),
    "4-bit weights (clip nothing), float activations": ("nearest", False, ()),
    "4-bit weights (clip nothing) + int8 activations (xnnpack_8da4w_tied8)": ("nearest", True, ()),
    "  scales by unweighted error": ("mse", True, ()),
    "  scales weighted by the inputs' power (rounding: weighted)": ("weighted", True, ()),
    "  zero points on every linear": (
        "nearest",
        True,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    ),
    "  zero points on v/up/down, weighted elsewhere": (
        "weighted",
        True,
        ("v_proj", "up_proj", "down_proj"),
    ),
    "  zero points on k/v/up/down, weighted elsewhere": ("weighted", True, ZP_KVUD),
    "  the same, the MLPs' inputs smoothed (smoothing: 0.5, xnnpack_8da4w_zp)": ("weighted", True, ZP_KVUD, 0.5),
}


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a float HF model directory (qharness caches a GGUF's as one)")
    p.add_argument("--text", required=True, help="text whose last 10%% is scored")
    p.add_argument("--calibration", help="text for the weighted scales (default: the text's first 90%%)")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--calibration-blocks", type=int, default=8)
    args = p.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    text = open(args.text, encoding="utf-8").read()
    ids = tok(text[int(len(text) * 0.9) :], return_tensors="pt").input_ids[0]
    windows = ids[: args.windows * 256].view(args.windows, 256)
    cal_text = open(args.calibration, encoding="utf-8").read() if args.calibration else text[: int(len(text) * 0.9)]
    cal = tok(cal_text[:400_000], return_tensors="pt").input_ids[0][: args.calibration_blocks * 256]
    cal = cal.view(-1, 256)

    def load():
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    fp = load()
    base = window_nll(fp, windows)
    names = [n for n, m in fp.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    power = input_power(fp, names, cal)
    print(f"float: ppl {math.exp(base.mean()):.2f} on {args.windows} windows of 256 (second half scored)")
    print("| what is rounded | ppl | vs float [95%, paired bootstrap over windows] |\n|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for label, (weights, acts, zero, *smoothing) in ROWS.items():
        t = time.perf_counter()
        model, row_power = load(), power
        if smoothing:  # the smoothed model's inputs, for its weighted scales
            model = smooth(model, smoothing[0], cal)
            row_power = input_power(model, names, cal)
        nll = window_nll(quantize(model, weights, acts, zero, row_power), windows)
        diff = nll - base
        boot = diff[torch.randint(0, len(diff), (2000, len(diff)), generator=g)].mean(1)
        lo, hi = (math.expm1(v) * 100 for v in torch.quantile(boot, torch.tensor([0.025, 0.975])).tolist())
        print(
            f"| {label.strip()} | {math.exp(nll.mean()):.2f} | {math.expm1(diff.mean()) * 100:+.1f}% "
            f"[{lo:+.1f}, {hi:+.1f}] |  ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
