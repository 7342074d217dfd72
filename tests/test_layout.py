"""The package's layout: no import cycles, and packages that import only what comes before them in the flow.

Imports inside functions count too: a lazy import is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qharness

PACKAGE = Path(qharness.__file__).parent

# The flow, in order (ARCHITECTURE.md). A module may import its own package and the packages before it.
# Base: shared by every stage (errors, atomic writes, progress, the typed configs, upstream adapters).
FLOW = [
    "base",
    "sources",
    "recipes",
    "schema",
    "data",
    "training",
    "deploy",
    "checks",
    "runtime",
    "evaluation",
    "run",
    "reporting",
    "sweep",
    "shipping",
    "api",
    "cli",
]
BASE = {"errors", "io", "progress", "config", "upstream", "__init__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The qharness modules ``path`` imports (``from qharness.x import y`` counts ``qharness.x.y`` when that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("qharness"))
        elif (
            isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qharness") and node.level == 0
        ):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) - {name} for name, path in mods.items()}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "cli"
    if len(parts) == 1 or parts[1] in BASE:
        return "base"
    return parts[1]


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (c := visit(n)):
            return c
    return None


@pytest.mark.fast
def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.fast
def test_no_import_cycles():
    assert find_cycle(graph()) is None


@pytest.mark.fast
def test_every_package_is_in_the_flow():
    assert {layer(m) for m in modules()} <= set(FLOW), (
        "a new package: add it to FLOW (and ARCHITECTURE.md) in flow order"
    )


@pytest.mark.fast
def test_packages_import_only_earlier_stages():
    late = []
    for module, deps in graph().items():
        for dep in deps:
            if FLOW.index(layer(dep)) > FLOW.index(layer(module)):
                late.append(f"{module} imports {dep} ({layer(dep)} comes after {layer(module)})")
    assert not late, "\n".join(sorted(late))


def upstream_imports(path: Path, top: str) -> list[str]:
    """``path``'s imports of the package ``top`` (``"executorch"``), as ``"line: module"``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        out += [f"{node.lineno}: {n}" for n in names if n == top or n.startswith(top + ".")]
    return out


@pytest.mark.fast
def test_upstream_imports_finds_both_forms(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import executorch.exir\ndef g():\n    from executorch.exir.schema import Tensor\nimport executorchx\n"
    )
    assert upstream_imports(f, "executorch") == ["1: executorch.exir", "3: executorch.exir.schema"]


@pytest.mark.fast
def test_executorch_is_imported_only_in_the_upstream_package():
    """ExecuTorch moves private modules between releases: every import of it lives in ``qharness/upstream``
    (imports.py names one function per symbol), so a new release is one file to edit."""
    stray = [
        f"{path.relative_to(PACKAGE.parent)}:{hit}"
        for name, path in modules().items()
        if not name.startswith("qharness.upstream")
        for hit in upstream_imports(path, "executorch")
    ]
    assert not stray, "import it through qharness/upstream/imports.py:\n" + "\n".join(stray)


def test_ruff_lint_and_format_are_clean():
    """The linter and formatter configured in pyproject.toml ([tool.ruff]) pass on the whole tree."""
    import subprocess
    import sys

    root = PACKAGE.parent
    for args in (["check", "qharness", "tests", "scripts"], ["format", "--check", "qharness", "tests", "scripts"]):
        r = subprocess.run([sys.executable, "-m", "ruff", *args], cwd=root, capture_output=True, text=True)
        assert r.returncode == 0, f"ruff {' '.join(args)}:\n{r.stdout[-3000:]}{r.stderr[-1000:]}"


@pytest.mark.fast
def test_the_fast_tier_covers_every_stage():
    """Every step of the flow has tests in the fast tier (``pytest -m "fast and not slow"``, DEVELOPING.md): some test
    file with ``@pytest.mark.fast`` tests imports from it. A stage whose fast tests all went (moved, slowed, marked
    slow) fails here."""
    known = set(modules())
    covered = set()
    for path in (PACKAGE.parent / "tests").glob("test_*.py"):
        if "@pytest.mark.fast" in path.read_text():
            covered |= {layer(m) for m in imports_of(path, known)}
    assert set(FLOW) - covered == set(), "stages without a fast test"
