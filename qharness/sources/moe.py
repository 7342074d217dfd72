"""Mixture-of-experts blocks rewritten into a form that exports, lowers and quantizes: every expert's projections
as plain ``nn.Linear`` modules and routing through core-ATen ops with static shapes.

transformers (5.x) keeps a sparse-MoE block's experts as batched 3-D parameters (``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``) behind ``@use_experts_implementation``, whose default ``grouped_mm`` forward counts
tokens per expert with ``torch.histc`` (not core ATen: ``to_edge`` refuses it) and whose weights no linear-based
quantizer (PT2E, torchao ``quantize_``) sees, so an MoE would deploy with its experts (most of its bytes) in float.
``rewrite_moe`` (called by ``models.load_model_and_tokenizer``, so training, checkpoints, deployment and evaluation
all see the same modules and parameter names) swaps each such experts module for ``LinearExperts``: a
``ModuleList`` of ``ExpertMLP`` (``gate_proj``/``up_proj``/``down_proj``, one ``nn.Linear`` each, so quantizers give
every expert and projection its own scales), with the same call ``experts(hidden[T, H], top_k_index[T, k],
top_k_weights[T, k])``. The block's router (each family's own top-k, softmax, normalisation, shared expert) is kept
as is: it is already core ATen (``linear``, ``softmax``, ``topk``).

**Compute cost.** ``LinearExperts`` scatters the top-k routing weights into a dense ``[T, E]`` matrix and runs
*every* expert on *every* token, weighting each output by its column (zero for experts a token was not routed
to). That is ``E / k`` times the expert FLOPs of sparse dispatch (e.g. 4x for 8 experts, top-2) and, at decode, it
reads every expert's weights for each token, so a ``.pte`` decodes at about the speed of a dense model with all
the experts' parameters, not with the active ones (``scripts/bench_moe.py`` measures it). In exchange the program
has static shapes and only linears that XNNPACK delegates. Cheaper exportable forms exist but were not taken here:
(a) ``torch.cond`` per expert on "any token routed here" (exportable; ExecuTorch runs ``cond``, but whether the
XNNPACK partitioner delegates the quantized linears inside its branches is untested); (b) gathering the k chosen
experts' weights (``index_select`` on the stacked weights) and a batched matmul, k experts of work per token, but
a gathered weight is no ``linear`` against a parameter, so PT2E/XNNPACK would not quantize or delegate it without
a custom MoE kernel.

Side effects of the dense form: GPTQ (``rounding: gptq``) sees every token in every expert's Hessian, not only the
tokens routed to it. The router (``F.linear`` on a bare ``[E, H]`` parameter) reads its weight from an ``nn.Linear``
child after the rewrite (``linear_router``), so every recipe quantizes it like any projection (PT2E recipes saw its
``aten.linear`` already; torchao's source-level ones take only ``nn.Linear`` modules) and the coverage check counts it.

Experts left alone (no quantized form given; they still fail lowering as before): other gates than the default
``act(gate) * up`` (gpt-oss), interleaved gate/up layouts, a post-expert norm, and per-expert ``ModuleList``
blocks of older transformers or remote code (none in transformers 5.24's own families), whose routing lives in
the block's forward.

Example::

    model = AutoModelForCausalLM.from_pretrained("mixtral-dir")
    rewrite_moe(model)   # model.model.layers[0].mlp.experts[3].down_proj is an nn.Linear
    restore_moe(model)   # back to transformers' modules (trained weights kept), e.g. before save_pretrained
"""

from __future__ import annotations

import torch
from torch import nn


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))``, or ``down(act(up(x)))`` for non-gated experts."""

    def __init__(self, hidden: int, intermediate: int, act_fn, gated: bool = True, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias) if gated else None
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act_fn(self.up_proj(x)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LinearExperts(nn.ModuleList):
    """The experts of an MoE block as ``ExpertMLP`` modules, applied densely: every expert to every token, weighted
    by the token's routing weight for it (0 where it was not chosen). Same call and result as transformers'
    experts modules: ``(hidden[T, H], top_k_index[T, k], top_k_weights[T, k]) -> [T, H]``."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        dense = torch.zeros(
            hidden_states.shape[0], len(self), dtype=top_k_weights.dtype, device=hidden_states.device
        ).scatter(1, top_k_index, top_k_weights)  # [T, E]
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):  # ascending expert order, as transformers accumulates
            out = out + (expert(hidden_states) * dense[:, e : e + 1]).to(out.dtype)
        return out


