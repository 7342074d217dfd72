"""Fast validation of a run config, before torch and Lightning load: a bad config fails in about a second.

``qharness fit|validate|test|calibrate|export|evaluate|sensitivity|autotune`` read their ``--config`` files and dotted overrides
(``--model.lr -1``, ``--model.lr=-1``) here and check what needs no torch: the YAML itself, the top-level
sections, the fields and values of ``model`` (``check_model_args``: lr, warmup, recipe and mode), ``data``
(``check_data_args``: sizes, the source path), the typed sections of ``qharness.config``, and ``trainer`` and
``checkpoint`` against Lightning's own ``Trainer``/``ModelCheckpoint`` signatures (``lightning_annotations``) with the
values Lightning refuses only when it builds them (``check_trainer``, ``check_checkpoint``); then the cache directory. What it cannot
interpret passes: LightningCLI checks the whole config afterwards, so this never rejects a config it accepts.

Example::

    precheck(["fit", "--config", "bad.yaml", "--model.lr", "-1"])   # UserError: model.lr must be positive (got -1)
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import re
import tempfile
from pathlib import Path

import yaml

import qharness
from qharness.config import (
    BenchConfig,
    CalibrationConfig,
    EvalConfig,
    ExportConfig,
    ParityConfig,
    WandbConfig,
    check_eval_lengths,
    check_lengths,
    deep_merge,
)
from qharness.data.args import check_data_args
from qharness.errors import UserError
from qharness.io import check_name, load_yaml, read_yaml
from qharness.sources.models import EMBEDDED, check_local_checkpoint
from qharness.sources.torchtune import PREFIX as TORCHTUNE
from qharness.training.model_args import Distill, LoRA, check_model_args, check_precision

SECTIONS = {
    "deploy": ExportConfig,
    "parity": ParityConfig,
    "calibration": CalibrationConfig,
    "bench": BenchConfig,
    "eval": EvalConfig,
    "wandb": WandbConfig,
}
# Top-level keys of the subcommands' configs (``qharness fit --print_config``; evaluate adds its options).
TOP_LEVEL = {"seed_everything", "trainer", "model", "data", "checkpoint", "ckpt_path", "weights_only", "verbose"}
TOP_LEVEL |= set(SECTIONS) | {"pte", "tasks", "limit", "num_fewshot", "models"}
TOP_LEVEL |= {"candidates", "unit", "against"}  # sensitivity's options
AUTOTUNE_KEYS = {"max_size_mb", "sensitivity"}  # autotune's: unknown to the other subcommands
TOP_LEVEL |= AUTOTUNE_KEYS
# Lightning's own classes behind the trainer and checkpoint groups: their fields and types are read from
# Lightning's source (``lightning_annotations``), not copied here.
LIGHTNING_CLASSES = {
    "trainer": ("pytorch/trainer/trainer.py", "Trainer"),
    "checkpoint": ("pytorch/callbacks/model_checkpoint.py", "ModelCheckpoint"),
}
_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off"}  # what jsonargparse takes for a bool given as text
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
_NO_CHECK = object()  # an argument default that is not a literal


def init_defaults(relpath: str, cls: str) -> dict:
    """``{argument: default}`` of ``cls.__init__`` in the qharness source file ``relpath``, read with ``ast``
    (importing it would load torch); a non-literal default is ``_NO_CHECK``, no default ``None``."""
    for node in ast.parse((Path(qharness.__file__).parent / relpath).read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            init = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            names = [a.arg for a in init.args.args[1:]]
            defaults = [None] * (len(names) - len(init.args.defaults)) + list(init.args.defaults)
            return {n: _literal(d) for n, d in zip(names, defaults)}
    raise LookupError(f"{cls} not in {relpath}")


def init_annotations(relpath: str, cls: str) -> dict[str, str]:
    """``{argument: annotation source}`` of ``cls.__init__`` in the qharness source file ``relpath`` (``ast``)."""
    for node in ast.parse((Path(qharness.__file__).parent / relpath).read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            init = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            return {a.arg: ast.unparse(a.annotation) if a.annotation else "" for a in init.args.args[1:]}
    raise LookupError(f"{cls} not in {relpath}")


def _union_text(node: ast.expr) -> str:
    """An annotation as ``a | b | None`` text (``Optional[X]`` and ``Union[a, b]`` spelled out), as ``_fits`` reads it."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in ("Optional", "Union"):
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return " | ".join([*map(_union_text, items), *(["None"] if node.value.id == "Optional" else [])])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return f"{_union_text(node.left)} | {_union_text(node.right)}"
    return ast.unparse(node)


