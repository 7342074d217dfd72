"""The one YAML reader: ``yaml.safe_load`` that refuses a key given twice and bounds what a document may grow to
(its size in bytes, the values its aliases expand to, its depth), and a file's YAML with one-line errors."""

from __future__ import annotations

import contextlib
import functools
import os

from qharness.errors import UserError
from qharness.io.files import file_problem

MAX_BYTES = 1 << 20  # a run config, recipe, sweep or ship file is a few KB; more is not one a person wrote
MAX_VALUES = 100_000  # values of a document once its aliases are expanded (a "billion laughs" file expands to 10^9)
MAX_CHARS = 8 << 20  # characters of its scalars once expanded (one long string repeated by aliases)
MAX_DEPTH = 200  # nesting of mappings and lists (PyYAML composes recursively: deeper is a RecursionError)


class YamlTooLarge(UserError):
    """A YAML text past one of the reader's bounds; ``problem`` says which, without naming a file."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"the YAML text {problem}", fix)
        self.problem, self.bound_fix = problem, fix


def _check_expansion(root) -> None:
    """Refuse a composed document (PyYAML's node graph, where an alias is the anchored node itself, shared) whose
    expanded tree would pass ``MAX_VALUES`` values or ``MAX_CHARS`` characters, or that refers to itself: linear in
    the number of distinct nodes, before anything is constructed or walked by a consumer."""
    import yaml

    done: dict[int, tuple[int, int]] = {}  # id(node) -> (values, characters) of its expanded tree
    active: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in done:
            continue
        if isinstance(node, yaml.ScalarNode):
            done[key] = (1, len(node.value))
            continue
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        if not children_done:
            if key in active:  # a subtree is finished before its siblings start: an active node is an ancestor
                raise YamlTooLarge(
                    f"holds an alias to a mapping or list inside itself (line {node.start_mark.line + 1})",
                    fix="remove the alias that refers to its own anchor",
                )
            active.add(key)
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in done)
            if len(active) > MAX_DEPTH:
                raise YamlTooLarge(
                    f"nests mappings and lists more than {MAX_DEPTH} deep",
                    fix="flatten it: a config is a few levels deep",
                )
            continue
        values = 1 + sum(done[id(c)][0] for c in children)
        chars = sum(done[id(c)][1] for c in children)
        if values > MAX_VALUES or chars > MAX_CHARS:
            raise YamlTooLarge(
                f"expands to more than {MAX_VALUES:,} values or {MAX_CHARS:,} characters through its aliases "
                f"(&anchor / *alias, line {node.start_mark.line + 1})",
                fix="write the values out, or use fewer aliases of aliases",
            )
        done[key] = (values, chars)
        active.discard(key)


@functools.cache
def _unique_key_loader():
    """PyYAML's ``SafeLoader`` that refuses a mapping with the same key twice (plain PyYAML keeps the last one,
    silently): a ``yaml.constructor.ConstructorError`` naming the key and both lines."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # `<<: *base`: merged keys may be overridden, as YAML means them to be
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.setdefault(key, key_node)
                    except TypeError:  # an unhashable key: SafeLoader's own error follows
                        continue
                    if first is not key_node:
                        raise yaml.constructor.ConstructorError(
                            None,
                            None,
                            f"duplicate key {key!r} (lines {first.start_mark.line + 1} and {key_node.start_mark.line + 1})",
                            key_node.start_mark,
                        )
            return super().construct_mapping(node, deep)

        def get_single_node(self):
            node = super().get_single_node()
            if node is not None:
                _check_expansion(node)
            return node

    return UniqueKeyLoader


