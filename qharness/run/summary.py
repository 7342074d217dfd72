"""``summary.json``: the versioned record of one run, written by the run's stages and read by the report, the sweep,
wandb tracking and later commands. Every writer merges into the file (a later command never drops an earlier
command's results); every reader goes through ``RunSummary.read``.

Its sections are typed (``Score``, ``Parity``, ``PteInfo``, ``LayerPlan``, ``Timings``, and the records the stages
that produce them own: ``GgufSource`` (``sources/gguf.py``), ``Coverage`` (``deploy/coverage_record.py``), ``Bench``
and ``JointEntry`` (``runtime/bench_record.py``)). ``eval``/``evaluations`` (lm-eval's table,
``evaluation/harness.py``) stay plain data: their keys are data, not fields (task names, lm-eval's metric names such as
``acc,none``, the stages a run scored), which a dataclass would only rename. On disk it is the same JSON as before the
sections were typed (schema 4): every earlier summary reads; a newer one, or a section with a field this qharness does
not know, is refused in one line naming its schema_version.

Example::

    s = RunSummary.read("runs/qat_xnnpack/summary.json")
    s.kind, s.metrics["pte"].ppl, s.pte.size_bytes, s.parity.passed, s.coverage.fraction, s.bench.pte.decode_tok_s.median
    RunSummary.update("runs/qat_xnnpack/summary.json", bench=result)   # read, set the section, write atomically
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qharness.checks.answers import Answers
from qharness.deploy.coverage_record import Coverage
from qharness.errors import UserError
from qharness.io.atomic import to_jsonable, write_json_atomic
from qharness.runtime.bench_record import Bench, JointEntry
from qharness.sources.gguf import GgufSource

SCHEMA_VERSION = 4  # 1: the unversioned summaries written before this type existed; 2: before ``layers``; 3: before
# ``coverage`` (all read)
MODES = ("qat", "ptq")
# a section field written as null when unset (``to_dict``): what the writer always recorded; other unset fields
# are left out, as they were before the sections were typed (a parity gate's ``skipped``, ``fake_quant``, ...)
KEEP_NONE = {"keep_none": True}
OMIT_NONE = {"omit_none": True}  # a section added since schema 4 is left out while unset: older summaries read the same


def _kept() -> Any:
    return field(default=None, metadata=KEEP_NONE)


@dataclass
class VsFp:
    """A model's perplexity against the FP model's on the same blocks: ``ppl_ratio`` and its paired 95% ``ci``."""

    ppl_ratio: float | None = None
    ci: list[float] | None = None


@dataclass
class Score:
    """One model scored on the validation blocks (``checks/parity.py`` scoring, ``checks/stats.with_intervals``).

    Args:
        loss: Mean token loss (None: NaN/inf, as JSON writes it).
        ppl: Perplexity.
        loss_se: Standard error of the per-block mean losses.
        n_blocks: Blocks scored.
        ppl_ci: 95% interval of the perplexity ``[lo, hi]`` (None below two blocks).
        vs_fp: Against the FP model on the same blocks (None for the FP model itself).
        block_losses: Mean loss of each block, in block order (the report pairs runs by them).
    """

    loss: float | None = _kept()
    ppl: float | None = _kept()
    loss_se: float | None = _kept()
    n_blocks: int | None = _kept()
    ppl_ci: list[float] | None = _kept()
    vs_fp: VsFp | None = None
    block_losses: list[float] | None = None


@dataclass
class Agreement:
    """Logits of the ``.pte`` against a reference over compared positions (``checks/parity.py``), and the verdict.

    Args:
        max_abs_diff: Largest absolute logit difference.
        argmax_agreement: Fraction of positions whose top-1 tokens agree.
        positions: Positions compared.
        tie_margin: The top-1/top-2 logit gap at or under which a position is a near tie.
        near_ties: Positions that are near ties.
        argmax_agreement_decided: Agreement over the positions that are not near ties (None: all are).
        non_finite_positions: Positions with NaN/inf logits.
        kl: Mean KL divergence of the ``.pte``'s next-token distribution from the reference's (nats per position).
        kl_positions: The positions ``kl`` is the mean over, where more than ``positions``: the parity gate's are the
            validation blocks' and the decoding's, and the noise's those of each of its ``twins`` (unset:
            ``positions``; summaries written before 2026-11-29).
        twins: The noise only: how many rounding twins (seeds) its ``kl`` averages over the validation blocks (the
            decoding's figures are the first one's).
        ppl_rel_diff: Relative perplexity difference of the two models.
        ppl_bound: The rounding twin (``Parity.noise``): how far rounding alone may move the reference's perplexity
            (its own difference plus three standard errors of the blocks' spread); the gate allows the larger of
            this and ``parity.max_ppl_rel_diff``.
        passed: The verdict (None: not run here).
        reasons: Why it failed (empty when it passed).
    """

    max_abs_diff: float | None = None
    argmax_agreement: float | None = None
    positions: int | None = None
    tie_margin: float | None = None
    near_ties: int | None = None
    argmax_agreement_decided: float | None = _kept()
    non_finite_positions: int | None = None
    kl: float | None = None
    kl_positions: int | None = None  # left out when unset
    twins: int | None = None  # left out when unset
    ppl_rel_diff: float | None = None
    ppl_bound: float | None = None
    passed: bool | None = None
    reasons: list[str] = field(default_factory=list)


@dataclass
class FakeQuantAgreement(Agreement):
    """QAT: the ``.pte`` against the trained fake-quant graph; ``gated``: the verdict counts (every QAT run now;
    summaries written before 2026-11-28 say false where the recipe did not learn its scales)."""

    gated: bool = True


@dataclass
class LearnedScales:
    """Learned weight scales: how many the run trained (``weights``) and how many reached the program ``exact``."""

    weights: int = 0
    exact: int = 0


@dataclass
class Parity(Agreement):
    """The parity gate: the ``.pte``'s decoding against the converted model's (``Agreement``), with what else it
    checked: ``noise`` (the converted model against its rounding twin, every result rounded the other way, over the same positions:
    the rounding noise the ``.pte`` is judged against), ``fake_quant`` (QAT), ``learned_scales``; ``skipped``: why it
    did not run here (``passed`` None)."""

    skipped: str | None = None
    noise: Agreement | None = None
    fake_quant: FakeQuantAgreement | None = None
    learned_scales: LearnedScales | None = None


@dataclass
class PteInfo:
    """The ``.pte`` a run wrote.

    Args:
        path: As the run was given it (``RunSummary.pte_file`` finds it in the run directory).
        size_bytes: What the program stores: the file, and its data file if it has one (``data_file``).
        max_seq_len: Its static KV cache's length.
        export_path: How it was exported (the fast path, or HF's static cache).
        fallback_reason: Why the fast path was not taken (None: it was).
        kv_cache: ``fp32`` or ``int8``.
        sha256: Digest of its bytes (later evaluations name the program they scored by it).
        structure: Digest of its structure: operators, shapes, dtypes and delegate partitions, weight values left out
            (``deploy/structure.py``). Programs with one structure (a PTQ, a GPTQ and a QAT program of one recipe)
            are one latency class in the joint benchmark.
        data_file: The data file the runtime loads with it (``model.ptd`` beside ``model.pte``: a tied table stored
            once, ``deploy/shared_table.py``); unset: the ``.pte`` holds everything.
    """

    path: str | None = _kept()
    size_bytes: int | None = _kept()
    max_seq_len: int | None = _kept()
    export_path: str | None = _kept()
    fallback_reason: str | None = _kept()
    kv_cache: str | None = _kept()
    sha256: str | None = _kept()
    structure: str | None = None  # left out when unset (summaries written before it was recorded)
    data_file: str | None = None  # left out when unset (a self-contained .pte)


@dataclass
class LayerPlan:
    """Source-level recipes: each module's scheme in the ``.pte`` (``schemes``), ``counts`` per scheme and the
    recipe's ``rules`` as written (``recipes/layers.py``)."""

    schemes: dict[str, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    rules: list[Any] = field(default_factory=list)


@dataclass
class Timings:
    """Seconds per training step and per deploy stage (None: the stage did not run in this process).

    Args:
        train_steps: QAT: the optimizer steps this process ran (a resumed run: its own).
        train_step_s: Their median wall time (``train.log``'s s/step: from one optimizer step to the next,
            validation left out), the first step left out (its kernels and allocations warm up).
        train_step_s_range: The fastest and slowest of those steps.
        train_device: Where they ran: ``NVIDIA H200 (cuda)``, ``cpu (2 threads)``.
        rounding_s: PTQ that chooses its weights (GPTQ, weighted scales, zero points): the rounding.
        export_quantize_s: The static-KV-cache export and its quantization.
        lower_s: Lowering to the ``.pte``.
        parity_s: The parity gate.
    """

    train_steps: int | None = None
    train_step_s: float | None = None
    train_step_s_range: list[float] | None = None
    train_device: str | None = None
    rounding_s: float | None = None
    export_quantize_s: float | None = None
    lower_s: float | None = None
    parity_s: float | None = None


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
        gguf: A ``model.checkpoint`` that is a ``.gguf`` file (``GgufSource``, ``sources/gguf.py``): the ``file``, its
            ``sha256``, its ``type`` as llama.cpp names it (``Q4_1``, ``Q4_K_M``, ``Q8_0``, ``F16``, ...: the grid its
            weights already sit on) and the float32 directory it was ``converted`` into; absent in other runs.
        distill: QAT with knowledge distillation from the FP model: its settings (``model.distill``); None: without.
        lora: LoRA-QAT: its settings (``model.lora``), the adapted layers and trained parameters; None: full QAT.
        metrics: Per model (``fp``, ``fake_quant``, ``converted``, ``pte``): loss, ppl and their intervals.
        parity: The parity gate's figures and verdict.
        pte: The ``.pte``: path, size_bytes, max_seq_len, export_path, fallback_reason, kv_cache (fp32 or int8).
        layers: Source-level recipes: the per-layer quantization the ``.pte`` got: ``schemes`` ``{module name: scheme}``
            (``8da4w-g32``, ``8da8w-pc``, ``fp``, ...; ``8da8w-pc+split-input``: a head whose input rounds as two int8
            rows, ``split_head_input``), ``counts`` per scheme and the recipe's ``rules`` as written
            (``recipes/layers.py``); None for graph-level (PT2E) and FP recipes.
        coverage: How much of the model the ``.pte`` quantized (``Coverage``, ``deploy/coverage.py``): ``weights``/
            ``bytes`` (the model's linear weights, float bytes), ``quantized``/``quantized_bytes``, ``fraction`` (of
            the bytes; 0 for an FP recipe), the same per recipe rule (``rules``: ``recipe`` or ``layers[i] (match
            ...)``), each float weight with ``why`` (``fp recipe``, ``recipe rule``, ``recipe settings: ...``) and
            ``unused`` linear modules the program never reads; None in summaries written before it was measured.
        timings: Seconds per stage.
        bench: The run's own benchmark (``Bench``, ``runtime/bench.py``; ``qharness bench``).
        bench_joint: This program's part of the sweep's (or ``qharness bench --pte A --pte B``'s) interleaved benchmark
            of all candidates (``JointEntry``: fresh processes, alternating rounds).
        eval: The lm-eval table of the run itself (fit/calibrate/export): plain data, ``{"tasks": {task: {stage:
            {metric: value}}}, "chance": {task: {metric: value}}, ...}`` (keys are task and metric names).
        evaluations: Later ``qharness evaluate`` results, oldest first (never replacing ``eval``), each like ``eval``
            with the ``file`` it was written to and the ``pte_sha256`` of the program it scored.
        answers: Chat/instruction runs: the answer-quality check (``Answers``, ``checks/answers.py``): greedy
            answers of each model to held-out conversations, scored (exact match, ROUGE-L, token F1, agreement with
            the FP model) with 95% bootstrap intervals; absent in other runs.
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
    gguf: GgufSource | None = field(default=None, metadata=OMIT_NONE)
    distill: dict[str, Any] | None = None
    lora: dict[str, Any] | None = None
    metrics: dict[str, Score] = field(default_factory=dict)
    parity: Parity = field(default_factory=Parity)
    pte: PteInfo = field(default_factory=PteInfo)
    layers: LayerPlan | None = None
    coverage: Coverage | None = None
    timings: Timings = field(default_factory=Timings)
    bench: Bench | None = None
    bench_joint: JointEntry | None = None
    eval: dict[str, Any] | None = None
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    answers: Answers | None = field(default=None, metadata=OMIT_NONE)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is not one of {MODES}")
        for f in dataclasses.fields(self):  # sections given as plain data (JSON, a caller's dict) become their types
            if f.name in _TYPED:
                setattr(self, f.name, typed(_hints(RunSummary)[f.name], getattr(self, f.name), f.name))

    @property
    def kind(self) -> str:
        """``fp`` for the unquantized baseline, else ``ptq`` or ``qat``."""
        return self.mode if self.quantized else "fp"

    @property
    def passed(self) -> bool | None:
        """The parity verdict: True, False, or None (not run here)."""
        return self.parity.passed

    def pte_file(self, run_dir: str | Path) -> Path:
        """The run's ``.pte`` in ``run_dir``: ``pte.path`` is recorded as the run was given it (relative to the
        directory it was started from), the file is in the run directory wherever that now is."""
        return Path(run_dir) / Path(self.pte.path or "").name

    def to_dict(self) -> dict:
        """As JSON data, the same as before the sections were typed (``KEEP_NONE``)."""
        return to_jsonable(
            {
                f.name: _plain(getattr(self, f.name))
                for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None or not f.metadata.get("omit_none")
            }
        )

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
        except (TypeError, ValueError) as e:
            raise UserError(
                f"{where} (schema_version {version}): {e}", fix="was it written by another tool or a newer qharness?"
            ) from e

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
        """Set ``sections`` (fields; typed ones as their records or as plain JSON data) of the summary at ``path`` and
        write it back; ``evaluations`` entries are appended."""
        summary = cls.read(path)
        for name, value in sections.items():
            if name == "evaluations":
                summary.evaluations.extend(value)
            elif name in {f.name for f in dataclasses.fields(cls)}:
                setattr(summary, name, typed(_hints(cls)[name], value, name) if name in _TYPED else value)
            else:
                raise KeyError(f"RunSummary has no field {name!r}")
        summary.write(path)
        return summary


_TYPED = ("gguf", "metrics", "parity", "pte", "layers", "coverage", "timings", "bench", "bench_joint", "answers")


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    """The type hints of a summary record's class, resolved once (a report reads thousands of summaries)."""
    return typing.get_type_hints(cls)


def _plain(value):
    """A section as JSON data: a dataclass's fields (unset ones only where ``KEEP_NONE``; empty ones not where
    ``omit_empty``); dicts and lists of them."""
    if dataclasses.is_dataclass(value):
        return {
            f.name: _plain(v)
            for f in dataclasses.fields(value)
            if ((v := getattr(value, f.name)) is not None or f.metadata.get("keep_none"))
            and not (f.metadata.get("omit_empty") and v in ({}, []))
        }
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def typed(hint, value, where: str):
    """``value`` (plain JSON data) as ``hint`` says: dataclasses from dicts (an unknown key is a ``TypeError`` naming
    ``where``), ``X | None``, ``dict[str, X]`` and ``list[X]`` of them; anything else as it is."""
    if value is None or hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return typed(inner[0], value, where) if len(inner) == 1 else value
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"{where} is not a JSON object")
        hints, names = _hints(hint), {f.name for f in dataclasses.fields(hint)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise TypeError(f"{where} has unknown field(s) {', '.join(unknown)}")
        return hint(**{k: typed(hints[k], v, f"{where}.{k}") for k, v in value.items()})
    if origin is dict and isinstance(value, dict):
        return {k: typed(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is list and isinstance(value, list):
        return [typed(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value