@functools.lru_cache(maxsize=None)
def lightning_annotations(group: str) -> dict[str, str]:
    """``{field: annotation}`` of the Lightning class behind the ``trainer`` or ``checkpoint`` group, read from
    Lightning's installed source with ``ast`` (importing Lightning takes seconds); {} when it cannot be read."""
    import importlib.util

    relpath, cls = LIGHTNING_CLASSES[group]
    try:
        spec = importlib.util.find_spec("lightning")
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / relpath).read_text())
    except (ImportError, AttributeError, TypeError, OSError, SyntaxError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            init = next(f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            args = [*init.args.args[1:], *init.args.kwonlyargs]
            return {a.arg: _union_text(a.annotation) if a.annotation else "" for a in args}
    return {}


def _split_union(annotation: str) -> list[str]:
    """``"int | list[str] | None"`` -> ``["int", "list[str]", "None"]`` (``|`` at bracket depth 0)."""
    parts, depth, cur = [], 0, ""
    for ch in annotation:
        depth += ch in "[(" and 1 or (ch in "])" and -1 or 0)
        if ch == "|" and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*parts, cur.strip()]


def _fits(value, part: str) -> bool | None:
    """Whether ``value`` is of the type ``part`` as jsonargparse reads it; None when this check does not know it."""
    if part == "None":
        return value is None
    if part == "bool":
        return isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in _BOOL_WORDS)
    if part in ("int", "float"):
        return _number(value, int if part == "int" else float) is not None
    if part.startswith("list["):
        return isinstance(value, list)
    if part.startswith("Literal["):
        return value in ast.literal_eval("(" + part[len("Literal[") : -1] + ",)")
    return None  # str (an override's text may read as a number), classes, ...


_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "None": "null"}


def check_types(section: str, values: dict, annotations: dict[str, str]) -> None:
    """``UserError`` naming the first field of ``values`` whose value its annotation cannot take (only the types
    ``_fits`` knows: int, float, bool, None, lists, literals; numeric text counts as a number, as in jsonargparse).

    Example: ``check_types("trainer", {"max_steps": "abc"}, {"max_steps": "int"})`` -> UserError: trainer.max_steps
    must be an integer (got 'abc')
    """
    for name, value in values.items():
        parts = _split_union(annotations.get(name) or "")
        fits = [_fits(value, part) for part in parts]
        if not any(fits) and None not in fits:
            field = f"{section}.{name}" if section else name
            words = " or ".join(_WORDS.get(p, "a list" if p.startswith("list[") else p) for p in parts)
            if any(p.startswith("Literal[") for p in parts):
                words = words.replace("Literal[", "one of [")
            raise UserError(f"{field} must be {words} (got {value!r})", fix=f"give {field} {words}")


