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
from qharness.config import (
    BenchConfig,
    CalibrationConfig,
    EvalConfig,
    ExportConfig,
    ParityConfig,
    WandbConfig,
    check_lengths,
    deep_merge,
)
from qharness.data.args import check_data_args
from qharness.errors import UserError
from qharness.io import read_yaml
from qharness.sources.models import EMBEDDED, check_local_checkpoint
from qharness.sources.torchtune import PREFIX as TORCHTUNE
from qharness.training.model_args import check_model_args, check_precision

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
    data = read_yaml(path, "config")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"config file {path} must hold a mapping of sections (got {type(data).__name__})",
            fix="e.g. model: {recipe: xnnpack_int8_dynamic}",
        )
    return data


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
    m = {**defaults, **model}
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
    recipe = check_model_args(m["recipe"], m["mode"], lr, warmup, fq, freeze, distill=m["distill"] is not None, **flags)
    checkpoint = m["checkpoint"]
    if isinstance(checkpoint, str) and checkpoint != EMBEDDED and not checkpoint.startswith(TORCHTUNE):
        check_local_checkpoint(checkpoint)
    precision = (trainer or {}).get("precision")
    if isinstance(precision, (str, int)) and not isinstance(precision, bool):
        check_precision(precision, recipe, m["mode"])


def _check_data(data: dict) -> tuple[int, int] | None:
    """``(seq_len, batch_size)`` once the data group passes, None when its values are of other types."""
    defaults = init_defaults("data/datamodule.py", "TextDataModule")
    _unknown_fields("data", data, defaults)
    d = {**defaults, **data}
    seq_len, batch_size, val_fraction = (
        _number(d["seq_len"], int),
        _number(d["batch_size"], int),
        _number(d["val_fraction"]),
    )
    if not isinstance(d["source"], str) or None in (seq_len, batch_size, val_fraction):
        return None
    check_data_args(d["source"], seq_len, batch_size, val_fraction)
    return seq_len, batch_size


def _check_section(name: str, values: dict):
    """The section's dataclass, built from ``values`` (it checks its own fields); numeric strings become numbers
    as jsonargparse makes them. None (unchecked) when a value has another type, e.g. a list field given a string."""
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[name])}
    _unknown_fields(name, values, fields)
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


def check_steps_and_lengths(
    max_steps, max_epochs, every_n_train_steps, seq_len, batch_size, max_seq_len, eval_blocks, prompt_len, decode_steps
) -> None:
    """The checks across trainer, checkpoint, data, deploy and parity, on plain values (``preflight`` runs them
    too); None skips a trainer/checkpoint value. Example::

        check_steps_and_lengths(100, None, 50, 128, 8, 128, 32, 32, 8)   # UserError: deploy.max_seq_len=128 must exceed ...
    """
    if max_steps is not None and (max_steps == 0 or max_steps < -1):
        raise UserError(
            f"trainer.max_steps must be positive, or -1 to use trainer.max_epochs (got {max_steps})",
            fix="e.g. trainer.max_steps: 100",
        )
    if max_epochs is not None and max_epochs == 0:
        raise UserError("trainer.max_epochs must be positive", fix="e.g. trainer.max_epochs: 1, or -1 for no limit")
    if every_n_train_steps is not None and every_n_train_steps < 0:
        raise UserError(
            f"checkpoint.every_n_train_steps must be >= 0 (got {every_n_train_steps})",
            fix="e.g. checkpoint.every_n_train_steps: 50 (0: only at the end)",
        )
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


def check_config(cfg: dict, unclear: set[str] = frozenset()) -> None:
    """``UserError`` for the first problem found in a merged run config; sections in ``unclear`` are skipped."""
    unknown = sorted(set(cfg) - TOP_LEVEL)
    if unknown:
        raise UserError(
            f"unknown config section(s) {', '.join(unknown)}", fix=f"known sections: {', '.join(sorted(TOP_LEVEL))}"
        )
    model, data, trainer, checkpoint = (_section(cfg, unclear, n) for n in ("model", "data", "trainer", "checkpoint"))
    if model is not None:
        _check_model(model, trainer)
    sizes = None if data is None else _check_data(data)
    built = {}
    for name in SECTIONS:
        values = _section(cfg, unclear, name)
        built[name] = None if values is None else _check_section(name, values)
    deploy, parity = built["deploy"], built["parity"]
    if sizes and deploy and parity and trainer is not None and checkpoint is not None:
        check_steps_and_lengths(
            _number(trainer.get("max_steps"), int),
            _number(trainer.get("max_epochs"), int),
            _number(checkpoint.get("every_n_train_steps"), int),
            *sizes,
            deploy.max_seq_len,
            parity.eval_blocks,
            parity.prompt_len,
            parity.decode_steps,
        )
    bench = built["bench"]
    if deploy and bench and deploy.enabled and bench.enabled:
        check_lengths(bench.prompt_len, bench.decode_tokens, bench.reps, deploy.max_seq_len)


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
