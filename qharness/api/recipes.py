"""Backend recipes as typed objects: the built-in names and any recipe YAML.

Example::

    import qharness
    qharness.list_recipes()[:2]                  # ['vulkan_int8w', 'xnnpack_8da2w']
    r = qharness.load_recipe("xnnpack_8da4w")    # a Recipe: r.backend == "xnnpack", r.modes == ("qat", "ptq")
"""

from __future__ import annotations

from pathlib import Path

from qharness.recipes import registry
from qharness.recipes.registry import Recipe

__all__ = ["Recipe", "list_recipes", "load_recipe"]


def list_recipes() -> list[str]:
    """The built-in recipe names (``qharness recipes`` prints them with their backends). Example::

    "xnnpack_8da4w" in qharness.list_recipes()   # True
    """
    return registry.known_recipes()


def load_recipe(name_or_path: str | Path | Recipe) -> Recipe:
    """A recipe by built-in name or YAML path (``base:`` chains followed, settings typed); a ``Recipe`` is returned as
    it is. An unknown name is one ``UserError`` line listing the known ones. Example::

    qharness.load_recipe("xnnpack_8da4w").quantized     # True
    qharness.load_recipe("my_recipe.yaml")              # base: xnnpack_8da4w, then fields
    """
    if isinstance(name_or_path, Recipe):
        return name_or_path
    return registry.load_recipe(str(name_or_path) if isinstance(name_or_path, Path) else name_or_path)