# Whole-number trainer fields and the least value Lightning takes (it fails on less only once the Trainer is built).
TRAINER_AT_LEAST = {"num_nodes": 1, "accumulate_grad_batches": 1, "reload_dataloaders_every_n_epochs": 0}
# What ``trainer.max_time`` takes as a mapping: ``datetime.timedelta``'s arguments.
_TIMEDELTA = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def check_trainer(trainer: dict) -> None:
    """Values of trainer fields that Lightning would take and then fail on (late, as a traceback) or misuse."""
    values = {k: _number(v) for k, v in trainer.items() if k in lightning_annotations("trainer")}
    for name, least in TRAINER_AT_LEAST.items():
        value = values.get(name)
        if value is not None and value < least:
            raise UserError(f"trainer.{name} must be >= {least} (got {value:g})", fix=f"e.g. trainer.{name}: {least}")
    max_steps = values.get("max_steps")
    if max_steps is not None and (max_steps == 0 or max_steps < -1):
        raise UserError(
            f"trainer.max_steps must be positive, or -1 to use trainer.max_epochs (got {max_steps:g})",
            fix="e.g. trainer.max_steps: 100",
        )
    max_epochs = values.get("max_epochs")
    if max_epochs is not None and (max_epochs == 0 or max_epochs < -1):
        raise UserError(
            f"trainer.max_epochs must be positive, or -1 for no limit (got {max_epochs:g})",
            fix="e.g. trainer.max_epochs: 1, or leave it out (trainer.max_steps decides)",
        )
    _check_devices(trainer.get("devices"))
    _check_max_time(trainer.get("max_time"))
    every = values.get("check_val_every_n_epoch")
    if every is not None and every < 1:
        raise UserError(
            f"trainer.check_val_every_n_epoch must be >= 1 or null (got {every})",
            fix="e.g. trainer.check_val_every_n_epoch: 1",
        )
    for name in (
        "val_check_interval",
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "limit_predict_batches",
        "overfit_batches",
    ):
        value, limit = values.get(name), name.startswith(("limit", "overfit"))
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (not limit and value == 0) or (value > 1 and value % 1):
            raise UserError(
                f"trainer.{name} must be a fraction in {'[0' if limit else '(0'}, 1] or a whole number of batches "
                f"(got {value})",
                fix=f"e.g. trainer.{name}: {'1.0' if limit else '50'}",
            )
    clip = values.get("gradient_clip_val")
    if clip is not None and (not math.isfinite(clip) or clip < 0):
        raise UserError(
            f"trainer.gradient_clip_val must be a finite number >= 0 (got {clip})",
            fix="e.g. trainer.gradient_clip_val: 1.0",
        )


def _check_devices(devices) -> None:
    """``trainer.devices``: ``auto``, a count >= 1 (-1: all), or a non-empty list or comma-separated text of device
    indices; Lightning refuses 0, ``"0"`` and ``[]`` only when it builds the Trainer."""
    count = _number(devices, int)
    if (
        devices == []
        or (count is not None and (count == 0 or count < -1))
        or (isinstance(devices, str) and not devices.strip())
    ):
        raise UserError(
            f"trainer.devices must be auto, a number of devices >= 1 (-1: all) or a list of device indices "
            f"(got {devices!r})",
            fix="e.g. trainer.devices: 1, or leave it out (auto)",
        )


def _check_max_time(max_time) -> None:
    """``trainer.max_time``: ``DD:HH:MM:SS`` text or a mapping of ``datetime.timedelta`` arguments (as Lightning's
    ``Timer`` reads it, which fails only once the Trainer is built)."""
    if max_time is None:
        return
    if isinstance(max_time, str):
        ok = re.fullmatch(r"\s*\d+:\d+:\d+:\d+\s*", max_time) is not None
    elif isinstance(max_time, dict):
        ok = bool(max_time) and all(
            k in _TIMEDELTA and _number(v) is not None and math.isfinite(_number(v)) and _number(v) >= 0
            for k, v in max_time.items()
        )
    else:
        ok = False
    if not ok:
        raise UserError(
            f"trainer.max_time must be DD:HH:MM:SS or a mapping of {', '.join(_TIMEDELTA)} (got {max_time!r})",
            fix="e.g. trainer.max_time: 00:12:00:00 (12 hours), or {hours: 12}",
        )


def check_checkpoint(checkpoint: dict) -> None:
    """The ``checkpoint`` group (Lightning's ``ModelCheckpoint``): values it fails on when built, and ``dirpath``,
    which qharness sets from ``trainer.default_root_dir``."""
    if checkpoint.get("dirpath") is not None:
        raise UserError(
            f"checkpoint.dirpath is set by qharness to <trainer.default_root_dir>/checkpoints (got {checkpoint['dirpath']!r})",
            fix="leave checkpoint.dirpath out and set trainer.default_root_dir",
        )
    top_k = _number(checkpoint.get("save_top_k"), int)
    if top_k is not None and top_k < -1:
        raise UserError(
            f"checkpoint.save_top_k must be >= -1 (got {top_k}; -1 keeps every checkpoint, 0 none)",
            fix="e.g. checkpoint.save_top_k: 0",
        )
    every = _number(checkpoint.get("every_n_train_steps"), int)
    if every is not None and every < 0:
        raise UserError(
            f"checkpoint.every_n_train_steps must be >= 0 (got {every})",
            fix="e.g. checkpoint.every_n_train_steps: 50 (0: only at the end)",
        )
    if checkpoint.get("filename") is not None:  # one plain name: checkpoints stay in the run's checkpoints/
        check_name(checkpoint["filename"], "checkpoint.filename", "step{step}")


