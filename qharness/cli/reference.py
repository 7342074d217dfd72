"""The generated reference pages of the documentation site and the README's recipe table, written from the code:
every CLI subcommand (``cli/main.SUBCOMMANDS``, the plain commands' parsers, the run-config commands' own options),
every built-in recipe (the registry) and every ``summary.json`` field (``run/summary.RunSummary`` and its typed
sections). The config fields' page is ``schema/reference.py``'s.

    python -m qharness.cli.reference    # rewrites them all (tests/test_docs.py checks they are current)
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

from qharness.io.atomic import write_text_atomic

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
RECIPES_BEGIN = "<!-- recipe table: written by `python -m qharness.cli.reference` (do not edit by hand) -->"
RECIPES_END = "<!-- end of recipe table -->"
_HEADER = "<!-- Written by `python -m qharness.cli.reference` from the code (do not edit by hand). -->"


def _cell(text: str) -> str:
    """One Markdown table cell: on one line, ``|`` escaped, reST double backticks as Markdown code."""
    return " ".join(text.replace("``", "`").split()).replace("|", "\\|")


def _doc_head(obj) -> str:
    return _cell((inspect.getdoc(obj) or "").split("\n\nArgs:")[0].split("\nArgs:")[0])


def run_config_options() -> dict[str, dict[str, str]]:
    """The options a run-config subcommand takes beside the config fields: ``{subcommand: {--option: help}}``, from
    the signatures and ``Args:`` of ``QTrainer``'s methods (LightningCLI reads them the same way); Lightning's own
    ``fit``/``validate``/``test`` take ``--ckpt_path``."""
    from qharness.api.trainer import QTrainer
    from qharness.cli.args import _doc_args
    from qharness.cli.main import LIGHTNING

    out: dict[str, dict[str, str]] = {}
    for name in LIGHTNING:
        own = {"fit", "validate", "test"}
        if name in own:
            out[name] = {
                "--ckpt_path": "Checkpoint to resume from (fit) or score (validate, test): ``last`` or a path."
            }
            continue
        method = getattr(QTrainer, name)
        _, helps = _doc_args(method)
        params = [p for p in inspect.signature(method).parameters if p not in ("self", "model", "datamodule")]
        out[name] = {f"--{p}": helps.get(p, "") for p in params}
    return out


def plain_options() -> dict[str, dict[str, str]]:
    """``{subcommand: {--option or POSITIONAL: help}}`` of the plain subcommands (``cli/commands.py``'s parsers)."""
    from qharness.cli import commands
    from qharness.cli.args import parser_for
    from qharness.cli.main import PLAIN

    out: dict[str, dict[str, str]] = {}
    for name in PLAIN:
        parser = parser_for(getattr(commands, name), f"qharness {name}")
        opts = {}
        for action in parser._actions:
            if action.dest == "help":
                continue
            key = action.option_strings[0] if action.option_strings else action.dest.upper()
            opts[key] = action.help or ""
        out[name] = opts
    return out


def cli_page() -> str:
    from qharness.cli import commands
    from qharness.cli.main import LIGHTNING, SUBCOMMANDS

    lines = [
        "# CLI subcommands",
        "",
        _HEADER,
        "",
        "`qharness SUBCOMMAND ...`; `qharness --help` lists them, `qharness SUBCOMMAND --help` shows one. Every",
        "subcommand takes `--verbose` (or `QHARNESS_VERBOSE=1`): every upstream message, including the known-harmless",
        "ones qharness hides. A bad option or value ends in one line, `error: <what>. fix: <how>` (exit 2).",
        "",
        "## Run-config subcommands",
        "",
        "`qharness SUBCOMMAND CONFIG.yaml [--section.field value ...]`: a run config (one or more YAML files; the first",
        "argument is `--config`), every [config field](../config-reference.md) as an option (`--model.lr 2e-4`), and",
        "`--print_config` (the merged config, then exit).",
        "",
    ]
    options = run_config_options()
    for name in LIGHTNING:
        lines += [f"### `{name}`", "", _cell(SUBCOMMANDS[name]) + ".", ""]
        if options[name]:
            lines += ["| option | meaning |", "|---|---|"]
            lines += [f"| `{k}` | {_cell(v)} |" for k, v in options[name].items()]
            lines.append("")
    lines += ["## Plain subcommands", "", "Their options come from the function's signature and docstring.", ""]
    for name, opts in plain_options().items():
        lines += [f"### `{name}`", "", _doc_head(getattr(commands, name)), ""]
        if opts:
            lines += ["| argument | meaning |", "|---|---|"]
            lines += [f"| `{k}` | {_cell(v)} |" for k, v in opts.items()]
            lines.append("")
    return "\n".join(lines)


def _recipes():
    from qharness.recipes.registry import known_recipes, load_recipe

    return [load_recipe(n) for n in known_recipes()]


def recipes_page() -> str:
    lines = [
        "# Built-in recipes",
        "",
        _HEADER,
        "",
        "Every recipe `qharness recipes` lists, from its YAML under `qharness/recipes/builtin/`. A run picks one with",
        "`model.recipe` (a name here or a path to your own YAML; `base:` extends one). What each kind of recipe does:",
        "[Recipes explained](../recipes.md).",
        "",
        "| recipe | backend | modes | kind | KV cache | embedding | learned scales | rounding | rotation | what ships |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _recipes():
        rounding = getattr(r.settings, "rounding", "nearest") if r.quantized else "-"
        if getattr(r.settings, "zero_points", None):
            rounding += "; zero points: " + ", ".join(f"`{p}`" for p in r.settings.zero_points)
        if getattr(r.settings, "smoothing", None) is not None:
            rounding += f"; MLP inputs smoothed (α {r.settings.smoothing})"
        if getattr(r.settings, "split_head_input", False):
            rounding += "; lm_head input as two int8 rows"
        lines.append(
            f"| `{r.name}` | {r.backend} | {', '.join(r.modes)} | {r.kind} | {r.kv_cache} | {r.embedding_scheme} | "
            f"{'yes' if r.learns_scales else 'no'} | {rounding} | {r.rotation or '-'} | {_cell(r.description)} |"
        )
    return "\n".join(lines) + "\n"


def readme_recipe_table() -> str:
    """The README's recipe table (between its markers)."""
    lines = ["| recipe | modes | embedding | what ships |", "|---|---|---|---|"]
    lines += [
        f"| `{r.name}` | {', '.join(r.modes)} | {r.embedding_scheme} | {_cell(r.description)} |" for r in _recipes()
    ]
    return "\n".join(lines)


def readme_with_recipe_table(text: str) -> str:
    """``text`` (the README) with the generated table between its markers."""
    if RECIPES_BEGIN not in text or RECIPES_END not in text:
        raise ValueError(f"README.md lacks the markers {RECIPES_BEGIN!r} ... {RECIPES_END!r}")
    head, rest = text.split(RECIPES_BEGIN, 1)
    _, tail = rest.split(RECIPES_END, 1)
    return f"{head}{RECIPES_BEGIN}\n{readme_recipe_table()}\n{RECIPES_END}{tail}"


def _section_rows(cls, prefix: str, seen: set) -> tuple[list[str], list[tuple[type, str]]]:
    from qharness.schema.fields import field_docs
    from qharness.schema.reference import type_text

    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = [t for t in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(t)]
        origin = typing.get_origin(tp)
        key = {dict: ".<model>" if f.name == "metrics" else ".<key>", list: "[]"}.get(origin, "")
        rows.append(f"| `{prefix}{f.name}` | {type_text(tp)} | {_cell(docs.get(f.name, ''))} |")
        for t in inner:
            if t not in seen:
                seen.add(t)
                nested.append((t, f"{prefix}{f.name}{key}"))
    return rows, nested


def summary_page() -> str:
    from qharness.run.summary import SCHEMA_VERSION, RunSummary

    lines = [
        "# summary.json",
        "",
        _HEADER,
        "",
        f"Every run directory holds `summary.json` (schema version {SCHEMA_VERSION}): the typed record "
        "`qharness.RunSummary` (`RunSummary.read(path)`), written atomically by the run's stages and merged by later",
        "commands (`bench`, `evaluate`, a sweep's joint benchmark), which add their section without dropping earlier",
        "ones. Earlier schema versions read; a newer one is refused in one line. `null`: not measured in this run.",
        "",
        "## `RunSummary`",
        "",
        "| field | type | meaning |",
        "|---|---|---|",
    ]
    seen: set = {RunSummary}
    rows, queue = _section_rows(RunSummary, "", seen)
    lines += rows
    while queue:
        cls, prefix = queue.pop(0)
        rows, more = _section_rows(cls, prefix + ".", seen)
        queue += more
        lines += ["", f"## `{prefix}`: `{cls.__name__}`", "", _doc_head(cls), "", "| field | type | meaning |"]
        lines += ["|---|---|---|", *rows]
    return "\n".join(lines) + "\n"


def pages() -> dict[Path, str]:
    """Each generated page's path and text."""
    return {
        DOCS / "reference" / "cli.md": cli_page() + "\n",
        DOCS / "reference" / "recipes.md": recipes_page(),
        DOCS / "reference" / "summary-json.md": summary_page(),
    }


def main() -> None:
    from qharness.schema.reference import PATH, reference

    for path, text in {**pages(), PATH: reference(), README: readme_with_recipe_table(README.read_text())}.items():
        if not path.exists() or path.read_text() != text:
            write_text_atomic(path, text)
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
