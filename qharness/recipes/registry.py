"""Backend recipes: one YAML file per recipe (built-ins under ``builtin/``); typed settings and builders behind a registry.

A recipe says everything backend-specific: which quantizer (and its settings) to use for QAT and for PTQ, and
which partitioners lower the graph. Users name a recipe; backend authors add a YAML file and, for a new
quantizer, a settings dataclass and a builder registered together with ``@register_quantizer``.

Each quantizer has a *kind*: ``pt2e`` (graph level: observers on the exported graph, then ``convert_pt2e``) or
``source`` (torchao ``quantize_`` on the modules before export). A recipe without a quantizer is ``fp``.

Example::

    recipe = load_recipe("xnnpack_int8_dynamic")
    recipe.kind, recipe.settings                    # "pt2e", XnnpackSettings(per_channel=True, dynamic=True, ...)
    quantizer = recipe.make_quantizer(is_qat=True)  # for prepare_qat_pt2e
    partitioners = recipe.make_partitioners()       # for to_edge_transform_and_lower
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qharness.errors import UserError
from qharness.io.yaml_reader import read_yaml
from qharness.recipes import torchao, vulkan, xnnpack  # noqa: F401  the built-in quantizers and partitioners register here
from qharness.recipes.layers import LayerRule, parse_layers, per_layer
from qharness.recipes.registration import PARTITIONER_BACKENDS, PARTITIONERS, QUANTIZERS, parse_settings

RECIPES_DIR = Path(__file__).resolve().parent / "builtin"
MODES = ("qat", "ptq")


@dataclass(frozen=True)
class Recipe:
    """A backend recipe, as read from ``builtin/<name>.yaml`` or a user's YAML file."""

    name: str
    description: str
    backend: str
    modes: tuple[str, ...] = MODES
    quantizer: str | None = None  # a registered quantizer; None: no quantization
    settings: Any = None  # the quantizer's typed settings (a frozen dataclass)
    partitioners: tuple[str, ...] = ()
    executorch_config: dict[str, Any] = field(default_factory=dict)  # ExecutorchBackendConfig(**...) for to_executorch
    runs_here: bool = True  # False: the .pte needs a device backend this machine lacks; no runtime parity here
    kv_cache: str = "fp32"  # the .pte's KV cache: fp32, or int8 (per token and head; fast path only)
    layers: tuple[LayerRule, ...] = ()  # per-layer settings (recipes/layers.py); first match wins, else ``settings``
    # hadamard: a rotation of the residual stream folded into the FP weights (recipes/rotation.py)
    rotation: str | None = None
    # the name or path it was loaded from (``load_recipe(recipe.source)`` reads it again; not part of equality)
    source: str = field(default="", compare=False)

    @property
    def quantized(self) -> bool:
        return self.quantizer is not None

    @property
    def kind(self) -> str:
        """``fp``, ``pt2e`` or ``source`` (see the module docstring)."""
        return "fp" if self.quantizer is None else QUANTIZERS[self.quantizer].kind

    @property
    def learns_scales(self) -> bool:
        """Whether QAT trains the weight scales and deployment uses them (``learn_scales: true``)."""
        return bool(getattr(self.settings, "learn_scales", False))

    @property
    def embedding(self):
        """The embedding tables' quantization (``recipes/embedding.EmbeddingQuant``: bits, group size), or None: they
        stay float. Source-level recipes quantize them among their steps; PT2E recipes before export. A table the
        output projection does not share takes ``untied_embedding`` instead."""
        return self._table("embedding")

    @property
    def untied_embedding(self):
        """The quantization of a table the output projection does not share (an untied model's input embedding):
        the recipe's ``untied_embedding_bits`` where it sets them, else ``embedding``'s."""
        return self._table("untied_embedding") or self.embedding

    def _table(self, field: str):
        """The ``EmbeddingQuant`` of the settings' ``{field}_bits`` / ``{field}_group_size`` (with
        ``embedding_mapping``), None where the bits are unset."""
        bits = getattr(self.settings, f"{field}_bits", None)
        if bits is None:
            return None
        from qharness.recipes.embedding import EmbeddingQuant

        mapping = getattr(self.settings, "embedding_mapping", "symmetric")
        return EmbeddingQuant(bits, getattr(self.settings, f"{field}_group_size"), mapping)

    def table_quant(self, tied: bool):
        """``embedding`` for a table the output projection shares (``tied``), else ``untied_embedding``."""
        return self.embedding if tied else self.untied_embedding

    @property
    def embedding_scheme(self) -> str:
        """The embedding tables as ``qharness recipes`` and the recipe tables name them: ``w4-g32``, ``w8-pc``, ``fp32``;
        ``w8-pc, untied w4-g32`` where an untied table takes other settings."""
        tied, untied = (q.scheme if q else "fp32" for q in (self.embedding, self.untied_embedding))
        return tied if tied == untied else f"{tied}, untied {untied}"

    @property
    def rounds_with_gptq(self) -> bool:
        """Whether the linear weights are rounded by GPTQ on the calibration blocks (``rounding: gptq``): PTQ deploys
        GPTQ's weights and scales, QAT starts from them (``recipes/gptq.py``)."""
        return getattr(self.settings, "rounding", "nearest") == "gptq"

    @property
    def starts_from_rounding(self) -> bool:
        """Whether QAT starts from the weights, zero-point layers and scales that the recipe's PTQ would deploy
        (``rounding: weighted``, ``zero_points``, ``smoothing`` with ``learn_scales: true``: ``rounding.qat_start``)."""
        return self.learns_scales and getattr(self.settings, "chooses_weights", None) is not None

    def make_quantizer(self, is_qat: bool):
        """The quantizer for QAT (fake-quant training) or PTQ/deploy: a PT2E ``Quantizer`` or a ``SourceQuantizer``."""
        if self.quantizer is None:
            return None
        build = QUANTIZERS[self.quantizer].build
        if self.layers:
            return per_layer(build(self.settings, is_qat), self.layers, lambda settings: build(settings, is_qat))
        return build(self.settings, is_qat)

    def make_partitioners(self) -> list:
        return [PARTITIONERS[p]() for p in self.partitioners]

    def check_mode(self, mode: str) -> None:
        if mode not in self.modes:
            raise UserError(
                f"recipe {self.name!r} does not support mode {mode!r}; it supports {', '.join(self.modes)}",
                fix="pick another recipe (qharness recipes) or mode",
            )