def check_run_dir(root) -> None:
    """``trainer.default_root_dir`` must name a directory that can be created and written (tried with a temporary
    file in its nearest existing parent: ``os.access`` says yes to root on a read-only place such as /proc)."""
    if root is None:
        return
    if not str(root).strip():
        raise UserError(
            "trainer.default_root_dir is empty (the run would write into the current directory)",
            fix="e.g. trainer.default_root_dir: runs/my_run",
        )
    check_writable_dir(Path(str(root)).expanduser(), f"trainer.default_root_dir {root}", "choose a writable directory")


def check_writable_dir(path: Path, what: str, fix: str) -> None:
    """``path`` can be created as a directory and written: its nearest existing parent is a directory where a
    temporary file can be made (``os.access`` says yes to root on a read-only place such as /proc). ``what`` names
    the setting in the error."""
    for parent in (path, *path.parents):
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{what}: {parent} is {'a file' if parent.is_file() else 'not a directory'}", fix=fix)
            try:
                with tempfile.TemporaryFile(dir=parent):
                    pass
            except OSError as e:
                raise UserError(f"{what}: {parent} is not writable ({e.strerror})", fix=fix) from e
            return


def check_cache_dir() -> None:
    """qharness's cache (``$QHARNESS_CACHE``: the embedded model, token caches) can be written, checked before any
    work: otherwise the first write fails after minutes (pretraining the embedded model) or as a traceback."""
    import os

    from qharness.sources.cache import cache_dir

    given = os.environ.get("QHARNESS_CACHE")
    what = f"QHARNESS_CACHE={given}" if given is not None else f"the cache directory {cache_dir()}"
    if given is not None and not given.strip():
        raise UserError(
            "QHARNESS_CACHE is set but empty", fix="point QHARNESS_CACHE at a writable directory, or unset it"
        )
    check_writable_dir(
        cache_dir().expanduser(), what, fix="point QHARNESS_CACHE at a writable directory (default ~/.cache/qharness)"
    )


def _literal(node):
    try:
        return None if node is None else ast.literal_eval(node)
    except ValueError:
        return _NO_CHECK


def read_config(path: str) -> dict:
    """A config file as a mapping; a missing file, bad YAML or a non-mapping is a ``UserError`` naming the file."""
    file = Path(path)
    if not file.is_file():
        try:
            inline = load_yaml(path)  # jsonargparse also takes the config itself as the argument
        except yaml.YAMLError:
            inline = None
        if isinstance(inline, dict):
            return inline
        what = "is a directory" if file.is_dir() else "does not exist"
        raise UserError(f"config file {path} {what}", fix="pass the path of a run config .yaml (e.g. configs/)")
    data = read_yaml(path, "config")
    if data is None:
        raise UserError(
            f"config file {path} is empty",
            fix="give it the run's sections (e.g. configs/qat_xnnpack.yaml), or leave it out",
        )
    if not isinstance(data, dict):
        raise UserError(
            f"config file {path} must hold a mapping of sections (got {type(data).__name__})",
            fix="e.g. model: {recipe: xnnpack_int8_dynamic}",
        )
    return data


