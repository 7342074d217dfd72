"""Building a config section (a dataclass) from plain values, as the command line and YAML give them.

``build(ModelConfig, "model", {"lr": "1e-3"})`` checks every name against the dataclass's fields (an unknown one is a
``UserError`` naming it) and every value against the field's type (numeric text counts as a number and ``yes``/``no``
as a bool, as jsonargparse reads them), then builds the dataclass. The field docs (a class docstring's ``Args:``)
are read by ``field_docs``: the same text jsonargparse shows in ``--help``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from typing import Any, Literal, Union

from qharness.errors import UserError

_BOOLS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}
_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text", type(None): "null"}


@functools.lru_cache(maxsize=None)
def hints(cls: type) -> dict[str, Any]:
    """``{field: type}`` of a dataclass, its string annotations resolved."""
    return typing.get_type_hints(cls)


def _members(tp) -> tuple:
    origin = typing.get_origin(tp)
    return typing.get_args(tp) if origin in (Union, types.UnionType) else (tp,)


def number(value, kind: type = float):
    """``value`` as ``kind`` (int or float; numeric text too, as jsonargparse reads ``1e-3``), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = float(value) if kind is float else int(value)
        except ValueError:
            return None
    if isinstance(value, int) or (kind is float and isinstance(value, float)):
        return float(value) if kind is float and not isinstance(value, int) else value
    return None


_NO = object()


def _coerce_one(value, tp, name: str):
    """``value`` as the single type ``tp``, or ``_NO``."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return None if value is None else _NO
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        return _BOOLS.get(value.strip().lower(), _NO) if isinstance(value, str) else _NO
    if tp in (int, float):
        out = number(value, tp)
        return _NO if out is None else out
    if tp is str:
        if isinstance(value, str):
            return value
        return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else _NO
    if tp in (dict, list):
        return value if isinstance(value, tp) else _NO
    if origin is Literal:
        return value if value in typing.get_args(tp) else _NO
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return _NO
        item = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        items = [_coerce_one(v, item, name) for v in value]
        return _NO if any(v is _NO for v in items) else origin(items)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            return _NO
        return build(tp, name, value)
    return value  # a type this check does not know: the parser after it decides


def _describe(tp) -> str:
    words = []
    for member in _members(tp):
        if typing.get_origin(member) is Literal:
            words.append(f"one of {', '.join(map(str, typing.get_args(member)))}")
        elif typing.get_origin(member) in (list, tuple):
            words.append("a list")
        elif dataclasses.is_dataclass(member):
            words.append(f"a mapping of {', '.join(f.name for f in dataclasses.fields(member))}")
        else:
            words.append(_WORDS.get(member, getattr(member, "__name__", str(member))))
    return " or ".join(words)


def coerce(value, tp, name: str):
    """``value`` as the field type ``tp`` (a union takes its first member that fits), else a ``UserError`` naming
    the field ``name``. Example: ``coerce("1e-3", float, "model.lr")`` -> 0.001; ``coerce("x", int, "data.seq_len")``
    -> UserError: data.seq_len must be an integer (got 'x')."""
    members = _members(tp)
    if value is None and type(None) in members:
        return None
    for member in sorted(members, key=lambda m: m is str):  # text last: "5" for int | str is the number
        out = _coerce_one(value, member, name)
        if out is not _NO:
            return out
    words = _describe(tp)
    raise UserError(f"{name} must be {words} (got {value!r})", fix=f"give {name} {words}")


def check_known(section: str, given, known) -> None:
    """``UserError`` naming the keys of ``given`` that are not among ``known`` (the section's fields)."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise UserError(
            f"unknown config field(s) {', '.join(f'{section}.{k}' for k in unknown)}",
            fix=f"{section} fields are {', '.join(known)} (qharness fit --help)",
        )


def build(cls, section: str, values, *, strict: bool = True):
    """The dataclass ``cls`` from ``values`` (a mapping; None: the defaults): names checked against its fields
    (``strict=False``: other names are left to another parser), values coerced to the fields' types. Building
    runs the section's own ``validate()`` where it has one (in ``__post_init__``)."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        names = ", ".join(f.name for f in dataclasses.fields(cls))
        raise UserError(
            f"{section} must be a mapping of {names} (got {values!r})", fix=f"e.g. {section}: {{...}}, or leave it out"
        )
    types_ = hints(cls)
    if strict:
        check_known(section, values, types_)
    kwargs, wrong = {}, None
    for k, v in values.items():
        if k in types_:
            try:
                kwargs[k] = coerce(v, types_[k], f"{section}.{k}")
            except UserError as e:  # the section's own rule may say more (``targets must be a list of patterns``)
                kwargs[k], wrong = v, wrong or e
    try:
        built = cls(**kwargs)
    except (TypeError, ValueError, AttributeError) as e:
        if wrong is None:
            raise
        raise wrong from e
    if wrong is not None:
        raise wrong
    return built


def field_docs(cls) -> dict[str, str]:
    """``{field: help text}`` from the ``Args:`` section of ``cls``'s docstring (Google style, as jsonargparse reads
    it for ``--help``), each entry's lines joined."""
    doc = cls.__doc__ or ""
    _, _, args = doc.partition("\n    Args:\n")
    docs: dict[str, list[str]] = {}
    current = None
    for line in args.splitlines():
        m = re.match(r"^ {8}(\w+): ?(.*)$", line)
        if m:
            current = m.group(1)
            docs[current] = [m.group(2).strip()]
        elif current and line.startswith(" " * 12):
            docs[current].append(line.strip())
        elif line.strip():
            break
    return {k: " ".join(v) for k, v in docs.items()}


def typed(obj, section: str) -> None:
    """Each field of the dataclass ``obj`` coerced to its declared type in place (``coerce``: numeric text is a number,
    ``yes``/``no`` a bool), else a ``UserError`` naming ``section.field``."""
    for name, tp in hints(type(obj)).items():
        object.__setattr__(obj, name, coerce(getattr(obj, name), tp, f"{section}.{name}"))
