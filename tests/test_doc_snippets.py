"""Every code block of README.md and docs/**/*.md is tested: run here in a fresh process, run verbatim by the test
its marker names (``<!-- run by: tests/test_x.py ... -->``), or marked ``<!-- not run: REASON -->``. Whatever the
marker, every ``qharness`` command's subcommand, config file and options must exist, every YAML block's keys must be
config fields (or a valid recipe / sweep file), and the config fields, recipes and subcommands the prose names in
backticks must exist: renaming a field, a recipe or a subcommand fails here."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*(not run|run by):\s*(?P<why>.+?)\s*-->\s*$")
SHELL = {"bash", "sh", "shell"}
CHECKED = SHELL | {"python", "yaml", "json", "jsonl", "toml", "text", "console"}  # text, console: output
CONFIG_OPTIONS = {"--config", "--print_config", "--help"}


@dataclasses.dataclass
class Block:
    path: Path
    line: int
    lang: str
    code: str
    marker: str | None  # "not run" / "run by"
    why: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for path in DOC_FILES:
        text = path.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARKER.search(before)
            line = text.count("\n", 0, m.start()) + 1
            out.append(
                Block(path, line, m.group("lang"), m.group("code"), mark and mark.group(1), mark and mark.group("why"))
            )
    return out


BLOCKS = blocks()


def _id(b: Block) -> str:
    return b.where


# --- what exists: subcommands, their options, config fields, recipes --------------------------------------------


def _sections() -> dict[str, type]:
    from qharness.schema.run import RunConfig

    return RunConfig.sections()


def _field_type(cls, name: str):
    """The type of field ``name`` of dataclass ``cls`` (the dataclass inside ``X | None``), or None if no such field."""
    hints = typing.get_type_hints(cls)
    if name not in {f.name for f in dataclasses.fields(cls)}:
        return None
    tp = hints[name]
    inner = [t for t in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(t)]
    return inner[0] if inner else tp


def config_field_exists(dotted: str) -> bool:
    """``model.distill.kl_weight`` names a field of the run config's schema."""
    section, *rest = dotted.split(".")
    cls = _sections().get(section)
    for name in rest:
        if cls is None or not dataclasses.is_dataclass(cls):
            return False
        cls = _field_type(cls, name)
    return cls is not None


def lightning_field_exists(dotted: str) -> bool:
    """``trainer.logger``, ``checkpoint.monitor``: the ``trainer``/``checkpoint`` fields qharness leaves to Lightning
    (its ``Trainer`` and ``ModelCheckpoint`` arguments)."""
    import inspect

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    section, _, name = dotted.partition(".")
    cls = {"trainer": Trainer, "checkpoint": ModelCheckpoint}.get(section)
    return cls is not None and name in inspect.signature(cls.__init__).parameters


def summary_field_exists(dotted: str) -> bool:
    from qharness.run.summary import RunSummary

    cls = RunSummary
    for name in dotted.split("."):
        if not dataclasses.is_dataclass(cls):
            return cls is not None  # a plain mapping section (eval, distill): its keys are data
        cls = _field_type(cls, name)
        if cls is None:
            return False
    return True


def options_of(sub: str) -> set[str]:
    from qharness.cli.reference import plain_options, run_config_options

    return set(run_config_options().get(sub, {})) | set(plain_options().get(sub, {}))


def check_qharness_args(args: list[str], where: str) -> None:
    """``args`` after ``qharness``: the subcommand exists, its config file exists, each option is one it takes."""
    from qharness.cli.main import LIGHTNING, SUBCOMMANDS

    assert args, f"{where}: `qharness` without a subcommand"
    sub, rest = args[0], args[1:]
    assert sub in SUBCOMMANDS, f"{where}: no subcommand {sub!r} (known: {', '.join(SUBCOMMANDS)})"
    own = options_of(sub)
    for arg in rest:
        if arg.startswith("configs/") and not arg.startswith("--"):
            assert (ROOT / arg).exists(), f"{where}: {arg} does not exist"
        if not arg.startswith("--"):
            continue
        opt = arg.split("=", 1)[0]
        if sub in LIGHTNING and "." in opt:
            field = opt[2:]
            assert config_field_exists(field) or lightning_field_exists(field), f"{where}: {sub} {opt}: no such field"
        elif sub in LIGHTNING:
            assert opt in own | CONFIG_OPTIONS, f"{where}: qharness {sub} takes no {opt} (it takes {sorted(own)})"
        else:
            assert opt in own | {"--help"}, f"{where}: qharness {sub} takes no {opt} (it takes {sorted(own)})"


