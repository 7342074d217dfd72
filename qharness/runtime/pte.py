"""Running a ``.pte`` through the ExecuTorch Python runtime (``executorch.runtime``).

Example::

    pte = PteModel("runs/qat_xnnpack/model.pte")
    logits = pte(tokens, start=0)      # prefill; then pte(next_token, start=n) to decode
    pte.metadata()["get_max_context_len"]
    kernel_libraries("runs/qat_xnnpack/model.pte")   # what an on-device runner must link for it

Threads: the first ``PteModel`` of a process sizes ExecuTorch's threadpool (which XNNPACK uses) to
``runtime_threads()``: ``$QHARNESS_THREADS`` if set, else the CPU cores that are free right now
(``free_cores``), and lowers torch's intra-op threads to the same number. Both matter on a shared machine:
a pool with more threads than free cores waits on descheduled workers at every parallel op, and an
ExecuTorch pool of 1 next to 2 torch threads made every prefill call take ~1 s (docs/benchmarks/timing.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from qharness.errors import UserError
from qharness.upstream import imports, quiet


def free_cores(window_s: float = 0.3) -> int:
    """CPU cores of this process's affinity that were idle over the last ``window_s`` seconds (``/proc/stat``),
    rounded, at least 1; without ``/proc/stat``: the affinity size minus the 1-minute load average."""
    from qharness.io.cpu import affinity, ticks

    cpus = affinity()
    try:
        a = ticks(cpus)
        time.sleep(window_s)
        b = ticks(cpus)
        idle = sum((b[c][0] - a[c][0]) / max(1, b[c][1] - a[c][1]) for c in b)
    except (OSError, KeyError, ValueError):
        idle = len(cpus) - os.getloadavg()[0]
    return max(1, min(len(cpus), round(idle)))


_THREADS: int | None = None


def runtime_threads() -> int:
    """The threads every ``.pte`` of this process runs with (chosen once: ``$QHARNESS_THREADS`` or ``free_cores()``)."""
    if _THREADS is None:
        env = os.environ.get("QHARNESS_THREADS", "").strip()
        if env and not (env.isdigit() and int(env) >= 1):
            raise UserError(
                f"QHARNESS_THREADS={env!r} is not a thread count",
                fix="set it to a whole number >= 1, or unset it (free cores)",
            )
        set_runtime_threads(int(env) if env else free_cores())
    return _THREADS


def set_runtime_threads(n: int) -> None:
    """Size ExecuTorch's threadpool to ``n`` threads and cap torch's intra-op threads at ``n``."""
    global _THREADS
    quiet.quiet_executorch_threadpool()  # creates the pool without its cpuinfo probe lines
    pool = imports.executorch_threadpool()
    if pool.get_thread_count() != n:
        pool.reset(n)
    if torch.get_num_threads() > n:
        torch.set_num_threads(n)
    _THREADS = n


# The constant methods qharness's runners read (``deploy.lower.runner_metadata`` writes them).
NEEDED_METHODS = ("get_max_context_len",)
# ``forward``'s inputs: (name, rank); both int64 (ExecuTorch's ScalarType 4, ``Long``).
INPUTS = (("tokens [1, n]", 2), ("input_pos [1]", 1))
_LONG = 4


def _check_inputs(path: Path, method: str, meta) -> None:
    """``method`` takes the inputs qharness feeds it (``INPUTS``): else one line naming what differs, instead of
    the runtime's ``set_inputs() failed 0x12`` at the first call."""
    want = ", ".join(f"{name} int64" for name, _ in INPUTS)
    if meta.num_inputs() != len(INPUTS):
        problem = f"takes {meta.num_inputs()} input(s)"
    else:
        problem = None
        for i, (name, rank) in enumerate(INPUTS):
            info = meta.input_tensor_meta(i)
            if info.dtype() != _LONG or len(info.sizes()) != rank:
                problem = f"input {i} ({name}) is {info}"
                break
    if problem is not None:
        raise UserError(
            f"{path}: its {method} {problem}; qharness feeds {want}: not a program qharness exported",
            fix="export it with qharness export (or fit/calibrate)",
        )


def check_pte_file(path: str | Path) -> Path:
    """``path`` if it is a regular file, else a one-line ``UserError`` saying what it is instead (missing, a directory,
    a FIFO or a device: never opened, so a FIFO cannot block); every command that takes ``--pte`` asks here."""
    from qharness.io.files import file_problem

    path = Path(path)
    problem = file_problem(path)
    if problem:
        raise UserError(
            f".pte file {path} {problem}", fix="pass the program a run wrote, e.g. --pte runs/<run>/model.pte"
        )
    return path


def data_file(path: str | Path) -> Path:
    """The data file of the ``.pte`` at ``path``: ``model.pte`` -> ``model.ptd`` (a tied table stored once,
    ``deploy/shared_table.py``), which the runtime loads with it; most programs have none."""
    return Path(path).with_suffix(".ptd")


def present_data_file(path: str | Path) -> Path | None:
    """The data file of the ``.pte`` at ``path`` when it is there, else None (a self-contained program; a program whose
    data file is missing fails to load, and ``PteModel`` says so in one line)."""
    data = data_file(path)
    return data if data.is_file() else None


def program_bytes(path: str | Path) -> int:
    """Bytes of the program at ``path``: the ``.pte`` and its data file, if it has one."""
    data = data_file(path)
    return Path(path).stat().st_size + (data.stat().st_size if data.is_file() else 0)


