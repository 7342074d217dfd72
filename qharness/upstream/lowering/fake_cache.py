"""Speed-up: torchao's quantization primitives and ``aten.linear`` through the fake-tensor cache, not their bodies."""

from __future__ import annotations

import contextlib

import torch

from qharness.upstream.lowering.patching import patched

# torchao's CompositeImplicitAutograd primitives (torchao/quantization/quant_primitives.py, ``_register_custom_op``),
# which export keeps whole in the graph: 8da4w's activations and weights, ~850 nodes at 30 layers
PRIMITIVES = ("choose_qparams_affine", "quantize_affine", "dequantize_affine")


def torchao_ops() -> tuple:
    namespace = torch.ops.torchao
    return tuple(getattr(namespace, name).default for name in PRIMITIVES if hasattr(namespace, name))


def fake_only(args, kwargs, fake_types) -> bool:
    """Whether a call's tensors are all plain ``FakeTensor`` s of one mode (no constants, none requiring grad), with no
    dispatch mode active but fake ones (no proxy tracing, no functionalization). ``fake_types``: ``(FakeTensor,
    FakeTensorMode)``."""
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    fake_tensor, fake_mode = fake_types
    mode = None
    for a in pytree.arg_tree_leaves(*args, **kwargs):
        if isinstance(a, torch.Tensor):
            if type(a) is not fake_tensor or a.constant is not None or a.requires_grad:
                return False
            if mode is None:
                mode = a.fake_mode
            elif a.fake_mode is not mode:
                return False
    if mode is None:
        return False
    keys = torch._C._TorchDispatchModeKey
    if torch._C._get_dispatch_mode(keys.PROXY) is not None or torch._C._get_dispatch_mode(keys.FUNCTIONAL) is not None:
        return False
    return all(isinstance(m, fake_mode) for m in _get_current_dispatch_mode_stack())


def patch():
    """On fake tensors, torchao's ``choose_qparams_affine`` / ``quantize_affine`` / ``dequantize_affine`` and
    ``aten.linear`` run their Python bodies (CompositeImplicitAutograd: decomposed at the autograd key, before
    ``FakeTensorMode`` sees the call; ``linear`` through ``matmul``'s Python decomposition), 10-40 ops each with
    symbolic shapes, at every node of every re-trace of the program (decompositions, each ATen-to-Edge pass, the
    Edge verifier, the delegates' fake runs, ``to_executorch``'s passes): half of lowering a 30-layer 8da4w model.
    Here a call whose tensors are all fake (no tracing or functionalizing mode active, no input requiring grad) is
    dispatched below autograd, where ``FakeTensorMode`` gets it as one op: on a miss the mode runs the same body
    (``func.decompose`` in ``_dispatch_impl``, a path torch itself takes), and serves repeats from its cache
    (``FakeTensorMode._cached_dispatch_impl``, torch/_subclasses/fake_tensor.py: shape, strides, dtype, symbolic
    sizes as expressions of the inputs'). The cache refuses non-ATen ops ("non-builtin" in
    ``_validate_cache_key``) because a custom fake kernel may be impure; torchao's three are pure functions of
    their arguments' metadata (no data-dependent shapes, no new symbols, outputs never alias inputs), so the refusal
    is lifted for them alone. With no input requiring grad, skipping the autograd key changes no output; real
    tensors, traced and functionalized calls go as upstream. ``tests/test_upstream_lowering.py`` checks the outputs
    against upstream's and that upstream still refuses these ops."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    custom = torchao_ops()
    upstream_validate = FakeTensorMode._validate_cache_key

    def validate_cache_key(self, func, args, kwargs):
        if func in custom:  # no tags (data-dependent output, dynamic shape, inplace view), not a view, not a lift
            return
        return upstream_validate(self, func, args, kwargs)

    fast = frozenset((*custom, torch.ops.aten.linear.default))
    fake_types = (FakeTensor, FakeTensorMode)

    def call(self, /, *args, **kwargs):  # OpOverload.__call__; its hash, its _op unchanged
        if self in fast and fake_only(args, kwargs, fake_types):
            with torch._C._AutoDispatchBelowAutograd():
                return self._op(*args, **kwargs)
        return self._op(*args, **kwargs)

    stack = contextlib.ExitStack()
    stack.enter_context(patched(FakeTensorMode, "_validate_cache_key", validate_cache_key))
    stack.enter_context(patched(torch._ops.OpOverload, "__call__", call))
    return stack
