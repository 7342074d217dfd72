"""The coverage record (``summary.json``'s ``coverage``): what ``coverage.measure`` finds, as frozen dataclasses whose
fields are the JSON keys (``RunSummary`` reads and writes it; no torch here, so the report reads it without torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RuleCoverage:
    """One recipe rule (``recipe`` or ``layers[i] (match ...)``): its linear weights and their float bytes, and how
    many of them (and of those bytes) the program quantized."""

    rule: str
    weights: int
    bytes: int
    quantized: int
    quantized_bytes: int


@dataclass(frozen=True)
class FloatWeight:
    """A linear weight the program reads in floating point: its rule, ``why`` (``fp recipe``, ``recipe rule``,
    ``recipe settings: ...``, else the op that computes it), whether that is a ``failure``, the ``op``, its ``bytes``."""

    rule: str
    why: str
    failure: bool
    op: str
    bytes: int


KEEP_NONE = {"keep_none": True}  # written as null in summary.json (``run/summary.py``): float, per row, untied


@dataclass(frozen=True)
class EmbeddingTable:
    """An embedding table as the program stores it: ``bits`` (None: float) and ``group_size`` (None: one scale per
    row) as quantized, its float ``bytes`` and the ``stored_bytes`` of the lookup table in the program; for a table an
    output head shares (``tied_to``), ``shared`` says whether one table serves both, and ``note`` why not and what
    the second copy costs."""

    bits: int | None = field(metadata=KEEP_NONE)
    group_size: int | None = field(metadata=KEEP_NONE)
    bytes: int
    stored_bytes: int
    tied_to: str | None = field(default=None, metadata=KEEP_NONE)
    shared: bool = False
    note: str | None = None


@dataclass(frozen=True)
class Convolution:
    """A convolution weight the program reads (a recurrent layer's short convolution, e.g. LFM2's depthwise
    ``conv1d``): outside the linear counts; ``quantized`` or float, its float ``bytes``, the ``op``, and ``note``: why
    a float one stays float."""

    op: str
    bytes: int
    quantized: bool
    note: str | None = None


CONV_FLOAT = (
    "the recipe quantizes linear projections: a recurrent layer's depthwise convolution and the state it keeps run "
    "in float (ExecuTorch's portable conv kernel: XNNPACK's partitioner leaves a depthwise conv1d over a dynamic length)"
)
CONV_MULTIPLY_ADDS = (
    "the recipe quantizes linear projections: a recurrent layer's depthwise convolution and the state it keeps run "
    "in float, as one multiply-add per kernel tap over the window in XNNPACK's delegate (a depthwise conv1d over a "
    "dynamic length would run in ExecuTorch's portable conv kernel)"
)


@dataclass(frozen=True)
class Coverage:
    """How much of the model the ``.pte`` quantized: the model's linear ``weights`` and their float ``bytes``, how
    many (``quantized``, ``quantized_bytes``) the program quantized, ``fraction`` of the bytes (0 for an FP recipe),
    the same per recipe rule (``rules``), each float weight by name (``float``), the linear modules the program
    never reads (``unused``, counted nowhere), the embedding tables it looks up (``embeddings``, by module name;
    not part of the linear counts) and the convolution weights it reads (``convolutions``, likewise apart)."""

    weights: int
    bytes: int
    quantized: int
    quantized_bytes: int
    fraction: float
    rules: list[RuleCoverage] = field(default_factory=list)
    float: dict[str, FloatWeight] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    # left out of summary.json while empty: summaries of runs without quantized tables read and write the same
    embeddings: dict[str, EmbeddingTable] = field(default_factory=dict, metadata={"omit_empty": True})
    convolutions: dict[str, Convolution] = field(default_factory=dict, metadata={"omit_empty": True})

    def failures(self) -> dict[str, str]:
        """``{weight name: why}`` of the float weights the recipe meant to quantize."""
        return {n: f.why for n, f in self.float.items() if f.failure}