def move_program(src: str | Path, dst: str | Path) -> Path:
    """Rename the ``.pte`` ``src`` (and its data file, first, so that no ``.pte`` is found without it) to ``dst``; a
    stale data file at ``dst`` of a program that has none is removed."""
    src, dst = Path(src), Path(dst)
    if data_file(src).is_file():
        os.replace(data_file(src), data_file(dst))
    else:
        data_file(dst).unlink(missing_ok=True)
    os.replace(src, dst)
    return dst


def program_in(path: str | Path) -> Path:
    """The ``.pte`` that ``path`` names: the file itself, or a run directory's program (``model.pte``, else its one
    ``.pte`` that passed the parity gate: not ``*.pending.pte`` nor ``*.FAILED_PARITY.pte``)."""
    path = Path(path)
    if not path.is_dir():
        return check_pte_file(path)
    shipped = sorted(p for p in path.glob("*.pte") if not p.name.endswith((".pending.pte", ".FAILED_PARITY.pte")))
    if path / "model.pte" in shipped or len(shipped) == 1:
        return path / "model.pte" if path / "model.pte" in shipped else shipped[0]
    if not shipped:
        failed = sorted(path.glob("*.FAILED_PARITY.pte"))
        if failed:  # the run's program failed its gate: say so, and name the file that is there
            raise UserError(
                f"run directory {path} holds no .pte that passed parity: {failed[0]} failed its parity gate "
                "(summary.json's parity.reasons say why)",
                fix=f"pass {failed[0]} itself to use it anyway, or try another recipe (qharness ship picks one)",
            )
    raise UserError(
        f"run directory {path} holds " + (f"{len(shipped)} programs" if shipped else "no .pte that passed parity"),
        fix="pass the .pte file itself, e.g. " + (str(shipped[0]) if shipped else f"{path}/model.pte after a run"),
    )


class PteModel:
    """A loaded ``.pte`` whose ``forward(tokens[1, n], input_pos[1])`` returns ``logits[1, n, vocab]``."""

    def __init__(self, path: str | Path, method: str = "forward"):
        path = check_pte_file(path)
        self.path = path
        runtime = imports.executorch_runtime()
        runtime_threads()
        data = present_data_file(path)
        try:
            self.program = runtime.load_program(path, data_path=data)
        except Exception as e:
            raise UserError(
                f"{path} is not a loadable ExecuTorch program ({type(e).__name__}: {e})", fix="re-run qharness export"
            ) from e
        missing = [m for m in (method, *NEEDED_METHODS) if m not in self.program.method_names]
        if missing:
            raise UserError(
                f"{path} lacks the method(s) {', '.join(missing)} that qharness runs (it has "
                f"{', '.join(sorted(self.program.method_names)) or 'none'}): not a program qharness exported",
                fix="export it with qharness export (or fit/calibrate)",
            )
        try:
            self.method = self.program.load_method(method)
        except Exception as e:
            external = [] if data else imports.pte_external_constants(path)
            if external:
                raise UserError(
                    f"{path} keeps {len(external)} constant(s) in its data file {data_file(path)}, which is missing",
                    fix=f"put {data_file(path).name}, written with it, beside {path.name}",
                ) from e
            raise UserError(
                f"{path} is not a loadable ExecuTorch program ({type(e).__name__}: {e})", fix="re-run qharness export"
            ) from e
        _check_inputs(path, method, self.method.metadata)

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


# The ExecuTorch library that registers each kernel a program calls outside its delegates (docs/tutorials/deploying.md,
# "On-device runner"): prim ops live in the core runtime (kernels/prim_ops/register_prim_ops.cpp), core ATen and dim-order
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


def _plan(path: str | Path, method: str):
    plans = {p.name: p for p in imports.pte_program(path).execution_plan}
    if method not in plans:
        raise UserError(f"{path} has no method {method!r} (it has {', '.join(sorted(plans))})")
    return plans[method]


def embedding_bytes(path: str | Path, method: str = "forward") -> int:
    """Bytes of the constant tables (weights, scales, zero points) that ``path``'s method looks rows up in, outside
    its delegates: its embedding tables. A decoded token reads one row of each, not the table, so the weights a
    decode step reads from memory are the ``.pte``'s size less these. A table that another kernel also reads whole
    (a tied ``lm_head`` left undelegated) is not counted."""
    plan = _plan(path, method)
    values = plan.values
    nbytes = {}  # value index -> bytes, for each constant a kernel reads
    tables, elsewhere = set(), set()  # elsewhere: constants another kernel also reads, e.g. a tied lm_head's matmul
    for chain in plan.chains:
        for ins in chain.instructions:
            call = ins.instr_args
            lookup = hasattr(call, "op_index") and "embedding" in plan.operators[call.op_index].name
            for i in getattr(call, "args", ()):
                if (n := imports.pte_constant_bytes(values[i].val)) is not None:
                    nbytes[i] = n
                    (tables if lookup else elsewhere).add(i)
    return sum(nbytes[i] for i in tables - elsewhere)


def operators(path: str | Path, method: str = "forward") -> dict:
    """``{"operators": [...], "delegates": [...]}`` of a program's method: the kernels it calls outside its
    delegates (``"llama::update_cache.out"``) and its delegates' backend ids (``"XnnpackBackend"``)."""
    plan = _plan(path, method)
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
