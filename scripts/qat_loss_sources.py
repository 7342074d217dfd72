"""Where a trained QAT program's remaining loss comes from: its fake-quant graph, one rounding turned off at a time.

``ptq_loss_sources.py`` asks this of a PTQ program (eager, rounding one source at a time); this asks it of a QAT
run's own trained graph, read back from its checkpoint (``last.ckpt``): every fake quantizer in it (torchao's QAT
modules) is one of the int8 activations (per token, each linear's input), a 4-bit weight, an 8-bit weight (the
zero-point offsets, the tied ``lm_head``) or the 8-bit table, and each row turns one kind off (``enabled = False``:
that tensor passes in float) and scores the rest on llama-perplexity's protocol (the text's
last ``--tail``, windows of 256 tokens, the first token BOS where the vocabulary adds one, the second half scored) as
``bench_llamacpp.py`` does, against the FP model the run distilled from. The last column: each row's perplexity over
the program's (every rounding on), a 95% paired interval over windows. The
graph's rounding is the program's, less the kernels' float rounding (the parity gate's subject: ``.pte`` vs trained
fake-quant).

Example (minutes per row on 2 cores for SmolLM2-135M)::

    .venv/bin/python scripts/qat_loss_sources.py runs/zp_qat_480_lr2e4/checkpoints/last.ckpt --windows 140
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llamacpp import TEXT, gguf_bos, paired  # noqa: E402 (the same protocol and intervals)

ACT, W4, W8, TABLE = "activations", "4-bit weights", "8-bit weights", "table"


def load_trained(ckpt_path: Path):
    """The QAT run's ``QuantLM`` rebuilt as its checkpoint was trained (model, recipe, shape) with the trained state."""
    from types import SimpleNamespace

    from qharness.schema.model import ModelConfig
    from qharness.training.checkpoints import load_checkpoint
    from qharness.training.module import QuantLM

    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)  # its model config and data layout
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    lm = QuantLM(**{k: v for k, v in ckpt["hyper_parameters"].items() if k in names})
    data = ckpt.get("datamodule_hyper_parameters") or {}
    layout = SimpleNamespace(batch_size=int(data.get("batch_size", 4)), seq_len=int(data.get("seq_len", 256)))
    load_checkpoint(lm, layout, str(ckpt_path))  # what resuming fit does: build, then the trained state
    lm.to_eval()
    return lm, lm.steps_trained


def fake_quants(graph: torch.nn.Module) -> list[tuple[str, str, torch.nn.Module]]:
    """``(kind, layer, fake quantizer)`` for every fake quantizer of a trained graph (torchao's QAT modules: each
    linear's ``activation_fake_quantizer`` and ``weight_fake_quantizer``, the table's ``weight_fake_quantizer``)."""
    out = []
    for name, fq in graph.named_modules():
        layer, _, what = name.rpartition(".")
        if what == "activation_fake_quantizer":
            out.append((ACT, layer, fq))
        elif what == "weight_fake_quantizer" and layer.endswith("embed_tokens"):
            out.append((TABLE, layer, fq))
        elif what == "weight_fake_quantizer":
            out.append((W4 if fq.config.dtype == torch.int4 else W8, layer, fq))
    if not out:
        raise SystemExit("no fake quantizer in the checkpoint's graph: pass a QAT run of a torchao-QAT recipe")
    return out


def part(weight: str) -> str:
    """The layer family of a weight name: lm_head (the tied table), down/up/gate, q/k/v, o."""
    for key in ("lm_head", "embed_tokens", "down_proj", "gate_proj", "up_proj", "o_proj", "q_proj", "k_proj", "v_proj"):
        if key in weight:
            return "lm_head" if key == "embed_tokens" else key
    return "?"


ROWS = {  # name: which fake-quants pass in float: (kind, parts or None for all)
    "the QAT program (every rounding, as trained)": [],
    "int8 activations off (every linear's input in float)": [(ACT, None)],
    "  only the lm_head's input in float": [(ACT, {"lm_head"})],
    "  only the down projections' inputs in float": [(ACT, {"down_proj"})],
    "  only gate/up's inputs in float": [(ACT, {"gate_proj", "up_proj"})],
    "  only q/k/v's and o's inputs in float": [(ACT, {"q_proj", "k_proj", "v_proj", "o_proj"})],
    "4-bit weights off (the trained weights in float)": [(W4, None)],
    "8-bit weights off (the zero-point offsets, the tied lm_head)": [(W8, None)],
    "the 8-bit table off (the lookup)": [(TABLE, None)],
    "every rounding off (the trained weights, float)": [(ACT, None), (W4, None), (W8, None), (TABLE, None)],
}


