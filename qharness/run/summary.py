"""``summary.json``: the versioned record of one run, written by the run's stages and read by the report, the sweep,
wandb tracking and later commands. Every writer merges into the file (a later command never drops an earlier
command's results); every reader goes through ``RunSummary.read``.

Example::

    s = RunSummary.read("runs/qat_xnnpack/summary.json")
    s.kind, s.metrics["pte"]["ppl"], s.pte["size_bytes"]
    RunSummary.update("runs/qat_xnnpack/summary.json", bench=result)   # read, set the section, write atomically
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qharness.errors import UserError
from qharness.io.atomic import to_jsonable, write_json_atomic

SCHEMA_VERSION = 4  # 1: the unversioned summaries written before this type existed; 2: before ``layers``; 3: before
# ``coverage`` (all read)
MODES = ("qat", "ptq")


@dataclass
class RunSummary:
    """One run. Identity fields first; each later section is filled by the stage that produces it.

    Args:
        run_dir: The run directory.
        model: ``model.checkpoint`` as configured.
        recipe: Recipe name.
        backend: The recipe's backend.
        mode: How the run was made: ``qat`` or ``ptq``.
        quantized: Whether the recipe quantizes (False: the FP baseline).
        seq_len: Block length of the validation blocks every model was scored on.
        eval_blocks: How many validation blocks.
        val_blocks: Fingerprint of those blocks: runs with the same one were scored on the same text (paired).
        distill: QAT with knowledge distillation from the FP model: its settings (``model.distill``); None: without.
        lora: LoRA-QAT: its settings (``model.lora``), the adapted layers and trained parameters; None: full QAT.
        metrics: Per model (``fp``, ``fake_quant``, ``converted``, ``pte``): loss, ppl and their intervals.
        parity: The parity gate's figures and verdict.
        pte: The ``.pte``: path, size_bytes, max_seq_len, export_path, fallback_reason, kv_cache (fp32 or int8).
        layers: Source-level recipes: the per-layer quantization the ``.pte`` got: ``schemes`` ``{module name: scheme}``
            (``8da4w-g32``, ``8da8w-pc``, ``fp``, ...), ``counts`` per scheme and the recipe's ``rules`` as written
            (``recipes/layers.py``); None for graph-level (PT2E) and FP recipes.
        coverage: How much of the model the ``.pte`` quantized (``deploy/coverage.py``): ``weights``/``bytes`` (the
            model's linear weights, float bytes), ``quantized``/``quantized_bytes``, ``fraction`` (of the bytes; 0 for
            an FP recipe), the same per recipe rule (``rules``: ``recipe`` or ``layers[i] (match ...)``), each float
            weight with ``why`` (``fp recipe``, ``recipe rule``, ``recipe settings: ...``) and ``unused`` linear modules
            the program never reads; None in summaries written before it was measured.
        timings: Seconds per stage.
        bench: The run's own benchmark (``qharness bench`` format).
        bench_joint: The sweep's interleaved benchmark of all candidates (fresh processes, round-robin).
        eval: The lm-eval table of the run itself (fit/calibrate/export).
        evaluations: Later ``qharness evaluate`` results, oldest first (never replacing ``eval``).
        schema_version: ``SCHEMA_VERSION`` of the writer.
    """

    run_dir: str
    model: str
    recipe: str
    backend: str
    mode: str
    quantized: bool
    seq_len: int
    eval_blocks: int
    val_blocks: str | None = None
    distill: dict[str, Any] | None = None
    lora: dict[str, Any] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    parity: dict[str, Any] = field(default_factory=dict)
    pte: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, Any] | None = None
    coverage: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    bench: dict[str, Any] | None = None
    bench_joint: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")

    @property
    def kind(self) -> str:
        """``fp`` for the unquantized baseline, else ``ptq`` or ``qat``."""
        return self.mode if self.quantized else "fp"

    @property
    def passed(self) -> bool | None:
        """The parity verdict: True, False, or None (not run here)."""
        return self.parity.get("passed")

    def pte_file(self, run_dir: str | Path) -> Path:
        """The run's ``.pte`` in ``run_dir``: ``pte.path`` is recorded as the run was given it (relative to the
        directory it was started from), the file is in the run directory wherever that now is."""
        return Path(run_dir) / Path(self.pte.get("path", "")).name

    def to_dict(self) -> dict:
        return to_jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict, where: str = "summary") -> RunSummary:
        if not isinstance(data, dict):
            raise UserError(f"{where} is not a JSON object")
        version = data.get("schema_version", 1)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise UserError(
                f"{where} has schema_version {version!r}, newer than this qharness reads ({SCHEMA_VERSION})",
                fix="upgrade qharness",
            )
        data = dict(data)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UserError(f"{where} has unknown field(s) {', '.join(unknown)}", fix="was it written by another tool?")
        missing = sorted(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in data
        )
        if version == 1 and missing == ["quantized"]:  # the oldest summaries: ask the recipe
            from qharness.recipes.registry import load_recipe

            data["quantized"], missing = load_recipe(data["recipe"]).quantized, []
        if missing:
            raise UserError(f"{where} lacks field(s) {', '.join(missing)}")
        data["schema_version"] = SCHEMA_VERSION
        try:
            return cls(**data)
        except ValueError as e:
            raise UserError(f"{where}: {e}") from e

    @classmethod
    def read(cls, path: str | Path) -> RunSummary:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise UserError(f"no run summary at {path}", fix="run qharness fit/calibrate/export first") from e
        except (OSError, ValueError) as e:
            raise UserError(f"{path} cannot be read as a run summary ({e})") from e
        return cls.from_dict(data, str(path))

    def write(self, path: str | Path) -> Path:
        return write_json_atomic(Path(path), self.to_dict())

    @classmethod
    def update(cls, path: str | Path, **sections) -> RunSummary:
        """Set ``sections`` (fields) of the summary at ``path`` and write it back; ``evaluations`` entries are appended."""
        summary = cls.read(path)
        for name, value in sections.items():
            if name == "evaluations":
                summary.evaluations.extend(value)
            elif name in {f.name for f in dataclasses.fields(cls)}:
                setattr(summary, name, value)
            else:
                raise KeyError(f"RunSummary has no field {name!r}")
        summary.write(path)
        return summary