def shell_commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, split at ``&&``, ``||``, ``;``, ``|``."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line, comments=True)
        cmd: list[str] = []
        for t in tokens + ["&&"]:
            if t in ("&&", "||", ";", "|"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(t)
    return out


def check_shell_command(cmd: list[str], where: str) -> None:
    for i, t in enumerate(cmd):
        if t == "qharness" or t.endswith("/qharness"):
            return check_qharness_args(cmd[i + 1 :], where)
        if t == "-m" and cmd[i + 1 : i + 2] == ["qharness"]:
            return check_qharness_args(cmd[i + 2 :], where)
        if t.startswith("scripts/") or t.startswith("examples/"):
            assert (ROOT / t).is_file(), f"{where}: {t} does not exist"
            return
        if t.startswith(".[") or '".[' in t or t.startswith("-e"):
            extras = re.findall(r"\[([\w,]+)\]", " ".join(cmd))
            known = set(_pyproject()["project"]["optional-dependencies"])
            for extra in ",".join(extras).split(","):
                assert not extra or extra in known, f"{where}: pip extra [{extra}] is not in pyproject.toml"
            return


def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def check_yaml(code: str, where: str, tmp: Path) -> None:
    """A recipe (``base:``/``quantizer:``) loads as a recipe; a sweep file (``runs:``) as a sweep; anything else is a
    run config fragment whose every key is a config field."""
    from qharness.recipes.registry import load_recipe
    from qharness.sweep.spec import load_sweep

    data = yaml.safe_load(code)
    assert isinstance(data, dict), f"{where}: a YAML block should be a mapping"
    if "base" in data or "quantizer" in data:
        path = tmp / "recipe.yaml"
        path.write_text(code)
        load_recipe(str(path))
    elif "runs" in data:
        path = tmp / "sweep.yaml"
        path.write_text(code)
        load_sweep(path)
        check_config_keys(data.get("config") or {}, where)
    else:
        check_config_keys(data, where)


def check_config_keys(data: dict, where: str, prefix: str = "") -> None:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        assert config_field_exists(dotted), f"{where}: {dotted} is not a config field"
        sub = dotted.split(".", 1)[0]
        if isinstance(value, dict) and sub not in ("trainer", "checkpoint"):
            nested = dotted.count(".") == 0 or dataclasses.is_dataclass(_leaf(dotted))
            if nested:
                check_config_keys(value, where, dotted + ".")


def _leaf(dotted: str):
    section, *rest = dotted.split(".")
    cls = _sections()[section]
    for name in rest:
        cls = _field_type(cls, name)
    return cls


# --- the blocks ----------------------------------------------------------------------------------------------------


@pytest.mark.fast
def test_every_block_says_its_language_and_how_it_is_tested():
    """Each fenced block names a language we check (``text`` for output); a ``run by`` marker names a test file
    that exists and reads this page."""
    assert len(BLOCKS) > 20
    for b in BLOCKS:
        foreign = b.lang and b.marker == "not run"  # C++, CMake, ...: named, and marked with why it is not run
        assert b.lang in CHECKED or foreign, f"{b.where}: ```{b.lang or '(no language)'}: use one of {sorted(CHECKED)}"
        if b.marker == "run by":
            test = b.why.split()[0]
            assert (ROOT / test).is_file(), f"{b.where}: {test} does not exist"
            text = (ROOT / test).read_text()
            assert b.path.name in text, f"{test} never reads {b.path.relative_to(ROOT)}"
        if b.marker == "not run":
            assert len(b.why) > 10, f"{b.where}: say why the block is not run"


@pytest.mark.fast
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in SHELL], ids=_id)
def test_shell_block_names_only_what_exists(block):
    for cmd in shell_commands(block.code):
        check_shell_command(cmd, block.where)


