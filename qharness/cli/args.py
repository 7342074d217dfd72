"""One grammar for the plain subcommands: a function's signature and docstring are its command line (litgpt's way).

Positional-or-keyword parameters are positional arguments (optional with a default); keyword-only ones without a default
are required ``--options``; ``bool`` with a ``False`` default is a flag; ``list[str]`` is an option given once per
value (``--pte a --pte b``); ``X | None`` takes an ``X``. Help text comes from the docstring's ``Args:`` section.

Example::

    def report(runs_dir: str, *, metric: str = "ppl", no_wandb: bool = False) -> None:
        '''Accuracy vs latency of the runs under RUNS_DIR.

        Args:
            runs_dir: directory searched for summary.json files.
        '''

    call(report, ["runs/", "--no_wandb"], prog="qharness report")
"""

from __future__ import annotations

import argparse
import inspect
import re
import types
import typing
from collections.abc import Callable

from qharness.errors import usage_error


class _Parser(argparse.ArgumentParser):
    """argparse, refusing in one line (``usage_error``) instead of a usage dump."""

    def error(self, message: str):
        raise usage_error(message, self.prog, takes_config=False)


def _doc_args(fn: Callable) -> tuple[str, dict[str, str]]:
    """The docstring's first paragraph and its ``Args:`` entries (``name: text``, continuation lines indented)."""
    doc = inspect.getdoc(fn) or ""
    head = doc.split("\n\n")[0].replace("\n", " ")
    args: dict[str, str] = {}
    section = doc.split("Args:", 1)[1] if "Args:" in doc else ""
    name = None
    for line in section.splitlines():
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            name = m.group(1)
            args[name] = m.group(2)
        elif name and line.startswith("        "):
            args[name] += " " + line.strip()
        elif line.strip():
            break
    return head, args


def _base(t):
    """``X`` of ``X | None``; the type itself otherwise."""
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return t


def parser_for(fn: Callable, prog: str) -> argparse.ArgumentParser:
    head, helps = _doc_args(fn)
    p = _Parser(prog=prog, description=head)
    hints = typing.get_type_hints(fn)
    for name, param in inspect.signature(fn).parameters.items():
        t, help_ = _base(hints.get(name, str)), helps.get(name)
        help_ = help_ and help_.replace("%", "%%")  # argparse formats help with %: a literal one, e.g. "2%"
        required = param.default is inspect.Parameter.empty
        if param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            optional = {} if required else {"nargs": "?", "default": param.default}
            p.add_argument(name, type=t, help=help_, **optional)
        elif t is bool:
            p.add_argument(f"--{name}", action="store_true", help=help_)
        elif typing.get_origin(t) is list:
            (item,) = typing.get_args(t)
            p.add_argument(
                f"--{name}",
                type=item,
                action="append",
                required=required,
                default=None if required else param.default,
                help=(help_ or "") + " (repeat for several)",
            )
        else:
            default = None if required else param.default
            p.add_argument(
                f"--{name}",
                type=t,
                required=required,
                default=default,
                help=(help_ or "") + ("" if required or default is None else f" (default: {default})"),
            )
    return p


def _attach_dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--opt -1%`` as ``--opt=-1%``: argparse reads a value that starts with ``-`` and is not a plain negative
    number as an option, and refuses ``--opt`` as missing its value. A value after an option that takes one is kept
    as its value when it starts with a single ``-`` and is no option of ``parser`` (its checks then judge it)."""
    takes_value = {o for a in parser._actions if a.option_strings and a.nargs is None for o in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        following = argv[i + 1] if i + 1 < len(argv) else None
        if (
            arg in takes_value
            and following is not None
            and following.startswith("-")
            and not following.startswith("--")
            and following not in parser._option_string_actions
        ):
            out.append(f"{arg}={following}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def call(fn: Callable, argv: list[str], prog: str):
    """Parse ``argv`` by ``fn``'s signature and call it."""
    parser = parser_for(fn, prog)
    return fn(**vars(parser.parse_args(_attach_dash_values(parser, argv))))