_FIELDS = {
    "description",
    "backend",
    "modes",
    "quantizer",
    "partitioners",
    "executorch_config",
    "runs_here",
    "kv_cache",
    "layers",
    "rotation",
}
ROTATIONS = ("hadamard",)  # a recipe's rotation (recipes/rotation.py)
KV_CACHES = ("fp32", "int8")  # a recipe's kv_cache: the .pte's KV cache in float, or int8 per token and head


def known_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def _is_path(name_or_path: str) -> bool:
    """A recipe given as a YAML path (else a built-in name)."""
    return Path(name_or_path).suffix in (".yaml", ".yml")


def _recipe_path(name_or_path: str, folder: Path | None, what: str) -> Path:
    """The file of a recipe name or path: a built-in name is ``builtin/<name>.yaml``; a relative path is resolved
    against ``folder`` (the folder of the recipe whose ``base:`` names it; None: the working directory, as for
    ``model.recipe``). Not found, or not a regular file: a ``UserError`` saying where it was looked for."""
    from qharness.io.files import file_problem

    known = ", ".join(known_recipes())
    if not _is_path(name_or_path):
        path = RECIPES_DIR / f"{name_or_path}.yaml"
        if path.is_file():
            return path
        if folder is None:
            raise UserError(
                f"unknown recipe {name_or_path!r}", fix=f"use one of: {known} (or a path to a recipe .yaml)"
            )
        raise UserError(
            f"{what}: base {name_or_path!r} is not a known recipe",
            fix=f"use one of: {known}, or a path to a recipe .yaml (a relative one is looked for in {folder})",
        )
    path = Path(name_or_path).expanduser()
    if folder is not None and not path.is_absolute():
        path = folder / path
    problem = file_problem(path)
    if problem is None:
        return path
    if folder is None:
        where = "" if Path(name_or_path).is_absolute() else f" (looked for in the working directory {Path.cwd()})"
        raise UserError(
            f"recipe file {name_or_path} {problem}{where}",
            fix=f"give the path of a recipe .yaml, or one of: {known}",
        )
    where = "" if Path(name_or_path).expanduser().is_absolute() else f" (a relative base is looked for in {folder})"
    raise UserError(
        f"{what}: base {name_or_path!r} {problem}{where}",
        fix=f"give its path relative to {folder}, an absolute path, or a built-in recipe: {known}",
    )