def _value(text: str):
    if not text.strip():
        return text  # an empty value stays the empty string, as jsonargparse reads it (YAML would say null)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def merged_config(args: list[str]) -> tuple[dict, set[str]]:
    """The config that ``args`` (after the subcommand) describe, and the top-level keys that arguments it could
    not interpret touch (those go unchecked)."""
    cfg, unclear = {}, set()
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if not arg.startswith("--"):
            continue
        key, eq, value = arg[2:].partition("=")
        if not eq:
            value = None
            if i < len(args) and not args[i].startswith("--"):
                value, i = args[i], i + 1
        if key == "config" and value is not None:
            cfg = deep_merge(cfg, read_config(value))
        elif value is None or not _DOTTED.fullmatch(key):
            unclear.add(key.split(".")[0])
        else:
            *parents, last = key.split(".")
            node = cfg
            for p in parents:
                if not isinstance(node.get(p), dict):
                    if p in node and node[p] is not None:
                        unclear.add(parents[0])
                        break
                    node[p] = {}
                node = node[p]
            else:
                node[last] = _value(value)
    return cfg, unclear


def _number(value, kind=float):
    """``value`` as an int/float (numeric strings too: jsonargparse reads ``1e-3``), None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value) if kind is float else int(value)
        except ValueError:
            return None
    if isinstance(value, int) or (kind is float and isinstance(value, float)):
        return value
    return None


def _unknown_fields(section: str, given: dict, known) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise UserError(
            f"unknown config field(s) {', '.join(f'{section}.{k}' for k in unknown)}",
            fix=f"{section} fields are {', '.join(known)} (qharness fit --help)",
        )


def _check_model(model: dict, trainer: dict | None = None) -> None:
    """The model group's fields and values; with the trainer group (when readable) also its strategy and precision
    against the recipe."""
    defaults = init_defaults("training/module.py", "QuantLM")
    _unknown_fields("model", model, defaults)
    check_types("model", model, init_annotations("training/module.py", "QuantLM"))
    m = {**defaults, **_as_text(model, ("checkpoint", "recipe", "mode"))}
    _check_distill(m["distill"])
    _check_lora(m["lora"])
    lr, warmup, fq = _number(m["lr"]), _number(m["warmup_steps"], int), _number(m["fake_quant_after_n_steps"], int)
    freeze = m["freeze_observers_after_n_steps"]
    freeze = -1 if freeze is None else _number(freeze, int)  # -1 stands for None while the types are checked
    if not isinstance(m["recipe"], str) or not isinstance(m["mode"], str) or None in (lr, warmup, fq, freeze):
        return  # a value of another type: LightningCLI names it
    freeze = None if freeze == -1 and m["freeze_observers_after_n_steps"] is None else freeze
    flags = {k: m[k] for k in ("layerwise", "activation_checkpointing") if isinstance(m[k], bool)}
    strategy = (trainer or {}).get("strategy")
    if isinstance(strategy, str):
        flags["strategy"] = strategy
    wd = _number(m["weight_decay"])
    recipe = check_model_args(
        m["recipe"],
        m["mode"],
        lr,
        warmup,
        fq,
        freeze,
        distill=m["distill"] is not None,
        weight_decay=wd,
        lora=m["lora"] is not None,
        **flags,
    )
    checkpoint = m["checkpoint"]
    if isinstance(checkpoint, str) and checkpoint != EMBEDDED and not checkpoint.startswith(TORCHTUNE):
        check_local_checkpoint(checkpoint)
    precision = (trainer or {}).get("precision")
    if isinstance(precision, (str, int)) and not isinstance(precision, bool):
        check_precision(precision, recipe, m["mode"])


def _as_text(values: dict, names: tuple[str, ...]) -> dict:
    """String fields given a number on the command line (``--model.recipe 5``) as jsonargparse reads them: text."""
    return {
        k: str(v) if k in names and isinstance(v, (int, float)) and not isinstance(v, bool) else v
        for k, v in values.items()
    }


def _checked_mapping(group: str, value, cls, example: str) -> bool:
    """``model.<group>`` (null or a mapping of ``cls``'s fields): whether one is given, after checking it is a mapping
    of known fields with values of the fields' types."""
    if value is None:
        return False
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if not isinstance(value, dict):
        raise UserError(
            f"{group} must be a mapping of {', '.join(fields)} or null (got {value!r})", fix=f"e.g. {group}: {example}"
        )
    _unknown_fields(group, value, fields)
    check_types(group, value, {k: str(f.type) for k, f in fields.items()})
    return True


def _check_distill(distill) -> None:
    """``model.distill``: null or a mapping of ``Distill``'s fields, each checked as ``Distill`` checks it."""
    if _checked_mapping("model.distill", distill, Distill, "{kl_weight: 1.0, temperature: 2.0}"):
        Distill(**{k: v if isinstance(v, bool) else _number(v) for k, v in distill.items() if k != "hard_loss"})


def _check_lora(lora) -> None:
    """``model.lora``: null or a mapping of ``LoRA``'s fields, each checked as ``LoRA`` checks it."""
    if _checked_mapping("model.lora", lora, LoRA, "{rank: 8, alpha: 16}"):
        values = {k: v if k == "targets" else _number(v, int if k == "rank" else float) for k, v in lora.items()}
        LoRA(
            **{k: lora[k] if v is None else v for k, v in values.items()}
        )  # a non-number keeps its text: LoRA names it


def _check_data(data: dict) -> tuple[int, int] | None:
    """``(seq_len, batch_size)`` once the data group passes, None when its values are of other types."""
    defaults = init_defaults("data/datamodule.py", "TextDataModule")
    _unknown_fields("data", data, defaults)
    check_types("data", data, init_annotations("data/datamodule.py", "TextDataModule"))
    d = {**defaults, **_as_text(data, ("source", "text_field", "tokenizer"))}
    seq_len, batch_size, val_fraction = (
        _number(d["seq_len"], int),
        _number(d["batch_size"], int),
        _number(d["val_fraction"]),
    )
    if not isinstance(d["source"], str) or None in (seq_len, batch_size, val_fraction):
        return None
    for name in ("text_field", "tokenizer"):
        if isinstance(d[name], str) and not d[name].strip():
            raise UserError(f"data.{name} is empty", fix=f"e.g. data.{name}: {defaults[name]}")
    check_data_args(d["source"], seq_len, batch_size, val_fraction)
    return seq_len, batch_size


def _check_section(name: str, values: dict):
    """The section's dataclass, built from ``values`` (it checks its own fields); numeric strings become numbers
    as jsonargparse makes them. None (unchecked) when a value has another type, e.g. a list field given a string."""
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[name])}
    _unknown_fields(name, values, fields)
    check_types(name, values, {k: str(f.type) for k, f in fields.items()})
    kwargs = {}
    for key, value in values.items():
        kind = str(fields[key].type)
        if "list" in kind and not isinstance(value, list):
            return None
        if isinstance(value, str) and "str" not in kind and ("int" in kind or "float" in kind):
            number = _number(value, float if "float" in kind else int)
            value = value if number is None else number
        kwargs[key] = value
    try:
        return SECTIONS[name](**kwargs)
    except (TypeError, AttributeError):
        return None  # a value of another type: LightningCLI names it