@pytest.mark.fast
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "yaml"], ids=_id)
def test_yaml_block_is_a_valid_config_recipe_or_sweep(block, tmp_path):
    check_yaml(block.code, block.where, tmp_path)


@pytest.mark.fast
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("python", "json", "jsonl", "toml")], ids=_id)
def test_python_json_and_toml_blocks_parse(block):
    if block.lang == "python":
        compile(block.code, block.where, "exec")
    elif block.lang == "toml":
        import tomllib

        tomllib.loads(block.code)
    else:
        for line in block.code.splitlines():
            if line.strip():
                json.loads(line)


def _qharness_shim(tmp: Path) -> dict:
    """An environment whose ``qharness`` is this checkout's (``sys.executable -m qharness``)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "qharness"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m qharness "$@"\n')
    shim.chmod(0o755)
    env = os.environ.copy()
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


RUN_HERE = [b for b in BLOCKS if b.marker is None and b.lang in SHELL | {"python"}]


@pytest.mark.parametrize("block", RUN_HERE, ids=_id)
def test_unmarked_block_runs(block, tmp_path):
    """A block without a marker runs as written, in a fresh process, in a directory holding the project's configs."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(ROOT / "configs", work / "configs")
    env = _qharness_shim(tmp_path)
    argv = ["bash", "-euo", "pipefail", "-c", block.code] if block.lang in SHELL else [sys.executable, "-c", block.code]
    r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{block.where} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def test_the_blocks_run_here_are_the_cheap_ones():
    """The unmarked blocks are the ones this suite can afford: a handful, none that trains."""
    assert 1 <= len(RUN_HERE) <= 12, [b.where for b in RUN_HERE]


# --- names in the prose ----------------------------------------------------------------------------------------------

SPAN = re.compile(r"`([^`\n]+)`")
FILE_SUFFIX = re.compile(r"\.(json|yaml|md|png|csv|py|pte|txt|jsonl|log|ckpt|so|a|out)$")


def _spans() -> list[tuple[str, str]]:
    out = []
    for path in DOC_FILES:
        if path.name == "config-reference.md" or path.parent.name == "reference":
            continue  # generated from the code (tests/test_docs.py keeps them current)
        for m in SPAN.finditer(path.read_text()):
            out.append((path.relative_to(ROOT).as_posix(), m.group(1)))
    return out


@pytest.mark.fast
def test_config_fields_named_in_the_docs_exist():
    sections = set(_sections())
    bad = []
    for page, span in _spans():
        m = re.fullmatch(r"--?([a-z_]+(?:\.[a-z_]+)+)(?: .*)?|([a-z_]+(?:\.[a-z_]+)+)(?::.*)?", span)
        if not m:
            continue
        dotted = m.group(1) or m.group(2)
        if dotted.split(".")[0] not in sections or FILE_SUFFIX.search(dotted) or dotted.startswith("model.layers"):
            continue
        if not (config_field_exists(dotted) or summary_field_exists(dotted) or lightning_field_exists(dotted)):
            bad.append(f"{page}: `{span}`")
    assert not bad, "config fields the docs name that do not exist:\n" + "\n".join(bad)


@pytest.mark.fast
def test_recipes_and_subcommands_named_in_the_docs_exist():
    from qharness.cli.main import SUBCOMMANDS
    from qharness.recipes.registry import known_recipes

    recipes = set(known_recipes())
    bad = []
    for page, span in _spans():
        if "/" in span or ".py" in span:
            continue  # a file path, not a recipe
        for name in re.findall(r"\b((?:xnnpack|vulkan)_[a-z0-9_]+)\b", span):
            if name not in recipes and not name.endswith("_backend") and name != "xnnpack_dynamic_quant":
                bad.append(f"{page}: recipe `{name}` in `{span}`")
        m = re.match(r"qharness ([a-z_]+)\b", span)
        if m and m.group(1) not in SUBCOMMANDS:
            bad.append(f"{page}: subcommand `{m.group(1)}` in `{span}`")
    assert not bad, "recipes or subcommands the docs name that do not exist:\n" + "\n".join(bad)
