"""A program's structure, without its weight values: the digest of the lowered edge graph's operators, their argument
shapes and dtypes, and its delegate partitions (each delegated part by its own graph, backend and compile specs).

Programs with one structure run the same kernels on the same shapes: a PTQ, a GPTQ and a QAT program of one recipe
differ only in weight values (and in the float scales and integer zero points those imply), so they get one digest,
and the joint benchmark times them as one latency class (``runtime/joint.py``: their samples pooled, one figure).
What is left out: node names, float literals anywhere (scales, ``eps``, rope factors are values, not kernels), the
scale and zero-point arguments of ``quantized_decomposed`` (de)quantize ops, and every tensor's contents (weights are
placeholders or constants: only their shapes and dtypes count). What is kept: every operator and its place in the
graph, integer and dtype arguments (quantization ranges, group sizes, axes), each value's shape and dtype, which
operators a backend took (the delegate's graph) and which it left to the portable kernels.
"""

from __future__ import annotations

import hashlib

import torch

QDQ_NAMESPACE = "quantized_decomposed"  # (de)quantize ops whose args 1-2 (scale, zero point) are data when literal


def structure_digest(edge) -> str:
    """The sha256 (hex) of an ``EdgeProgramManager``'s structure (every method, in name order): equal for programs
    that differ only in weight values, different when an operator, a shape, a dtype, a quantization range or a
    delegate partition differs."""
    lines = []
    for name in sorted(edge.methods):
        lines.append(f"method {name}")
        lines += graph_lines(edge.exported_program(name).graph_module)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def graph_lines(gm: torch.fx.GraphModule) -> list[str]:
    """One line per node of ``gm``: its op, target, arguments (other nodes by position) and output shapes/dtypes; a
    lowered (delegated) submodule as its backend, compile specs and the lines of its own graph."""
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    lines = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr = _attr(gm, node.target)
            if hasattr(attr, "original_module") and hasattr(attr, "backend_id"):  # a LoweredBackendModule
                specs = sorted((s.key, bytes(s.value).hex()) for s in attr.compile_specs)
                lines.append(f"{index[node]} delegate {attr.backend_id} {specs} {{")
                lines += ["  " + line for line in graph_lines(attr.original_module.graph_module)]
                lines.append("}")
                continue
            lines.append(f"{index[node]} get_attr {_value(attr)}")
            continue
        target = _target(node.target) if node.op in ("call_function", "call_method") else ""
        data_args = {1, 2} if target.startswith(QDQ_NAMESPACE) and "quantize" in target else set()
        args = [_arg(a, index, i in data_args) for i, a in enumerate(node.args)]
        kwargs = {k: _arg(v, index, k in ("scale", "zero_point")) for k, v in sorted(node.kwargs.items())}
        lines.append(f"{index[node]} {node.op} {target} {args} {kwargs} -> {_value(node.meta.get('val'))}")
    return lines


def _attr(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _target(target) -> str:
    """``quantized_decomposed.quantize_per_tensor.default``: an operator's name, stable across processes."""
    if isinstance(target, str):
        return target
    name = getattr(target, "name", None)
    if callable(name):  # OpOverload / EdgeOpOverload
        return str(name())
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__name__)}"


def _arg(a, index: dict, data: bool) -> str:
    """An argument as the structure sees it: a node by its position; a float (or, for a data argument, any literal)
    by its type only; ints, bools, strings, dtypes as they are; sequences element by element."""
    if isinstance(a, torch.fx.Node):
        return f"%{index[a]}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x, index, data) for x in a) + "]"
    if data or isinstance(a, float):
        return type(a).__name__
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v, index, data)}" for k, v in sorted(a.items())) + "}"
    if a is None or isinstance(a, (int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return repr(a)
    return type(a).__name__  # anything else by its type (its repr may hold an address)


def _value(v) -> str:
    """A value's shape and dtype (tensors), element by element (sequences), else its type."""
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_value(x) for x in v) + ")"
    if isinstance(v, (int, bool, str, torch.SymInt)) or v is None:
        return repr(v) if not isinstance(v, torch.SymInt) else str(v)
    return type(v).__name__