def _section(cfg: dict, unclear: set[str], name: str) -> dict | None:
    """The group's mapping ({} when absent: the defaults), None when it cannot be read here."""
    values = cfg.get(name, {})
    if name in unclear or not isinstance(values, dict) or {"class_path", "init_args"} & set(values):
        return None
    return values


def check_across_sections(seq_len, batch_size, max_seq_len, eval_blocks, prompt_len, decode_steps) -> None:
    """The checks across data, deploy and parity, on plain values (``preflight`` runs them too). Example::

    check_across_sections(128, 8, 128, 32, 32, 8)   # UserError: deploy.max_seq_len=128 must exceed ...
    """
    if max_seq_len <= seq_len:
        raise UserError(
            f"deploy.max_seq_len={max_seq_len} must exceed data.seq_len={seq_len}",
            fix=f"set deploy.max_seq_len >= {seq_len + 1}",
        )
    if eval_blocks < batch_size:
        raise UserError(
            f"parity.eval_blocks={eval_blocks} must be >= data.batch_size={batch_size}",
            fix=f"set parity.eval_blocks >= {batch_size}",
        )
    if prompt_len > seq_len or prompt_len + decode_steps >= max_seq_len:
        raise UserError(
            f"parity.prompt_len={prompt_len} (+ decode_steps={decode_steps}) must fit data.seq_len={seq_len} "
            f"and deploy.max_seq_len={max_seq_len}",
            fix="shorten parity.prompt_len/decode_steps, or raise data.seq_len/deploy.max_seq_len",
        )


