"""Backend recipes: one YAML file per recipe under ``recipes/``; code builders behind a registry.

A recipe says everything backend-specific: which quantizer (and its settings) to use for QAT and for
PTQ, and which partitioners lower the graph. Users name a recipe; backend authors add a YAML file
(and, for a new backend, a builder registered with ``@register_quantizer`` / ``@register_partitioner``).

Example::

    recipe = load_recipe("xnnpack_int8_dynamic")
    quantizer = recipe.quantizer(is_qat=True)       # for prepare_qat_pt2e
    partitioners = recipe.partitioners()            # for to_edge_transform_and_lower
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from qharness.errors import UserError

RECIPES_DIR = Path(__file__).resolve().parent / "builtin"
MODES = ("qat", "ptq")

_QUANTIZERS: dict[str, Callable[..., Any]] = {}
_PARTITIONERS: dict[str, Callable[..., Any]] = {}


def register_quantizer(name: str):
    """Register ``builder(settings: dict, is_qat: bool) -> Quantizer`` under ``name``."""

    def wrap(builder):
        _QUANTIZERS[name] = builder
        return builder

    return wrap


def register_partitioner(name: str):
    """Register ``builder() -> Partitioner`` under ``name``."""

    def wrap(builder):
        _PARTITIONERS[name] = builder
        return builder

    return wrap


@dataclass(frozen=True)
class Recipe:
    """A backend recipe, as read from ``recipes/<name>.yaml``."""

    name: str
    description: str
    backend: str
    modes: tuple[str, ...] = MODES
    quantizer: dict[str, Any] | None = None  # {"name": registered quantizer, **settings}; None: no quantization
    partitioners: tuple[str, ...] = ()
    executorch_config: dict[str, Any] = field(default_factory=dict)  # ExecutorchBackendConfig(**...) for to_executorch
    runs_here: bool = True  # False: the .pte needs a device backend this machine lacks; no runtime parity here

    @property
    def quantized(self) -> bool:
        return self.quantizer is not None

    def make_quantizer(self, is_qat: bool):
        """The quantizer for QAT (fake-quant training) or PTQ/deploy: a PT2E ``Quantizer`` (graph level:
        observers, then ``convert_pt2e``) or a ``SourceQuantizer`` (torchao ``quantize_`` on modules)."""
        if self.quantizer is None:
            return None
        settings = dict(self.quantizer)
        return _QUANTIZERS[settings.pop("name")](settings, is_qat=is_qat)

    def make_partitioners(self) -> list:
        return [_PARTITIONERS[p]() for p in self.partitioners]

    def check_mode(self, mode: str) -> None:
        if mode not in self.modes:
            raise UserError(
                f"recipe {self.name!r} does not support mode {mode!r}; it supports {', '.join(self.modes)}",
                fix="pick another recipe (qharness recipes) or mode",
            )


@dataclass
class SourceQuantizer:
    """Source-level quantization with torchao's ``quantize_``: the same configs drive QAT fake-quant
    (``QATConfig(config, step="prepare")`` swaps in fake-quantized modules) and deployment
    (``quantize_(model, config)`` swaps weights for quantized tensor subclasses that lower to XNNPACK).

    ``configs`` holds ``(torchao config, filter_fn)`` pairs applied in order.
    """

    configs: list

    def prepare_qat(self, model) -> None:
        from torchao.quantization import quantize_
        from torchao.quantization.qat import QATConfig

        for config, filter_fn in self.configs:
            quantize_(model, QATConfig(config, step="prepare"), filter_fn=filter_fn)

    def convert(self, model) -> None:
        """Quantize the (trained, plain FP) model in place for deployment."""
        from torchao.quantization import quantize_

        for config, filter_fn in self.configs:
            quantize_(model, config, filter_fn=filter_fn)


_FIELDS = {f.name for f in dataclasses.fields(Recipe)} - {"name"}


def known_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _read(name_or_path: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = RECIPES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise UserError(
            f"unknown recipe {name_or_path!r}",
            fix=f"use one of: {', '.join(known_recipes())} (or a path to a recipe .yaml)",
        )
    if str(path) in seen:
        raise UserError(f"recipe {path} extends itself through {' -> '.join(seen)}")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise UserError(f"recipe file {path} must hold a mapping of fields")
    unknown = set(raw) - _FIELDS - {"base"}
    if unknown:
        raise UserError(
            f"recipe {path.name}: unknown field(s) {', '.join(sorted(unknown))}",
            fix=f"known fields: base, {', '.join(sorted(_FIELDS))}",
        )
    base = raw.pop("base", None)
    if base is None:
        return raw
    merged = _read(base, seen + (str(path),))
    for key, value in raw.items():  # a mapping overrides key by key, anything else replaces
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def load_recipe(name_or_path: str) -> Recipe:
    """Read a recipe by name (``recipes/<name>.yaml``) or path, following ``base:`` chains."""
    raw = _read(name_or_path)
    name = Path(name_or_path).stem
    _register_builtins()
    q = raw.get("quantizer")
    if q is not None and q.get("name") not in _QUANTIZERS:
        raise UserError(
            f"recipe {name!r}: unknown quantizer {q.get('name')!r}", fix=f"known quantizers: {', '.join(sorted(_QUANTIZERS))}"
        )
    for p in raw.get("partitioners", ()):
        if p not in _PARTITIONERS:
            raise UserError(
                f"recipe {name!r}: unknown partitioner {p!r}", fix=f"known partitioners: {', '.join(sorted(_PARTITIONERS))}"
            )
    for m in raw.get("modes", MODES):
        if m not in MODES:
            raise UserError(f"recipe {name!r}: unknown mode {m!r}", fix=f"modes are {', '.join(MODES)}")
    missing = {"description", "backend"} - set(raw)
    if missing:
        raise UserError(f"recipe {name!r} lacks field(s) {', '.join(sorted(missing))}")
    return Recipe(
        name=name,
        description=raw["description"],
        backend=raw["backend"],
        modes=tuple(raw.get("modes", MODES)),
        quantizer=q,
        partitioners=tuple(raw.get("partitioners", ())),
        executorch_config=dict(raw.get("executorch_config") or {}),
        runs_here=bool(raw.get("runs_here", True)),
    )


# --- built-in builders ----------------------------------------------------------------------------
# Weight ranges XNNPACK lowers natively: int8 symmetric [-127, 127] (its quantizer's default) and
# int4 [-8, 7], the only range its partitioner maps to 4-bit weights (qc4w); [-7, 7] stays int8.
_XNNPACK_WEIGHT_RANGES = {8: (-127, 127), 4: (-8, 7)}
_BUILTINS_DONE = False


def _register_builtins() -> None:
    global _BUILTINS_DONE
    if _BUILTINS_DONE:
        return
    _BUILTINS_DONE = True

    @register_quantizer("xnnpack")
    def _xnnpack(settings: dict, is_qat: bool):
        """XNNPACK PT2E quantizer. settings: per_channel (bool), dynamic (bool), weight_bits (4 or 8)."""
        from qharness.upstream import imports
        from qharness.upstream.fixes import xnnpack_scalars

        allowed = {"per_channel", "dynamic", "weight_bits", "activation_observer"}
        unknown = set(settings) - allowed
        if unknown:
            raise UserError(f"xnnpack quantizer: unknown setting(s) {sorted(unknown)}", fix=f"known: {sorted(allowed)}")
        bits = int(settings.get("weight_bits", 8))
        if bits not in _XNNPACK_WEIGHT_RANGES:
            raise UserError(f"xnnpack quantizer: weight_bits={bits} is not supported", fix="use 4 or 8")
        qmin, qmax = _XNNPACK_WEIGHT_RANGES[bits]
        config = imports.xnnpack_symmetric_config(
            is_per_channel=bool(settings.get("per_channel", True)),
            is_dynamic=bool(settings.get("dynamic", True)),
            is_qat=is_qat,
            weight_qmin=qmin,
            weight_qmax=qmax,
        )
        if is_qat:
            config = _deploy_matched_weight_fake_quant(config)
        elif not settings.get("dynamic", True):
            config = _with_activation_observer(config, settings.get("activation_observer", "histogram"))
        elif "activation_observer" in settings:
            raise UserError("xnnpack quantizer: activation_observer applies to static activations only (dynamic: false)")
        return xnnpack_scalars.xnnpack_quantizer_cls()().set_global(config)

    @register_quantizer("torchao_8da4w")
    def _torchao_8da4w(settings: dict, is_qat: bool):
        """torchao int8 dynamic per-token activations + intN grouped weights on every nn.Linear, optionally
        weight-only embedding quantization. settings: group_size (32), weight_bits (4), embedding_bits (null/4/8),
        choose_qparams (``affine``: min-max scales, what QAT's fake quantization trains against; ``hqq_scale_only``:
        HQQ-optimised scales, export_llm's default for 8da4w PTQ, for PTQ-only recipes)."""
        import torch
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup

        allowed = {"group_size", "weight_bits", "embedding_bits", "choose_qparams"}
        unknown = set(settings) - allowed
        if unknown:
            raise UserError(f"torchao_8da4w quantizer: unknown setting(s) {sorted(unknown)}", fix=f"known: {sorted(allowed)}")
        bits = {4: torch.int4, 8: torch.int8}
        weight_bits = int(settings.get("weight_bits", 4))
        emb_bits = settings.get("embedding_bits")
        if weight_bits not in bits or (emb_bits is not None and int(emb_bits) not in bits):
            raise UserError("torchao_8da4w quantizer: weight_bits and embedding_bits must be 4 or 8")
        group = int(settings.get("group_size", 32))
        algorithm = settings.get("choose_qparams", "affine")
        if algorithm not in ("affine", "hqq_scale_only"):
            raise UserError(f"torchao_8da4w quantizer: choose_qparams {algorithm!r} is unknown", fix="use affine or hqq_scale_only")
        if is_qat and algorithm != "affine":
            raise UserError(f"torchao_8da4w quantizer: choose_qparams {algorithm!r} has no QAT fake quantization (it trains affine scales)",
                            fix="use it in PTQ-only recipes (modes: [ptq]), or choose_qparams: affine")
        configs = [
            (
                Int8DynamicActivationIntxWeightConfig(weight_dtype=bits[weight_bits], weight_granularity=PerGroup(group),
                                                      intx_choose_qparams_algorithm=algorithm),
                lambda m, fqn: isinstance(m, torch.nn.Linear) and m.in_features % group == 0,
            )
        ]
        if emb_bits is not None:
            configs.append(
                (
                    IntxWeightOnlyConfig(weight_dtype=bits[int(emb_bits)], granularity=PerGroup(group)),
                    lambda m, fqn: isinstance(m, torch.nn.Embedding),
                )
            )
        return SourceQuantizer(configs)

    @register_quantizer("vulkan")
    def _vulkan(settings: dict, is_qat: bool):
        """Vulkan PT2E quantizer. settings: weight_bits (4 or 8), dynamic (false: weight-only)."""
        from executorch.backends.vulkan.quantizer.vulkan_quantizer import get_symmetric_quantization_config

        from qharness.upstream.fixes import vulkan

        allowed = {"weight_bits", "dynamic"}
        unknown = set(settings) - allowed
        if unknown:
            raise UserError(f"vulkan quantizer: unknown setting(s) {sorted(unknown)}", fix=f"known: {sorted(allowed)}")
        if settings.get("dynamic", False):
            raise UserError("vulkan quantizer: dynamic activations are not supported yet", fix="use dynamic: false (weight-only)")
        config = get_symmetric_quantization_config(is_dynamic=False, weight_bits=int(settings.get("weight_bits", 8)))
        return vulkan.vulkan_quantizer_cls()().set_global(config)

    from qharness.upstream import imports
    from qharness.upstream.fixes import vulkan

    register_partitioner("vulkan")(vulkan.vulkan_partitioner)

    register_partitioner("xnnpack")(lambda: imports.xnnpack_partitioner(dynamic_quant=False))
    register_partitioner("xnnpack_dynamic_quant")(lambda: imports.xnnpack_partitioner(dynamic_quant=True))


def _deploy_matched_weight_fake_quant(config):
    """Make QAT weight fake-quant compute the scale ``convert_pt2e`` will use at deploy time.

    The stock QAT config uses ``FusedMovingAvgObsFakeQuantize`` whose moving-average range (and fused
    kernel) gives scales that differ from the min-max observer used when converting, so the trained
    model and the ``.pte`` disagree. A plain ``FakeQuantize`` with a min-max observer that tracks the
    current weights (``averaging_constant=1``) gives exactly the deploy-time ``amax / qmax``.
    """
    import torch

    from qharness.upstream import imports

    ns = imports.pt2e()
    w = config.weight
    per_channel = w.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine)
    observer = ns.MovingAveragePerChannelMinMaxObserver if per_channel else ns.MovingAverageMinMaxObserver
    ctr = ns.FakeQuantize.with_args(observer=observer.with_args(averaging_constant=1.0), eps=2**-12)
    return dataclasses.replace(config, weight=dataclasses.replace(w, observer_or_fake_quant_ctr=ctr))


def _with_activation_observer(config, name: str):
    """Static PTQ activations observed with ``histogram`` (XNNPACK's default), ``minmax`` or ``moving_average``."""
    from qharness.upstream import imports

    ns = imports.pt2e()
    observers = {"histogram": ns.HistogramObserver, "minmax": ns.MinMaxObserver, "moving_average": ns.MovingAverageMinMaxObserver}
    if name not in observers:
        raise UserError(f"xnnpack quantizer: unknown activation_observer {name!r}", fix=f"use one of {', '.join(observers)}")
    ctr = observers[name].with_args(eps=2**-12)
    act = dataclasses.replace(config.input_activation, observer_or_fake_quant_ctr=ctr)
    return dataclasses.replace(config, input_activation=act, output_activation=act)
