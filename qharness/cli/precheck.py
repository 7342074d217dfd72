"""Fast validation of a run config, before torch and Lightning load: a bad config fails in about a second.

``qharness fit|validate|test|calibrate|export|evaluate`` read their ``--config`` files and dotted overrides
(``--model.lr -1``, ``--model.lr=-1``) here and check what needs no torch: the YAML itself, the top-level
sections, the fields and values of ``model`` (``check_model_args``: lr, warmup, recipe and mode), ``data``
(``check_data_args``: sizes, the source path) and the typed sections of ``qharness.config``. What it cannot
interpret passes: LightningCLI checks the whole config afterwards, so this never rejects a config it accepts.

Example::

    precheck(["fit", "--config", "bad.yaml", "--model.lr", "-1"])   # UserError: model.lr must be positive (got -1)
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import yaml

import qharness
from qharness.config import BenchConfig, CalibrationConfig, EvalConfig, ExportConfig, ParityConfig, WandbConfig
from qharness.data.args import check_data_args
from qharness.errors import UserError
from qharness.training.model_args import check_model_args

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
            inline = yaml.safe_load(path)  # jsonargparse also takes the config itself as the argument
        except yaml.YAMLError:
            inline = None
        if isinstance(inline, dict):
            return inline
        what = "is a directory" if file.is_dir() else "does not exist"
        raise UserError(f"config file {path} {what}", fix="pass the path of a run config .yaml (e.g. configs/)")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise UserError(f"config file {path} is not valid YAML{at}", fix="fix the YAML syntax") from e
    except UnicodeDecodeError as e:
        raise UserError(f"config file {path} is not UTF-8 text", fix="save the config as UTF-8 YAML") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"config file {path} must hold a mapping of sections (got {type(data).__name__})",
            fix="e.g. model: {recipe: xnnpack_int8_dynamic}",
        )
    return data


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _value(text: str):
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
            _merge(cfg, read_config(value))
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


def _check_model(model: dict) -> None:
    defaults = init_defaults("training/module.py", "QuantLM")
    _unknown_fields("model", model, defaults)
    m = {**defaults, **model}
    lr, warmup, fq = _number(m["lr"]), _number(m["warmup_steps"], int), _number(m["fake_quant_after_n_steps"], int)
    freeze = m["freeze_observers_after_n_steps"]
    freeze = -1 if freeze is None else _number(freeze, int)  # -1 stands for None while the types are checked
    if not isinstance(m["recipe"], str) or not isinstance(m["mode"], str) or None in (lr, warmup, fq, freeze):
        return  # a value of another type: LightningCLI names it
    freeze = None if freeze == -1 and m["freeze_observers_after_n_steps"] is None else freeze
    check_model_args(m["recipe"], m["mode"], lr, warmup, fq, freeze, distill=m["distill"] is not None)


def _check_data(data: dict) -> None:
    defaults = init_defaults("data/datamodule.py", "TextDataModule")
    _unknown_fields("data", data, defaults)
    d = {**defaults, **data}
    seq_len, batch_size, val_fraction = (
        _number(d["seq_len"], int),
        _number(d["batch_size"], int),
        _number(d["val_fraction"]),
    )
    if isinstance(d["source"], str) and None not in (seq_len, batch_size, val_fraction):
        check_data_args(d["source"], seq_len, batch_size, val_fraction)


def _check_section(name: str, values: dict) -> None:
    """Build the section's dataclass (it checks its own fields); numeric strings become numbers as jsonargparse
    makes them; a list field given as something else passes unchecked."""
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[name])}
    _unknown_fields(name, values, fields)
    kwargs = {}
    for key, value in values.items():
        kind = str(fields[key].type)
        if "list" in kind and not isinstance(value, list):
            return
        if isinstance(value, str) and "str" not in kind and ("int" in kind or "float" in kind):
            number = _number(value, float if "float" in kind else int)
            value = value if number is None else number
        kwargs[key] = value
    try:
        SECTIONS[name](**kwargs)
    except (TypeError, AttributeError):
        return  # a value of another type: LightningCLI names it


def check_config(cfg: dict, unclear: set[str] = frozenset()) -> None:
    """``UserError`` for the first problem found in a merged run config; sections in ``unclear`` are skipped."""
    unknown = sorted(set(cfg) - TOP_LEVEL)
    if unknown:
        raise UserError(
            f"unknown config section(s) {', '.join(unknown)}", fix=f"known sections: {', '.join(sorted(TOP_LEVEL))}"
        )
    checks = {"model": _check_model, "data": _check_data, **{n: lambda v, n=n: _check_section(n, v) for n in SECTIONS}}
    for name, check in checks.items():
        values = cfg.get(name)
        if name not in unclear and isinstance(values, dict) and not {"class_path", "init_args"} & set(values):
            check(values)


def precheck(argv: list[str]) -> None:
    """Check the run config of ``argv`` (``[subcommand, --config, x.yaml, --a.b, v, ...]``); help passes."""
    args = argv[1:]
    if any(a in ("-h", "--help") or a.startswith("--print_config") or a.endswith(".help") for a in args):
        return
    try:
        check_config(*merged_config(args))
    except UserError:
        raise
    except Exception:  # noqa: BLE001  whatever this quick look cannot handle, LightningCLI's full check decides
        return
