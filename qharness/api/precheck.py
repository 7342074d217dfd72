"""Fast validation of a run config, before torch and Lightning load: a bad config fails in about a second.

``qharness fit|validate|test|calibrate|export|evaluate|sensitivity|autotune`` read their ``--config`` files and dotted
overrides (``--model.lr -1``, ``--model.lr=-1``) here and check them against the run's schema
(``qharness.schema.RunConfig``: every section's fields, types and rules, and the rules across sections), then the
cache directory. What it cannot read (a section given as a class path or a file, ``--trainer.callbacks+=X``) passes,
as do the ``trainer`` and ``checkpoint`` fields qharness does not read: LightningCLI checks the whole config
afterwards, so this never rejects a config it accepts.

Example::

    precheck(["fit", "--config", "bad.yaml", "--model.lr", "-1"])   # UserError: model.lr must be positive (got -1)
"""

from __future__ import annotations

import re

import yaml

from qharness.config import deep_merge
from qharness.errors import UserError
from qharness.io.files import file_problem
from qharness.io.yaml_reader import load_yaml, read_yaml
from qharness.schema import RunConfig
from qharness.schema.fields import number
from qharness.schema.trainer import check_writable_dir, resolve_ckpt

# Top-level keys of the subcommands' configs: the schema's sections, and the subcommands' own options
# (``qharness fit --print_config``; evaluate, sensitivity and autotune add theirs).
OPTIONS = {"ckpt_path", "weights_only", "verbose", "pte", "tasks", "limit", "num_fewshot", "models"}
OPTIONS |= {"candidates", "unit", "against"}  # sensitivity's options
AUTOTUNE_KEYS = {"max_size_mb", "max_latency_ms", "sensitivity"}  # autotune's: unknown to the other subcommands
TOP_LEVEL = {*RunConfig.sections(), "seed_everything", *OPTIONS, *AUTOTUNE_KEYS}
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def read_config(path: str) -> dict:
    """A config file as a mapping; a missing file, bad YAML or a non-mapping is a ``UserError`` naming the file."""
    problem = file_problem(path)
    if problem:
        inline = None
        if problem == "does not exist" or problem.startswith("cannot be read"):
            try:
                inline = load_yaml(path)  # jsonargparse also takes the config itself as the argument
            except yaml.YAMLError:
                pass
        if isinstance(inline, dict):
            return inline
        raise UserError(f"config file {path} {problem}", fix="pass the path of a run config .yaml (e.g. configs/)")
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
        return load_yaml(text)  # bounded: an alias bomb in an override is refused, not expanded
    except yaml.YAMLError:
        return text


def option(args: list[str], name: str):
    """The last value given to ``--name VALUE`` or ``--name=VALUE`` (None if absent)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a[len(name) + 1 :]
    return value


def _read_by_lightning(value) -> bool:
    """A config section given as a file or a class path: LightningCLI reads it, this quick look does not."""
    return isinstance(value, str) or (isinstance(value, dict) and bool({"class_path", "init_args"} & set(value)))


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


def check_config(cfg: dict, unclear: set[str] = frozenset(), subcommand: str | None = None) -> RunConfig:
    """The ``RunConfig`` of a merged run config once it passes (else ``UserError`` for the first problem found);
    sections in ``unclear`` (and sections given as a class path or a file) keep their defaults and are not checked;
    ``subcommand`` (when known): its own rules, and autotune's keys are unknown to the others."""
    known = TOP_LEVEL - AUTOTUNE_KEYS if subcommand not in (None, "autotune") else TOP_LEVEL
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise UserError(
            f"unknown config section(s) {', '.join(unknown)}", fix=f"known sections: {', '.join(sorted(known))}"
        )
    skip = set(unclear)
    for name in RunConfig.sections():
        if _read_by_lightning(cfg.get(name)):
            skip.add(name)
    run = RunConfig.from_dict(cfg, skip=frozenset(skip))
    run.validate(subcommand, skip=frozenset(skip))
    return run


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


def check_checkpoint(subcommand: str, args: list[str], cfg: dict, unclear: set[str], run: RunConfig) -> None:
    """The checkpoint that ``export`` reads (``ckpt_path``, default ``last``) or that ``fit`` resumes from exists:
    otherwise one line here rather than after Lightning, the model and the architecture check have loaded."""
    if subcommand not in ("fit", "export") or "trainer" in unclear or _read_by_lightning(cfg.get("trainer")):
        return  # the run directory is not known here
    path = option(args, "--ckpt_path")
    path = cfg.get("ckpt_path") if path is None else path
    if path is None and subcommand == "export":
        path = "last"
    if isinstance(path, str):
        resolve_ckpt(path, run.trainer.default_root_dir)


def precheck(argv: list[str]) -> RunConfig | None:
    """Check the run config of ``argv`` (``[subcommand, --config, x.yaml, --a.b, v, ...]``): its ``RunConfig``, None
    where it cannot be read here (help, a config this quick look cannot handle: LightningCLI decides)."""
    args = argv[1:]
    if any(a in ("-h", "--help") or a.startswith("--print_config") or a.endswith(".help") for a in args):
        return None
    if "--" in args:
        raise UserError(
            f"`--` in the command line ({' '.join(argv)}): qharness takes no positional arguments after the options",
            fix=f"give the config first without `--`: qharness {argv[0]} CONFIG.yaml [--section.field value ...]",
        )
    try:
        cfg, unclear = merged_config(args)
        if argv[0] == "autotune":  # its budget (an option or a key of the config), before torch loads
            from qharness.evaluation.autotune import check_budget

            budgets = {key: cfg.get(key) for key in ("max_size_mb", "max_latency_ms")}
            for i, a in enumerate(args):
                for key in budgets:
                    if a == f"--{key}" and i + 1 < len(args):
                        budgets[key] = _value(args[i + 1])
                    elif a.startswith(f"--{key}="):
                        budgets[key] = _value(a.partition("=")[2])
            check_budget(*(b if number(b) is None else number(b) for b in budgets.values()))
        run = check_config(cfg, unclear, argv[0])
        check_cache_dir()
        check_checkpoint(argv[0], args, cfg, unclear, run)
        return run
    except UserError:
        raise
    except Exception:  # noqa: BLE001  whatever this quick look cannot handle, LightningCLI's full check decides
        return None