def _default_gate(experts: nn.Module) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    return getattr(type(experts), "_apply_gate", _default_apply_gate) is _default_apply_gate


def convertible(experts: nn.Module) -> bool:
    """Whether ``experts`` is a transformers batched-experts module (``@use_experts_implementation``) whose math
    ``LinearExperts`` reproduces."""
    if not hasattr(experts, "is_transposed") or not hasattr(experts, "act_fn"):
        return False
    gated = getattr(experts, "has_gate", False)
    first = getattr(experts, "gate_up_proj" if gated else "up_proj", None)
    down = getattr(experts, "down_proj", None)
    return (
        isinstance(first, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and first.dim() == 3
        and down.dim() == 3
        and not getattr(experts, "has_post_expert_norm", False)
        and (not gated or (getattr(experts, "is_concatenated", True) and _default_gate(experts)))
    )


def unconverted_experts(model: nn.Module) -> dict[str, str]:
    """``{module name: why}`` of the experts modules of ``model`` (named ``experts`` or of an ``*Experts`` class)
    holding batched 3-D expert weights that ``rewrite_moe`` leaves alone (not ``convertible``): no linear-based
    quantizer sees those weights."""
    found = {}
    for name, m in model.named_modules():
        is_experts = name.rsplit(".", 1)[-1] == "experts" or "Experts" in type(m).__name__
        if is_experts and not isinstance(m, LinearExperts) and any(p.dim() == 3 for p in m.parameters(recurse=False)):
            found[name] = f"{type(m).__name__}: {_not_convertible(m)}"
    return found


def _not_convertible(experts: nn.Module) -> str:
    """What of ``experts`` ``LinearExperts`` does not reproduce (the first condition of ``convertible`` it fails)."""
    if not hasattr(experts, "is_transposed"):
        return "its own forward, not transformers' batched-experts implementation"
    gated = getattr(experts, "has_gate", False)
    if not hasattr(experts, "act_fn") or (gated and not _default_gate(experts)):
        return f"its own gate ({type(experts).__name__}._apply_gate), not act(gate) * up"
    if gated and not getattr(experts, "is_concatenated", True):
        return "gate and up interleaved in one tensor"
    if getattr(experts, "has_post_expert_norm", False):
        return "a norm after each expert"
    return "expert weights of another layout"


def linear_experts(experts: nn.Module) -> LinearExperts:
    """``experts`` (a ``convertible`` batched-experts module) as a ``LinearExperts`` holding copies of its weights;
    ``experts`` itself, its weights moved to the ``meta`` device, is kept as the template ``batched_experts`` fills."""
    gated, bias = bool(experts.has_gate), bool(getattr(experts, "has_bias", False))

    def as_linear(w: torch.Tensor) -> torch.Tensor:  # [out, in], as nn.Linear stores it
        return (w.t() if experts.is_transposed else w).detach().clone().contiguous()

    first = experts.gate_up_proj if gated else experts.up_proj
    first_bias = getattr(experts, "gate_up_proj_bias" if gated else "up_proj_bias", None)
    hidden, width = (first.shape[1], first.shape[2]) if experts.is_transposed else (first.shape[2], first.shape[1])
    inter = width // 2 if gated else width
    modules = []
    for e in range(first.shape[0]):
        mlp = ExpertMLP(hidden, inter, experts.act_fn, gated=gated, bias=bias).to(first.device, first.dtype)
        w, b = as_linear(first[e]), first_bias[e].detach().clone() if bias else None
        projections = [(mlp.gate_proj, w[:inter], b[:inter] if bias else None)] if gated else []
        projections.append((mlp.up_proj, w[inter:] if gated else w, (b[inter:] if gated else b) if bias else None))
        down_bias = experts.down_proj_bias[e] if bias else None
        projections.append((mlp.down_proj, as_linear(experts.down_proj[e]), down_bias))
        for linear, weight, b_ in projections:
            linear.weight = nn.Parameter(weight.contiguous(), requires_grad=first.requires_grad)
            if b_ is not None:
                linear.bias = nn.Parameter(b_.detach().clone(), requires_grad=first.requires_grad)
        modules.append(mlp)
    out = LinearExperts(modules)
    for name, p in list(experts.named_parameters(recurse=False)):
        setattr(experts, name, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
    out.batched = [experts]  # in a list: no submodule, so neither in state_dict nor in any export
    return out


def batched_experts(experts: LinearExperts) -> nn.Module:
    """The inverse of ``linear_experts``: transformers' batched-experts module holding ``experts``' current weights."""
    import copy

    original = copy.deepcopy(experts.batched[0])
    gated = original.has_gate

    def stack(tensors: list[torch.Tensor], weight: bool) -> nn.Parameter:
        t = torch.stack([w.t() if weight and original.is_transposed else w for w in tensors]).detach().clone()
        return nn.Parameter(t.contiguous(), requires_grad=tensors[0].requires_grad)

    def first(e: ExpertMLP, attr: str) -> torch.Tensor:
        parts = [getattr(e.gate_proj, attr), getattr(e.up_proj, attr)] if gated else [getattr(e.up_proj, attr)]
        return torch.cat(parts)

    name = "gate_up_proj" if gated else "up_proj"
    setattr(original, name, stack([first(e, "weight") for e in experts], weight=True))
    original.down_proj = stack([e.down_proj.weight for e in experts], weight=True)
    if getattr(original, "has_bias", False):
        setattr(original, name + "_bias", stack([first(e, "bias") for e in experts], weight=False))
        original.down_proj_bias = stack([e.down_proj.bias for e in experts], weight=False)
    return original


ROUTER_LINEAR = "proj"  # the nn.Linear child a ``linear_router`` reads its weight from (deploy/coverage.py finds it)


def _router_weight(self) -> torch.Tensor:
    return getattr(self, ROUTER_LINEAR).weight


ROUTERS = ("gate", "router")  # the attribute an MoE block keeps its router in: Qwen3-MoE / Mixtral, Granite-4.0-H


def linear_router(router: nn.Module) -> bool:
    """Make a router that computes ``F.linear(hidden, self.weight)`` on a bare ``[E, H]`` parameter (every
    transformers 5 ``*TopKRouter``) read that weight from an ``nn.Linear`` child ``proj``, in place, so that torchao's
    source-level recipes quantize it as PT2E recipes do (they see an ``aten.linear`` either way); its own routing code
    is kept. False when ``router`` has no such parameter."""
    w = router._parameters.get("weight") if isinstance(router, nn.Module) else None
    if isinstance(router, nn.Linear) or w is None or w.dim() != 2 or ROUTER_LINEAR in router._modules:
        return False
    cls = type(router)
    proj = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    proj.weight = w
    del router._parameters["weight"]
    router.__class__ = type(f"Linear{cls.__name__}", (cls,), {"weight": property(_router_weight), "_base": cls})
    setattr(router, ROUTER_LINEAR, proj)
    return True


def _plain_router(router: nn.Module) -> None:
    """The inverse of ``linear_router``."""
    weight = getattr(router, ROUTER_LINEAR).weight
    del router._modules[ROUTER_LINEAR]
    router.__class__ = router._base
    router.weight = weight


def rewrite_moe(model: nn.Module) -> int:
    """Swap every ``convertible`` experts module in ``model`` for its ``LinearExperts`` (and its block's router for
    a ``linear_router``); the number swapped."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if not isinstance(child, LinearExperts) and convertible(child)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, linear_experts(child))
        for router in ROUTERS:
            linear_router(getattr(parent, router, None))
    return len(swaps)


def restore_moe(model: nn.Module) -> int:
    """The inverse of ``rewrite_moe``: every ``LinearExperts`` back to transformers' batched-experts module (with
    the current weights), so ``save_pretrained`` writes a checkpoint transformers loads; the number restored."""
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, LinearExperts)
    ]
    for parent, name, child in swaps:
        setattr(parent, name, batched_experts(child))
        for router in ROUTERS:
            if hasattr(getattr(parent, router, None), "_base"):
                _plain_router(getattr(parent, router))
    return len(swaps)
