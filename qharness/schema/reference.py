"""``docs/config-reference.md``, written from the schema: every section and field with its type, default and help.

python -m qharness.schema.reference    # rewrites docs/config-reference.md (tests/test_schema.py checks it is current)
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path

from qharness.io.atomic import write_text_atomic
from qharness.schema.fields import field_docs, hints
from qharness.schema.run import LIGHTNING_SECTIONS, RunConfig

PATH = Path(__file__).resolve().parents[2] / "docs" / "config-reference.md"


def type_text(tp) -> str:
    """A field type as the reference shows it: ``int | null``, ``list of str``, ``one of qat, ptq``."""
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_text(t) for t in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (list, tuple):
        return f"list of {type_text(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return f"mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def value_text(value) -> str:
    """A default as YAML writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(value_text, value)) + "]"
    return str(value)


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _summary(cls) -> str:
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def _table(cls, prefix: str) -> list[str]:
    docs, kinds = field_docs(cls), hints(cls)
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        text = docs.get(f.name, "").replace("|", "\\|")
        default = _default(f)
        shown = "" if dataclasses.is_dataclass(default) else f"`{value_text(default)}`"
        lines.append(f"| `{prefix}{f.name}` | {type_text(kinds[f.name])} | {shown} | {text} |")
    return lines


def _nested(cls) -> list[tuple[str, type]]:
    """The fields of ``cls`` that hold a dataclass of their own (``model.distill``): ``(name, dataclass)``."""
    out = []
    for name, tp in hints(cls).items():
        members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        out += [(name, m) for m in members if dataclasses.is_dataclass(m)]
    return out


def reference() -> str:
    """The config reference as Markdown."""
    docs = field_docs(RunConfig)
    lines = [
        "# Config reference",
        "",
        "<!-- Written by `python -m qharness.schema.reference` from qharness/schema (do not edit by hand). -->",
        "",
        "Every section of a run config (`qharness fit|calibrate|... CONFIG.yaml`), each field with its type, default",
        "and meaning. On the command line a field is `--section.field value` (`--model.lr 2e-4`); in Python,",
        "`qharness.schema.RunConfig.from_yaml(path, {'model.lr': 2e-4})`. `qharness fit --help` shows the same text.",
        "",
        f"- `seed_everything` ({type_text(hints(RunConfig)['seed_everything'])}, default "
        f"`{value_text(RunConfig.seed_everything)}`): {docs['seed_everything']}",
    ]
    for name, cls in RunConfig.sections().items():
        lines += ["", f"## `{name}`", "", f"{docs[name]} {_summary(cls)}"]
        if name in LIGHTNING_SECTIONS:
            lines[-1] += " Every other field of the Lightning class is accepted too and checked by Lightning."
        lines += ["", *_table(cls, f"{name}.")]
        for field, nested in _nested(cls):
            lines += ["", f"### `{name}.{field}`", "", _summary(nested), "", *_table(nested, f"{name}.{field}.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Write the reference to ``docs/config-reference.md`` (or the path given)."""
    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0]) if argv else PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, reference())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
