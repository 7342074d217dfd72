"""The one YAML reader: ``yaml.safe_load`` that refuses a key given twice, and a file's YAML with one-line errors."""

from __future__ import annotations

import functools
import os
from pathlib import Path


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

    return UniqueKeyLoader


def load_yaml(text: str):
    """``yaml.safe_load(text)``, except that a key given twice in one mapping is an error (``yaml.YAMLError``) instead
    of the last one silently winning. Every YAML qharness reads (run configs, recipes, sweep files) goes through it.

    Example: ``load_yaml("lr: 1\nlr: 2")`` raises ``ConstructorError: duplicate key 'lr' (lines 1 and 2)``
    """
    import yaml

    return yaml.load(text, Loader=_unique_key_loader())


def read_yaml(path: str | os.PathLike, what: str):
    """The parsed YAML of ``path`` (``load_yaml``); a syntax error (with its line and column), a key given twice or
    non-UTF-8 text is a one-line ``UserError`` naming ``what`` ("config", "recipe", "sweep config") and the file.

    Example: ``read_yaml(Path("configs/qat_xnnpack.yaml"), "config")`` -> ``{"model": {...}, ...}``
    """
    import yaml

    from qharness.errors import UserError

    try:
        return load_yaml(Path(path).read_text())
    except yaml.YAMLError as e:
        if str(getattr(e, "problem", "")).startswith("duplicate key"):
            raise UserError(
                f"{what} file {path} has the {e.problem}", fix="keep one of them (YAML would silently use the last)"
            ) from e
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise UserError(f"{what} file {path} is not valid YAML{at}", fix="fix the YAML syntax") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{what} file {path} is not UTF-8 text", fix=f"save the {what} as UTF-8 YAML") from e