def _read(name_or_path: str, seen: tuple[str, ...] = (), folder: Path | None = None) -> dict[str, Any]:
    """A recipe file's fields merged over its ``base:`` chain; a relative ``base:`` path is resolved against the
    folder of the recipe that names it (never the working directory), ``folder`` for this one (None: the
    working directory)."""
    path = _recipe_path(name_or_path, folder, f"recipe {Path(seen[-1]).name}" if seen else "recipe")
    key = str(path.resolve())
    if key in seen:
        raise UserError(
            f"recipe {path} extends itself through {' -> '.join(seen)}", fix="break the cycle of base: fields"
        )
    raw = read_yaml(path, "recipe") or {}
    if not isinstance(raw, dict):
        raise UserError(
            f"recipe file {path} must hold a mapping of fields", fix="e.g. base: xnnpack_int8_dynamic, then fields"
        )
    unknown = set(raw) - _FIELDS - {"base"}
    if unknown:
        raise UserError(
            f"recipe {path.name}: unknown field(s) {', '.join(sorted(unknown))}",
            fix=f"known fields: base, {', '.join(sorted(_FIELDS))}",
        )
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base:
        raise UserError(
            f"recipe {path.name}: base must be a recipe name or path (got {base!r})", fix="e.g. base: xnnpack_8da4w"
        )
    merged = _read(base, seen + (key,), folder=path.resolve().parent)
    for k, value in raw.items():  # a mapping overrides key by key, anything else replaces
        if isinstance(value, dict) and isinstance(merged.get(k), dict):
            merged[k] = {**merged[k], **value}
        else:
            merged[k] = value
    return merged


def flattened_recipe(name_or_path: str) -> str:
    """The recipe's YAML with its ``base:`` chain merged in: one file that reads the same from any folder (``ship``
    copies a user's recipe this way, where a relative ``base:`` would no longer be found).

    Example: ``flattened_recipe("my_recipe.yaml")`` -> ``"description: ...\nquantizer:\n  name: xnnpack\n..."``
    """
    import yaml

    header = f"# {name_or_path} with its base: chain merged in\n"
    return header + yaml.safe_dump(_read(name_or_path), sort_keys=False)


_EXAMPLE = {"modes": "qat, ptq", "partitioners": "xnnpack"}


def _names(raw: dict, key: str, name: str) -> tuple[str, ...]:
    value = raw.get(key, ())
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise UserError(
            f"recipe {name!r}: {key} must be a list of names (got {value!r})", fix=f"e.g. {key}: [{_EXAMPLE[key]}]"
        )
    return tuple(value)


