"""Running a ``.pte`` through the ExecuTorch Python runtime (``executorch.runtime``).

Example::

    pte = PteModel("runs/qat_xnnpack/model.pte")
    logits = pte(tokens, start=0)      # prefill; then pte(next_token, start=n) to decode
    pte.metadata()["get_max_context_len"]
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
