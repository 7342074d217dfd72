"""Every linear projection of a loaded model in the one form quantizers see: a plain ``nn.Linear``.

Quantizers take ``nn.Linear`` modules (torchao's ``quantize_``) or the ``aten.linear`` they export to (PT2E). Some
families compute their projections otherwise: GPT-2's ``Conv1D`` (weight ``[in, out]``, ``aten.addmm``) and Falcon's
``FalconLinear`` (an ``nn.Linear`` whose own forward computes ``input @ weight.T``, ``aten.matmul``). A recipe left
those in floating point, and torchao's quantized weights fail on the transpose. ``normalize_linears`` swaps each for
an equivalent ``nn.Linear`` (Conv1D's weight transposed, the same parameter names) where a model is loaded
(``models.load_model_and_tokenizer``, the architecture check's probe), so training, checkpoints, the weights put into
the deploy graph and every later load see the same modules. A module is swapped only when its output on a random
input equals ``F.linear`` with its weight and bias; the others stay as they are (deployment's coverage check
reports them, ``deploy/coverage.py``).

Example::

    swapped = normalize_linears(model)    # {"transformer.h.0.attn.c_attn": "Conv1D", ...}
    normalize_model(model)                # the same, and MoE experts as nn.Linear modules (moe.py)
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def normalize_model(model) -> dict[str, str]:
    """Everything a loaded model needs before export and quantization, in place: ``normalize_linears`` and the MoE
    experts rewrite (``moe.rewrite_moe``); returns ``normalize_linears``' record."""
    from qharness.sources.moe import rewrite_moe

    swapped = normalize_linears(model)
    rewrite_moe(model)
    return swapped


def normalize_linears(model) -> dict[str, str]:
    """Swap, in place, every module of ``model`` that computes a linear projection some other way for an
    ``nn.Linear`` of the same parameters; returns ``{module name: the class it had}``."""
    shared = _shared_tensors(model)
    swapped = {}
    for name, module in list(model.named_modules()):
        if not name:
            continue
        linear = _as_linear(module, shared)
        if linear is None:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, linear)
        swapped[name] = type(module).__name__
    if swapped:
        kinds = sorted(set(swapped.values()))
        log.info("%d %s modules computed as nn.Linear (what quantizers see)", len(swapped), "/".join(kinds))
    return swapped


def is_projection(module) -> bool:
    """Whether ``module`` is a linear projection: an ``nn.Linear`` (of any class) or a ``Conv1D``-style module."""
    import torch

    return isinstance(module, torch.nn.Linear) or _is_conv1d(module)


def _shared_tensors(model) -> set[int]:
    """ids of parameters that ``model`` holds under more than one name (tied): a transposed copy would untie them."""
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {i for i, n in seen.items() if n > 1}


def _is_conv1d(module) -> bool:
    """transformers' ``Conv1D`` (GPT-2, and remote-code copies of it): ``addmm(bias, x, weight[in, out])``."""
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nx", None), int)
        and isinstance(getattr(module, "nf", None), int)
        and w is not None
        and tuple(w.shape) == (module.nx, module.nf)
    )


def _linear_subclass(module) -> bool:
    import torch

    return (
        isinstance(module, torch.nn.Linear)
        and type(module) is not torch.nn.Linear
        and type(module).forward is not torch.nn.Linear.forward
    )


def _as_linear(module, shared: set[int]):
    """The ``nn.Linear`` that computes what ``module`` does, or None (already one, not a projection, or not equal)."""
    import torch

    if _is_conv1d(module):
        weight = module.weight
        if id(weight) in shared or not _computes_linear(module, weight.detach().t(), module.bias):
            return None
        linear = _empty_linear(module.nx, module.nf, module.bias is not None, module.training)
        linear.weight = torch.nn.Parameter(weight.detach().t().contiguous(), requires_grad=weight.requires_grad)
        linear.bias = module.bias
        return linear
    if _linear_subclass(module) and _computes_linear(module, module.weight, module.bias):
        linear = _empty_linear(module.in_features, module.out_features, module.bias is not None, module.training)
        linear.weight, linear.bias = module.weight, module.bias
        return linear
    return None


def _empty_linear(in_features: int, out_features: int, bias: bool, training: bool):
    import torch

    linear = torch.nn.Linear(in_features, out_features, bias=bias, device="meta")  # its parameters are replaced
    return linear.train(training)


def _computes_linear(module, weight, bias) -> bool:
    """Whether ``module(x) == F.linear(x, weight, bias)`` on a random ``x`` (a weightless ``meta`` copy: assumed)."""
    import torch

    if weight.is_meta:
        return True
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0), device="cpu")
    x = x.to(weight.device, weight.dtype)  # drawn on CPU, where the generator is (a GPU device context too)
    with torch.no_grad():
        try:
            got = module(x)
        except Exception:  # a module that takes other inputs is no plain projection
            return False
        want = torch.nn.functional.linear(x, weight, bias)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    return bool((got - want).abs().max() <= 1e-4 * want.abs().max() + 1e-6)