def load_recipe(name_or_path: str) -> Recipe:
    """Read a recipe by name (``builtin/<name>.yaml``) or path, following ``base:`` chains; settings are typed."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise UserError(
            f"model.recipe must be a recipe name or path (got {name_or_path!r})",
            fix=f"use one of: {', '.join(known_recipes())}",
        )
    raw = _read(name_or_path)
    name = Path(name_or_path).stem
    q = raw.get("quantizer")
    quantizer, settings = None, None
    if q is not None:
        if not isinstance(q, dict) or not isinstance(q.get("name"), str):
            raise UserError(
                f"recipe {name!r}: quantizer must be a mapping with a name (got {q!r})",
                fix="quantizer: {name: xnnpack, ...}",
            )
        q = dict(q)
        quantizer = q.pop("name")
        if quantizer not in QUANTIZERS:
            raise UserError(
                f"recipe {name!r}: unknown quantizer {quantizer!r}",
                fix=f"known quantizers: {', '.join(sorted(QUANTIZERS))}",
            )
        settings = parse_settings(QUANTIZERS[quantizer].settings, q, f"recipe {name!r} quantizer {quantizer!r}")
    partitioners = _names(raw, "partitioners", name)
    for p in partitioners:
        if p not in PARTITIONERS:
            raise UserError(
                f"recipe {name!r}: unknown partitioner {p!r}",
                fix=f"known partitioners: {', '.join(sorted(PARTITIONERS))}",
            )
    modes = _names(raw, "modes", name) if "modes" in raw else MODES
    for m in modes:
        if m not in MODES:
            raise UserError(f"recipe {name!r}: unknown mode {m!r}", fix=f"modes are {', '.join(MODES)}")
    missing = {"description", "backend"} - set(raw)
    if missing:
        raise UserError(f"recipe {name!r} lacks field(s) {', '.join(sorted(missing))}")
    config = raw.get("executorch_config") or {}
    if not isinstance(config, dict):
        raise UserError(f"recipe {name!r}: executorch_config must be a mapping (got {config!r})")
    _check_executorch_config(config, name)
    runs_here = raw.get("runs_here", True)
    if not isinstance(runs_here, bool):
        raise UserError(f"recipe {name!r}: runs_here must be true or false (got {runs_here!r})")
    kv_cache = raw.get("kv_cache", "fp32")
    if kv_cache not in KV_CACHES:
        raise UserError(f"recipe {name!r}: kv_cache must be one of {', '.join(KV_CACHES)} (got {kv_cache!r})")
    rotation = raw.get("rotation")
    if rotation not in (None, *ROTATIONS):
        raise UserError(
            f"recipe {name!r}: rotation must be null or one of {', '.join(ROTATIONS)} (got {rotation!r})",
            fix="rotation: hadamard (or leave it out)",
        )
    _check_backend(name, raw["backend"], quantizer, partitioners)
    kind = "fp" if quantizer is None else QUANTIZERS[quantizer].kind
    layers = parse_layers(raw.get("layers"), name, quantizer, kind, settings)
    return Recipe(
        name=name,
        description=str(raw["description"]),
        backend=str(raw["backend"]),
        modes=modes,
        quantizer=quantizer,
        settings=settings,
        partitioners=partitioners,
        executorch_config=dict(config),
        runs_here=runs_here,
        kv_cache=kv_cache,
        layers=layers,
        rotation=rotation,
        source=name_or_path,
    )


# ExecutorchBackendConfig's fields in ExecuTorch 1.5.1, listed so a recipe is checked without importing ExecuTorch
# (seconds); tests/test_recipes.py compares them with the installed class.
EXECUTORCH_CONFIG_FIELDS = frozenset(
    {
        "constant_tensor_alignment",
        "delegate_alignment",
        "do_quant_fusion_and_const_prop",
        "dynamic_memory_planning_mode",
        "emit_mutable_buffer_names",
        "emit_stacktrace",
        "enable_non_cpu_memory_planning",
        "external_constants",
        "external_mutable_weights",
        "extract_delegate_segments",
        "memory_planning_pass",
        "passes",
        "propagate_device_config",
        "reinplace_extra_ops",
        "remove_view_copy",
        "run_reinplace_pass",
        "segment_alignment",
        "sym_shape_eval_pass",
        "to_out_var_pass",
    }
)


# The fields a YAML recipe can give (YAML holds no Python objects), by kind; the others (passes, memory planning,
# symbolic shapes, ...) take ExecuTorch objects and are refused when the recipe is read.
EXECUTORCH_CONFIG_BOOLS = frozenset(
    {
        "do_quant_fusion_and_const_prop",
        "emit_mutable_buffer_names",
        "emit_stacktrace",
        "enable_non_cpu_memory_planning",
        "external_constants",
        "external_mutable_weights",
        "extract_delegate_segments",
        "remove_view_copy",
        "run_reinplace_pass",
    }
)
EXECUTORCH_CONFIG_ALIGNMENTS = frozenset({"segment_alignment", "constant_tensor_alignment", "delegate_alignment"})
MAX_ALIGNMENT = 1 << 20  # bytes; ExecuTorch pads each segment or tensor to it: more only bloats the .pte
# True would leave the weights in a .ptd file beside the program, which qharness neither writes nor loads
EXECUTORCH_CONFIG_EXTERNAL = frozenset({"external_constants", "external_mutable_weights"})


def _check_executorch_config(config: dict, name: str) -> None:
    """The recipe's ``executorch_config`` checked when it is read, not after training and lowering: unknown
    ``ExecutorchBackendConfig`` fields, fields that take ExecuTorch objects (passes, memory planning), a boolean
    that is not one, an alignment that is not a power of two up to ``MAX_ALIGNMENT`` bytes, and weights sent to an
    external file."""
    known = EXECUTORCH_CONFIG_FIELDS
    unknown = sorted(set(config) - known)
    if unknown:
        raise UserError(
            f"recipe {name!r}: unknown executorch_config field(s) {', '.join(unknown)}",
            fix=f"known: {', '.join(sorted(known))}",
        )
    settable = EXECUTORCH_CONFIG_BOOLS | EXECUTORCH_CONFIG_ALIGNMENTS
    for key, value in config.items():
        if key not in settable:
            raise UserError(
                f"recipe {name!r}: executorch_config.{key} takes ExecuTorch objects (a pass, a planner), which a "
                f"YAML recipe cannot give (got {value!r:.80})",
                fix=f"leave {key} out (ExecuTorch's default); a recipe sets only: {', '.join(sorted(settable))}",
            )
        if key in EXECUTORCH_CONFIG_BOOLS and not isinstance(value, bool):
            raise UserError(
                f"recipe {name!r}: executorch_config.{key} must be true or false (got {value!r:.80})",
                fix=f"executorch_config: {{{key}: true}}",
            )
        if key in EXECUTORCH_CONFIG_EXTERNAL and value:
            raise UserError(
                f"recipe {name!r}: executorch_config.{key}: true would put the weights in a separate .ptd file, "
                "which qharness does not write: the .pte would have no weights",
                fix=f"leave {key} out (or false)",
            )
        if key in EXECUTORCH_CONFIG_ALIGNMENTS and not (
            (value is None and key != "segment_alignment")
            or (
                isinstance(value, int)
                and not isinstance(value, bool)
                and 0 < value <= MAX_ALIGNMENT
                and not value & (value - 1)
            )
        ):
            raise UserError(
                f"recipe {name!r}: executorch_config.{key} must be a power of two of bytes up to {MAX_ALIGNMENT:,}"
                f"{'' if key == 'segment_alignment' else ' (or null)'} (got {value!r:.80})",
                fix=f"e.g. {key}: 128, or leave it out",
            )


def _check_backend(name: str, backend, quantizer: str | None, partitioners: tuple[str, ...]) -> None:
    """``backend:`` names the backend the recipe's quantizer and partitioners target, checked when the recipe is read:
    a quantizer's operators delegated by another backend's partitioner, or ``backend: cuda`` on an XNNPACK recipe,
    would lower and be recorded as something it is not."""
    known = sorted(
        {b for b in PARTITIONER_BACKENDS.values() if b} | {q.backend for q in QUANTIZERS.values() if q.backend}
    )
    if not isinstance(backend, str) or not backend:
        raise UserError(
            f"recipe {name!r}: backend must be a backend's name (got {backend!r})", fix=f"one of: {', '.join(known)}"
        )
    q_backend = QUANTIZERS[quantizer].backend if quantizer else None
    by_partitioner = {p: PARTITIONER_BACKENDS.get(p) for p in partitioners}
    if q_backend:
        other = [p for p, b in by_partitioner.items() if b and b != q_backend]
        if other:
            fitting = sorted(p for p, b in PARTITIONER_BACKENDS.items() if b == q_backend)
            raise UserError(
                f"recipe {name!r}: partitioner {other[0]!r} delegates to {by_partitioner[other[0]]}, but quantizer "
                f"{quantizer!r} quantizes for {q_backend}",
                fix=f"use {q_backend}'s partitioners ({', '.join(fitting)}) with this quantizer, or the quantizer of "
                f"{by_partitioner[other[0]]}",
            )
    targets = sorted({b for b in (q_backend, *by_partitioner.values()) if b})
    if targets and backend not in targets:
        raise UserError(
            f"recipe {name!r}: backend: {backend} does not match its "
            f"{'quantizer' if q_backend else 'partitioners'}, which target {' and '.join(targets)}",
            fix=f"backend: {targets[0]} (or pick a recipe for {backend}: qharness recipes lists them)",
        )
    if not targets and backend not in (*known, "portable"):
        raise UserError(
            f"recipe {name!r}: backend: {backend} is not a backend qharness lowers to (no quantizer or partitioner of "
            f"it: the program runs on ExecuTorch's portable CPU kernels)",
            fix=f"backend: portable, or one of {', '.join(known)} with its partitioners",
        )
