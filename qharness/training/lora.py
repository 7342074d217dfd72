"""LoRA-QAT (``model.lora``): low-rank adapters on frozen base weights, fake-quantized *merged*.

A target linear layer keeps its own ``weight`` (frozen) and gains two parameters, ``lora_a [r, in]`` and
``lora_b [out, r]``; its forward becomes ``linear(fq_act(x), fq_w(W + s * lora_b @ lora_a), bias)`` with
``s = alpha / r`` (``fq_*``: the recipe's fake quantizers where it has them). The adapters stay inside the module
whose weight they change, so parameter names are the HF model's plus ``.lora_a`` / ``.lora_b`` in every form:

- PT2E recipes: adapters are added to the HF model's ``nn.Linear`` layers *before* ``torch.export``; the exported
  weight input of each ``aten.linear`` is ``add(W, mul(mm(B, A), s))`` and ``prepare_qat_pt2e`` puts the recipe's
  weight fake-quant on that merged value (``check_merged_fake_quant`` verifies it).
- torchao source recipes: adapters are added *after* ``QATConfig(step="prepare")``, to its ``FakeQuantizedLinear``
  modules, whose weight fake quantizer then sees the merged weight.

Deployment merges (``merge``: the same expression, so the deployed weight equals the trained one bit for bit) and
quantizes the merged weights with the recipe as for full QAT: the same program shape.

Example::

    add_adapters(hf_model, LoRA(rank=8, alpha=16))      # ["model.layers.0.self_attn.q_proj", ...]
    graph = export_and_prepare(hf_model)
    freeze_base(graph)                                  # only lora_a / lora_b (and learned scales) train
    weights = merge(dict(graph.named_parameters()), 2.0)   # {..."q_proj.weight": W + 2 * B @ A}, no lora_* keys
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn.functional as F

from qharness.errors import UserError
from qharness.schema.model import LORA_TARGETS, LoRA
from qharness.sources.models import tied

A, B = "lora_a", "lora_b"


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A``: the one expression training (traced or eager) and deployment both compute."""
    return weight + scale * (lora_b @ lora_a)


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    """A target linear's forward (bound per instance): fake quantizers, if the module has torchao's, as
    ``FakeQuantizedLinear.forward`` applies them, on the merged weight."""
    w = merged_weight(self.weight, self.lora_a, self.lora_b, self.lora_scale)
    act_fq = getattr(self, "activation_fake_quantizer", None)
    weight_fq = getattr(self, "weight_fake_quantizer", None)
    if act_fq is not None:
        x = act_fq(x)
    if weight_fq is not None:
        w = weight_fq(w)
    return F.linear(x, w, self.bias)


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name.rpartition(".")[2], pattern)