def set_row(fqs, off) -> int:
    """Fake quantization on everywhere but where ``off`` says; returns how many fake quantizers pass in float."""
    n = 0
    for kind, layer, fq in fqs:
        float_here = any(k == kind and (parts is None or part(layer) in parts) for k, parts in off)
        fq.enabled = not float_here
        n += float_here
    return n


@torch.no_grad()
def window_nll(forward, windows: torch.Tensor, batch: int) -> np.ndarray:
    """Per-window mean NLL of the second half (positions ctx/2 .. ctx-1 predicted)."""
    half = windows.shape[1] // 2
    out = []
    for chunk in windows.split(batch):
        n = len(chunk)
        if n < batch:  # the graph's static batch: pad with the first window, drop its rows
            chunk = torch.cat([chunk, chunk[:1].expand(batch - n, -1)])
        logits = forward(chunk)[:n, half - 1 : -1].double()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), chunk[:n, half:], reduction="none")
        out.append(nll.mean(1).numpy())
    return np.concatenate(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="a QAT run's last.ckpt")
    p.add_argument("--text", type=Path, default=TEXT, help="text whose last --tail fraction is scored")
    p.add_argument("--tail", type=float, default=0.1)
    p.add_argument("--windows", type=int, default=None, help="the first N windows (default: every window)")
    p.add_argument("--rows", nargs="+", default=None, help="row numbers to score (default: every row)")
    args = p.parse_args()
    if not args.checkpoint.is_file():
        raise SystemExit(f"checkpoint {args.checkpoint} not found: pass a QAT run's checkpoints/last.ckpt")
    torch.manual_seed(0)
    lm, step = load_trained(args.checkpoint)
    graph = lm.graph
    fp_model, tokenizer = lm.load_fp()
    fp_model.eval()
    batch, ctx = lm._shape
    raw = args.text.read_text()
    tokens = tokenizer(raw[int(len(raw) * (1 - args.tail)) :], add_special_tokens=False)["input_ids"]
    n = len(tokens) // ctx if args.windows is None else min(args.windows, len(tokens) // ctx)
    windows = torch.tensor(tokens[: n * ctx]).reshape(n, ctx)
    gguf = Path(lm.hparams.checkpoint)
    bos = gguf_bos(gguf) if gguf.suffix == ".gguf" else tokenizer.bos_token_id
    if bos is not None:
        windows[:, 0] = bos
    fqs = fake_quants(graph)
    counts = {k: sum(1 for kind, _, _ in fqs if kind == k) for k in (ACT, W4, W8, TABLE)}
    print(
        f"{args.checkpoint} (step {step}): fake quantizers {counts}, of unknown layers: "
        f"{sum(1 for _, layer, _ in fqs if part(layer) == '?')}"
    )
    t0 = time.perf_counter()
    ref = window_nll(lambda x: fp_model(x).logits, windows, batch)
    print(f"FP: ppl {math.exp(ref.mean()):.2f} on {n} windows of {ctx} ({time.perf_counter() - t0:.0f} s)", flush=True)
    names = list(ROWS)
    chosen = names if args.rows is None else [names[int(i)] for i in args.rows]
    nll, program = {}, None
    for name in chosen:
        off = set_row(fqs, ROWS[name])
        t0 = time.perf_counter()
        nll[name] = window_nll(graph, windows, batch)
        if not ROWS[name]:
            program = nll[name]
        print(f"  {name}: {off} fake-quants in float, {time.perf_counter() - t0:.0f} s", flush=True)
    set_row(fqs, [])
    print("\n| row | ppl | vs FP [95%] | ppl / the program's [95%, paired] |\n|---|---|---|---|")
    for name, v in nll.items():
        delta = v - ref
        lo, hi = paired(delta)
        cell = "-"
        if program is not None and v is not program:  # perplexity over the program's, paired over windows
            diff = v - program
            rlo, rhi = paired(diff)
            cell = f"{math.exp(diff.mean()):.3f} [{math.exp(rlo):.3f}, {math.exp(rhi):.3f}]"
        inc = f"{math.expm1(delta.mean()):+.2%} [{math.expm1(lo):+.2%}, {math.expm1(hi):+.2%}]"
        print(f"| {name.strip()} | {math.exp(v.mean()):.2f} | {inc} | {cell} |")


if __name__ == "__main__":
    main()