def check_config(cfg: dict, unclear: set[str] = frozenset(), subcommand: str | None = None) -> None:
    """``UserError`` for the first problem found in a merged run config; sections in ``unclear`` are skipped;
    ``subcommand`` (when known): autotune's own keys are unknown to the others."""
    known = TOP_LEVEL - AUTOTUNE_KEYS if subcommand not in (None, "autotune") else TOP_LEVEL
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise UserError(
            f"unknown config section(s) {', '.join(unknown)}", fix=f"known sections: {', '.join(sorted(known))}"
        )
    for name in ("model", "data", "trainer", "checkpoint", *SECTIONS):
        value = cfg.get(name)
        if name not in unclear and value is not None and not isinstance(value, (dict, str)):
            raise UserError(
                f"{name} must be a mapping of fields (got {value!r})", fix=f"e.g. {name}: {{...}}, or leave it out"
            )
    model, data, trainer, checkpoint = (_section(cfg, unclear, n) for n in ("model", "data", "trainer", "checkpoint"))
    if "seed_everything" not in unclear:
        check_types("", {"seed_everything": cfg.get("seed_everything")}, {"seed_everything": "bool | int | None"})
    if trainer is not None:
        _unknown_fields("trainer", trainer, lightning_annotations("trainer"))
        check_types("trainer", trainer, lightning_annotations("trainer"))
        check_trainer(trainer)
        if "default_root_dir" in trainer:
            check_run_dir(trainer["default_root_dir"])
    if checkpoint is not None:
        _unknown_fields("checkpoint", checkpoint, lightning_annotations("checkpoint"))
        check_types("checkpoint", checkpoint, lightning_annotations("checkpoint"))
        check_checkpoint(checkpoint)
    if model is not None:
        _check_model(model, trainer)
    sizes = None if data is None else _check_data(data)
    built = {}
    for name in SECTIONS:
        values = _section(cfg, unclear, name)
        built[name] = None if values is None else _check_section(name, values)
    deploy, parity = built["deploy"], built["parity"]
    if sizes and deploy and parity:
        check_across_sections(
            *sizes,
            deploy.max_seq_len,
            parity.eval_blocks,
            parity.prompt_len,
            parity.decode_steps,
        )
    evaluation = built["eval"]
    if sizes and deploy and evaluation and evaluation.enabled:
        check_eval_lengths(evaluation.max_length or sizes[0], sizes[0], deploy.max_seq_len)
    bench = built["bench"]
    if deploy and bench and deploy.enabled and bench.enabled:
        check_lengths(bench.prompt_len, bench.decode_tokens, bench.reps, deploy.max_seq_len)


def precheck(argv: list[str]) -> None:
    """Check the run config of ``argv`` (``[subcommand, --config, x.yaml, --a.b, v, ...]``); help passes."""
    args = argv[1:]
    if any(a in ("-h", "--help") or a.startswith("--print_config") or a.endswith(".help") for a in args):
        return
    if "--" in args:
        raise UserError(
            f"`--` in the command line ({' '.join(argv)}): qharness takes no positional arguments after the options",
            fix=f"give the config first without `--`: qharness {argv[0]} CONFIG.yaml [--section.field value ...]",
        )
    try:
        cfg, unclear = merged_config(args)
        if argv[0] == "autotune":  # its budget (an option or a key of the config), before torch loads
            from qharness.evaluation.autotune import check_budget

            budget = cfg.get("max_size_mb")
            for i, a in enumerate(args):
                if a == "--max_size_mb" and i + 1 < len(args):
                    budget = _value(args[i + 1])
                elif a.startswith("--max_size_mb="):
                    budget = _value(a.partition("=")[2])
            check_budget(budget if _number(budget) is None else _number(budget))
        check_config(cfg, unclear, argv[0])
        check_cache_dir()
    except UserError:
        raise
    except Exception:  # noqa: BLE001  whatever this quick look cannot handle, LightningCLI's full check decides
        return
