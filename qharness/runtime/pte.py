"""Running a ``.pte`` through the ExecuTorch Python runtime (``executorch.runtime``).

Example::

    pte = PteModel("runs/qat_xnnpack/model.pte")
    logits = pte(tokens, start=0)      # prefill; then pte(next_token, start=n) to decode
    pte.metadata()["get_max_context_len"]
    kernel_libraries("runs/qat_xnnpack/model.pte")   # what an on-device runner must link for it
"""

from __future__ import annotations

from pathlib import Path

import torch

from qharness.upstream import imports
from qharness.errors import UserError


class PteModel:
    """A loaded ``.pte`` whose ``forward(tokens[1, n], input_pos[1])`` returns ``logits[1, n, vocab]``."""

    def __init__(self, path: str | Path, method: str = "forward"):
        path = Path(path)
        if not path.is_file():
            raise UserError(f".pte file {path} does not exist")
        self.path = path
        try:
            self.program = imports.executorch_runtime().load_program(path)
            self.method = self.program.load_method(method)
        except Exception as e:
            raise UserError(f"{path} is not a loadable ExecuTorch program ({type(e).__name__}: {e})", fix="re-run qharness export") from e

    def __call__(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        out = self.method.execute([tokens.to(torch.long).contiguous(), torch.tensor([start], dtype=torch.long)])
        return out[0]

    def metadata(self) -> dict:
        """The program's constant methods, e.g. ``{"get_max_context_len": 256, "get_eos_ids": [0], ...}``."""
        out = {}
        for name in sorted(self.program.method_names - {"forward"}):
            values = list(self.program.load_method(name).execute([]))
            out[name] = values if name == "get_eos_ids" else values[0]
        return out


# The ExecuTorch library that registers each kernel a program calls outside its delegates (README "On-device
# runner"): prim ops live in the core runtime (kernels/prim_ops/register_prim_ops.cpp), core ATen and dim-order
# ops in optimized_native_cpu_ops_lib (optimized kernels, portable ones for the rest; or portable_ops_lib), the
# LLM ops in custom_ops (EXECUTORCH_BUILD_KERNELS_LLM), quantized_decomposed ops in quantized_ops_lib.
PRIM_OPS = {"aten::sym_size.int", "aten::_local_scalar_dense"}
OP_LIBRARIES = {
    "executorch_prim": "executorch",
    "aten": "optimized_native_cpu_ops_lib",
    "dim_order_ops": "optimized_native_cpu_ops_lib",
    "llama": "custom_ops",
    "quantized_decomposed": "quantized_ops_lib",
}
BACKEND_LIBRARIES = {"XnnpackBackend": "xnnpack_backend", "VulkanBackend": "vulkan_backend"}


def operators(path: str | Path, method: str = "forward") -> dict:
    """``{"operators": [...], "delegates": [...]}`` of a program's method: the kernels it calls outside its
    delegates (``"llama::update_cache.out"``) and its delegates' backend ids (``"XnnpackBackend"``)."""
    from executorch.exir._serialize._program import deserialize_pte_binary  # takes seconds: executorch.exir

    plans = {p.name: p for p in deserialize_pte_binary(Path(path).read_bytes()).program.execution_plan}
    if method not in plans:
        raise UserError(f"{path} has no method {method!r} (it has {', '.join(sorted(plans))})")
    plan = plans[method]
    return {
        "operators": sorted({f"{op.name}.{op.overload}" if op.overload else op.name for op in plan.operators}),
        "delegates": sorted({d.id for d in plan.delegates}),
    }


def kernel_libraries(path: str | Path, method: str = "forward") -> dict[str, list[str]]:
    """ExecuTorch library -> the operators (or backend id) of ``path``'s method it registers: what a runner must
    link, e.g. ``{"custom_ops": ["llama::custom_sdpa.out", ...], "xnnpack_backend": ["XnnpackBackend"], ...}``.
    An operator or backend of no known library is listed under ``"unknown"``."""
    ops = operators(path, method)
    out: dict[str, list[str]] = {}
    for op in ops["operators"]:
        lib = "executorch" if op in PRIM_OPS else OP_LIBRARIES.get(op.split("::")[0], "unknown")
        out.setdefault(lib, []).append(op)
    for backend in ops["delegates"]:
        out.setdefault(BACKEND_LIBRARIES.get(backend, "unknown"), []).append(backend)
    return out
