"""How quantizers and partitioners register: a settings type, a kind and a builder per name (torchao's pattern).

Example::

    @dataclass(frozen=True)
    class MySettings:
        bits: int = 4

    @register_quantizer("mine", MySettings, kind="pt2e")
    def my_quantizer(settings: MySettings, is_qat: bool): ...
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from qharness.errors import UserError
from qharness.sources.models import tied_tables

log = logging.getLogger(__name__)

KINDS = ("pt2e", "source")


@dataclass(frozen=True)
class QuantizerEntry:
    """A registered quantizer: its settings type, its kind and ``build(settings, is_qat) -> quantizer``."""

    settings: type
    kind: str
    build: Callable[[Any, bool], Any]
    backend: str | None = None  # the backend its quantized graph lowers to (a recipe's ``backend:`` must name it)


QUANTIZERS: dict[str, QuantizerEntry] = {}
PARTITIONERS: dict[str, Callable[[], Any]] = {}
PARTITIONER_BACKENDS: dict[str, str | None] = {}  # partitioner name -> the backend it delegates to


def register_quantizer(name: str, settings: type, kind: str, backend: str | None = None):
    """Register ``builder(settings, is_qat) -> quantizer`` under ``name``; ``settings`` is the frozen dataclass
    a recipe's ``quantizer:`` mapping is read into (type-checked, then its ``__post_init__`` checks ranges);
    ``backend``: the backend its quantized operators are meant for (a recipe's ``backend:`` and partitioners must
    match it, checked when the recipe is read; None: not checked)."""
    if kind not in KINDS:
        raise ValueError(f"quantizer kind {kind!r}: use one of {KINDS}")

    def wrap(builder):
        QUANTIZERS[name] = QuantizerEntry(settings, kind, builder, backend)
        return builder

    return wrap


def register_partitioner(name: str, backend: str | None = None):
    """Register ``builder() -> Partitioner`` under ``name``; ``backend``: the backend it delegates to (a recipe's
    ``backend:`` must name it; None: not checked)."""

    def wrap(builder):
        PARTITIONERS[name] = builder
        PARTITIONER_BACKENDS[name] = backend
        return builder

    return wrap


@dataclass(frozen=True)
class SourceConfig:
    """One ``quantize_`` step of a source-level recipe: a torchao config, ``select(module, fqn)`` picking the modules
    it quantizes, what those are (for messages), whether QAT learns their weight scales (LSQ, torchao's range
    learning) for deployment to use as trained, the name of the scheme it gives a module (``summary.json``'s
    ``layers``, e.g. ``8da4w-g32``), whether selecting no module is an error (per-layer recipes check their
    rules instead, ``recipes/layers.py``), whether its linears are rounded by GPTQ (``recipes/gptq.py``) or by
    ``recipes/rounding.py`` (weighted scales, zero points: ``rounded``), the glob patterns of the linears whose
    groups take a zero point (``recipes/zero_points.py``), and for an embedding step which tables it takes (``tied``:
    True, only a table the output projection shares; False, only one it does not; None, either)."""

    config: Any
    select: Callable[[Any, str], bool]
    what: str
    learn_scales: bool = False
    scheme: str = "quantized"
    required: bool = True
    gptq: bool = False
    rounded: bool = False
    zero_points: tuple[str, ...] = ()
    check_model: Callable[[Any], None] | None = (
        None  # more checks of the model (a ``UserError`` when it cannot take it)
    )
    tied: bool | None = None
    # a ``UserError`` for a module the step selects but cannot quantize (a table its groups do not split)
    refuse: Callable[[Any, str], None] | None = None

    def takes(self, m, name: str, tied_tables: frozenset[str]) -> bool:
        """Whether this step quantizes module ``m`` called ``name``, given the model's tied tables (``tied_tables``,
        ``sources.models.tied_tables``: taken before any step swaps a weight)."""
        return self.select(m, name) and (self.tied is None or (name in tied_tables) == self.tied)

    @property
    def scales_given(self) -> bool:
        """Whether deployment quantizes this step's weights with given scales (trained, GPTQ's, or rounding's) when it
        has them."""
        return self.learn_scales or self.gptq or self.rounded


@dataclass
class SourceQuantizer:
    """Source-level quantization with torchao's ``quantize_``: the same configs drive QAT fake-quant
    (``QATConfig(config, step="prepare")`` swaps in fake-quantized modules) and deployment
    (``quantize_(model, config)`` swaps weights for quantized tensor subclasses that lower to XNNPACK).

    ``configs`` holds ``SourceConfig`` steps applied in order; a config that selects no module of the model is an
    error (a recipe that quantizes nothing must not ship as quantized). Steps with ``learn_scales`` train their
    weight scales (``recipes/learned_scales.py``) and ``convert(model, weight_qparams)`` quantizes with the trained
    ones (else min-max of the weights). ``split_head_input``: after either swap, the output projection rounds its
    input as two int8 rows (``recipes/split_input.py``).
    """

    configs: list[SourceConfig]
    split_head_input: bool = False

    def assignment(self, model) -> dict[str, str]:
        """``{module name: scheme}`` of every module of ``model`` (not yet quantized) that a step quantizes; a head
        that ``split_head_input`` splits is labelled as such (``8da8w-pc+split-input``: what the summary shows)."""
        out = {name: step.scheme for name, _, step in self.owners(model)}
        if self._splits(model):
            from qharness.recipes.split_input import SPLIT, head_name

            head = head_name(model)
            if head in out:
                out[head] += SPLIT
        return out

    def owners(self, model):
        """``(name, module, step)`` for each module of ``model`` that a step quantizes: the first step that takes it
        (tied tables read once, before any step swaps a weight)."""
        tables = tied_tables(model)
        for name, m in model.named_modules():
            step = next((s for s in self.configs if s.takes(m, name, tables)), None)
            if step is not None:
                yield name, m, step

    def check(self, model) -> dict[str, str]:
        """``assignment(model)``, after checking that every required step selects a module of ``model`` (a recipe that
        quantizes nothing must not ship as quantized): a ``UserError`` before anything is trained or changed."""
        tables = tied_tables(model)
        for step in self.configs:
            if step.required and not any(step.takes(m, name, tables) for name, m in model.named_modules()):
                raise UserError(
                    f"the recipe's {type(step.config).__name__} selects no layer of {type(model).__name__} ({step.what})",
                    fix="choose settings that fit the model (e.g. a group_size that divides its hidden sizes)",
                )
            if step.check_model is not None:
                step.check_model(model)
        self.refuse_unfit(model)
        layers = self.assignment(model)
        self.check_split(model, layers)
        return layers

    def refuse_unfit(self, model) -> None:
        """A ``UserError`` for a module that the step owning it cannot quantize (``SourceConfig.refuse``: a table
        whose rows its groups do not split), before anything is trained or changed."""
        for name, m, step in self.owners(model):
            if step.refuse is not None:
                step.refuse(m, name)

    def _apply(self, model, wrap) -> None:
        from torchao.quantization import quantize_

        tables = tied_tables(model)  # before the head's step gives the head a weight of its own
        for step in self.configs:
            if any(step.takes(m, name, tables) for name, m in model.named_modules()):
                quantize_(model, wrap(step), filter_fn=lambda m, name, step=step: step.takes(m, name, tables))

    def prepare_qat(self, model) -> dict[str, str]:
        """Swap in torchao's fake-quantized modules (learned-scale steps: scales set by ``init_source_scales``);
        returns the assignment (``check``)."""
        from qharness.recipes.learned_scales import range_learning_qat_config
        from qharness.upstream.fixes import torchao_zero_groups, xnnpack_bf16_scales

        layers = self.check(model)
        # torchao gives an all-zero group (a zero padding row of a tied table) the scale 1.2e-38, whose gradient then
        # passes through subnormal floats: rounded, and unlike under another loss scaling (FSDP vs accumulation)
        torchao_zero_groups.install()
        self._apply(
            model,
            lambda step: (
                range_learning_qat_config(step.config)
                if step.learn_scales
                else xnnpack_bf16_scales.qat_config(step.config)
            ),
        )
        self._split(model)
        return layers

    def _splits(self, model) -> bool:
        """Whether ``split_head_input`` splits ``model``'s head: a model without an output projection (``qharness
        sensitivity``'s copies of single layers) is not split."""
        return self.split_head_input and hasattr(model, "get_output_embeddings")

    def _split(self, model) -> None:
        if self._splits(model):
            from qharness.recipes.split_input import split_head_input

            split_head_input(model)

    def check_split(self, model, layers: dict[str, str]) -> None:
        """With ``split_head_input``, a ``UserError`` unless the output projection is among ``layers``' quantized."""
        if not self._splits(model):
            return
        from qharness.recipes.split_input import head_name

        name = head_name(model)
        if layers.get(name) in (None, "fp"):
            raise UserError(
                f"quantizer split_head_input: {type(model).__name__}'s output projection ({name}) is not quantized "
                "by the recipe, so its input is never rounded",
                fix="quantize the output projection, or drop split_head_input",
            )

    def convert(self, model, weight_qparams: dict | None = None) -> dict[str, str]:
        """Quantize the (trained, plain FP) model in place for deployment. With ``weight_qparams`` (``{weight name:
        (scale, zero_point)}`` as trained, or as GPTQ chose them) the learned-scale and GPTQ steps take torchao's
        range-learning path: fake quantizers holding the given scales, then ``QATConfig(config, step="convert")``
        quantizes each weight with its quantizer's scale (min-max off); the other steps quantize with min-max as
        without. Returns the assignment (``check``)."""
        from qharness.upstream import imports
        from qharness.upstream.fixes import xnnpack_subbyte

        layers = self.check(model)
        qat = imports.torchao_qat()
        learned = weight_qparams is not None
        if learned:
            from qharness.recipes.learned_scales import use_source_scales

            if not any(step.scales_given for step in self.configs):
                raise ValueError("weight scales given to a recipe that neither learns nor GPTQ-rounds any")
            given = [dataclasses.replace(step, learn_scales=True) for step in self.configs if step.scales_given]
            SourceQuantizer(given).prepare_qat(model)  # range-learning fake quantizers: they hold the given scales
            use_source_scales(model, weight_qparams)
        self._apply(
            model,
            lambda step: qat.QATConfig(step.config, step="convert") if learned and step.scales_given else step.config,
        )
        subbyte = xnnpack_subbyte.store_as_int4(model)  # 2/3-bit values, stored as XNNPACK's int4
        if subbyte:
            log.info(
                "%d layers' %s weights are stored as int4 (XNNPACK lowers 4- and 8-bit weights)",
                len(subbyte),
                "/".join(sorted(set(subbyte.values()))),
            )
        self._split(model)
        return layers


def _type_name(t) -> str:
    return (
        " or ".join("null" if a is type(None) else a.__name__ for a in typing.get_args(t))
        if typing.get_args(t)
        else t.__name__
    )


def _fits(value, t) -> bool:
    """Whether a YAML value has the annotated type (bool is no int, an int is a float)."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(t))
    if t is type(None):
        return value is None
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, t)


def parse_settings(cls: type, raw: dict, where: str):
    """``cls(**raw)`` after checking every key is a field of ``cls`` and every value has the field's type."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise UserError(f"{where}: unknown setting(s) {', '.join(unknown)}", fix=f"known settings: {', '.join(fields)}")
    for key, value in raw.items():
        if not _fits(value, hints[key]):
            raise UserError(
                f"{where}: {key}={value!r} must be {_type_name(hints[key])}",
                fix=f"give {key} a {_type_name(hints[key])} value",
            )
    return cls(**raw)