def load_yaml(text: str):
    """``yaml.safe_load(text)``, except that a key given twice in one mapping is an error (``yaml.YAMLError``) instead
    of the last one silently winning, and that a text past the bounds (``MAX_BYTES`` long, aliases expanding to more
    than ``MAX_VALUES`` values or ``MAX_CHARS`` characters, an alias inside itself, ``MAX_DEPTH`` levels) is a
    ``YamlTooLarge`` (a ``UserError``) at once, before any consumer walks it. Every YAML qharness reads (run configs,
    their overrides, recipes, sweep and ship files) goes through it.

    Example: ``load_yaml("lr: 1\nlr: 2")`` raises ``ConstructorError: duplicate key 'lr' (lines 1 and 2)``
    """
    import yaml

    return _bounded(text, yaml.load)


def _bounded(text: str, parse):
    """``parse(text, Loader=...)`` (``yaml.load``, or ``yaml.compose`` to check without building values) with the
    reader's bounds: ``YamlTooLarge`` past ``MAX_BYTES`` or ``MAX_DEPTH``, and past the alias bounds as it composes."""
    if len(text) > MAX_BYTES:
        raise YamlTooLarge(
            f"is {len(text):,} characters long (at most {MAX_BYTES:,})", fix="a config or recipe is a few KB: trim it"
        )
    try:
        return parse(text, Loader=_unique_key_loader())
    except RecursionError as e:
        raise YamlTooLarge(
            f"nests mappings and lists more than {MAX_DEPTH} deep", fix="flatten it: a config is a few levels deep"
        ) from e


def read_yaml(path: str | os.PathLike, what: str):
    """The parsed YAML of ``path`` (``load_yaml``); a path that is no regular file (missing, a directory, a FIFO or a
    device: never opened, so a FIFO cannot block), a file over ``MAX_BYTES``, a syntax error (with its line and
    column), a key given twice, a text past the alias bounds or non-UTF-8 text is a one-line ``UserError`` naming
    ``what`` ("config", "recipe", "sweep config") and the file.

    Example: ``read_yaml(Path("configs/qat_xnnpack.yaml"), "config")`` -> ``{"model": {...}, ...}``
    """
    text = _file_text(path, what)
    with _one_line(path, what):
        return load_yaml(text)


def check_yaml_file(path: str | os.PathLike, what: str) -> None:
    """``read_yaml``'s checks of a YAML file that another program will construct (lm-eval's task files, whose
    ``!function`` tags qharness does not construct): the file, its size, its syntax and the alias bounds, each a
    one-line ``UserError``, without building any value.

    Example: ``check_yaml_file("tasks/my_task.yaml", "lm-eval task")`` -> None
    """
    import yaml

    text = _file_text(path, what)
    with _one_line(path, what):
        _bounded(text, yaml.compose)  # composing is what the bounds check: no value is built


def _file_text(path: str | os.PathLike, what: str) -> str:
    problem = file_problem(path)
    if problem:
        raise UserError(f"{what} file {path} {problem}", fix=f"give the path of a {what} .yaml file")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise UserError(f"{what} file {path} cannot be read ({e.strerror or e})", fix=f"check the {what} file") from e
    if len(data) > MAX_BYTES:
        raise UserError(
            f"{what} file {path} is over {MAX_BYTES:,} bytes ({os.path.getsize(path):,})",
            fix=f"a {what} is a few KB: give the right file, or trim it",
        )
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise UserError(f"{what} file {path} is not UTF-8 text", fix=f"save the {what} as UTF-8 YAML") from e


@contextlib.contextmanager
def _one_line(path: str | os.PathLike, what: str):
    """YAML errors while reading ``path`` as one-line ``UserError``s naming it."""
    import yaml

    try:
        yield
    except YamlTooLarge as e:
        raise UserError(f"{what} file {path} {e.problem}", fix=e.bound_fix) from None
    except yaml.YAMLError as e:
        if str(getattr(e, "problem", "")).startswith("duplicate key"):
            raise UserError(
                f"{what} file {path} has the {e.problem}", fix="keep one of them (YAML would silently use the last)"
            ) from e
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise UserError(f"{what} file {path} is not valid YAML{at}", fix="fix the YAML syntax") from e