def targets(model: torch.nn.Module, lora: LoRA) -> list[tuple[str, torch.nn.Linear]]:
    """``(name, module)`` of the linear layers of ``model`` (an HF model, names as in it) that ``lora.targets`` name.

    A given pattern that matches no linear layer, no match at all, or a target whose weight is tied to another
    parameter (e.g. an output head sharing the embedding table) is a ``UserError``."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    found = [(n, m) for n, m in linears if any(_matches(n, p) for p in lora.targets)]
    names = sorted({n.rpartition(".")[2] for n, _ in linears})
    if lora.targets != LORA_TARGETS:
        unmatched = [p for p in lora.targets if not any(_matches(n, p) for n, _ in linears)]
        if unmatched:
            raise UserError(
                f"model.lora.targets {unmatched} match no linear layer of {type(model).__name__}",
                fix=f"name some of its linear layers: {', '.join(names)} (or glob patterns of their full names)",
            )
    if not found:
        raise UserError(
            f"model.lora.targets {list(lora.targets)} match no linear layer of {type(model).__name__}",
            fix=f"set model.lora.targets to some of: {', '.join(names)}",
        )
    shared = tied(model)
    tied_targets = [n for n, _ in found if f"{n}.weight" in shared]
    if tied_targets:
        raise UserError(
            f"model.lora.targets name {tied_targets}, whose weight is tied to another parameter (merging an adapter would "
            "change both)",
            fix="leave it out of model.lora.targets",
        )
    return found


def add_adapters(model: torch.nn.Module, lora: LoRA, seed: int = 0) -> list[str]:
    """Give every target linear of ``model`` its adapters (in place); returns their names.

    ``A`` is Kaiming-uniform from a generator seeded with ``seed`` (the same adapters on every rank and every
    rebuild), ``B`` zeros: the merged weight equals ``W`` exactly until the first step."""
    found = targets(model, lora)
    gen = torch.Generator().manual_seed(seed)
    for _, m in found:
        w = m.weight
        a = torch.empty(lora.rank, m.in_features, dtype=w.dtype, device="cpu")  # the generator's device
        bound = 1.0 / math.sqrt(m.in_features)  # kaiming_uniform_(a=sqrt(5)), nn.Linear's (and torchtune's) init
        a.uniform_(-bound, bound, generator=gen)
        m.register_parameter(A, torch.nn.Parameter(a.to(w.device)))
        m.register_parameter(
            B, torch.nn.Parameter(torch.zeros(m.out_features, lora.rank, dtype=w.dtype, device=w.device))
        )
        m.lora_scale = lora.scale
        m.forward = _forward.__get__(m)
    return [n for n, _ in found]


def is_adapter(name: str) -> bool:
    return name.endswith((f".{A}", f".{B}"))


def freeze_base(root: torch.nn.Module, keep: set[str] = frozenset()) -> int:
    """Freeze every parameter of ``root`` except the adapters and the names in ``keep`` (learned quantization
    scales); returns how many parameter elements still train."""
    n = 0
    for name, p in root.named_parameters():
        p.requires_grad_(is_adapter(name) or name in keep)
        n += p.numel() if p.requires_grad else 0
    return n


def merge(params: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """``params`` (name -> tensor) with every adapted ``<layer>.weight`` replaced by ``W + scale * B @ A`` and the
    ``<layer>.lora_a`` / ``.lora_b`` entries dropped; other entries as they are."""
    out = {k: v for k, v in params.items() if not is_adapter(k)}
    with torch.no_grad():
        for k in params:
            if k.endswith(f".{A}"):
                layer = k[: -len(A) - 1]
                out[f"{layer}.weight"] = merged_weight(
                    params[f"{layer}.weight"], params[k], params[f"{layer}.{B}"], scale
                )
    return out


def check_merged_fake_quant(graph: torch.fx.GraphModule) -> int:
    """In a prepared PT2E graph with adapters: every adapter's product reaches a linear layer only through the merged
    weight, and a quantizer that fake-quantizes inside the adapter path (e.g. a static-activation config annotating
    the ``mul``/``add``) is an error. Returns how many merged weights feed a linear layer."""
    adapter_nodes = {n for n in graph.graph.nodes if n.op == "get_attr" and is_adapter(n.target)}
    if not adapter_nodes:
        return 0
    weights_only: set = set()  # nodes computed from parameters alone (no input tensor): the weight path
    derived: set = set()  # ... of those, the ones an adapter feeds
    for n in graph.graph.nodes:
        inputs = n.all_input_nodes
        if n.op == "get_attr" or (
            n.op in ("call_function", "call_module") and inputs and all(i in weights_only for i in inputs)
        ):
            weights_only.add(n)
            if n in adapter_nodes or any(i in derived for i in inputs):
                derived.add(n)
    merged = 0
    for n in derived:  # in a prepared graph the modules called on the weight path are the quantizer's
        if n.op == "call_module" and n.users:
            ok = all(u.op == "call_function" and "linear" in str(u.target) and u.args[1] is n for u in n.users)
            if not ok:
                raise UserError(
                    f"the recipe quantizes inside a LoRA adapter's weight path ({n.target} on {n.args[0]}), not only "
                    "the merged weight the linear layer uses, so the trained model would not be the deployed one",
                    fix="use model.lora with a dynamic-activation recipe (xnnpack_int8_dynamic, xnnpack_int4w_dynamic, "
                    "xnnpack_8da4w), or drop model.lora",
                )
            merged += 1
    return merged
