"""The documentation site builds in strict mode (a broken link, anchor or API reference fails), its generated pages
and the README's recipe table are what ``python -m qharness.cli.reference`` writes from the code, the README stays
short and its links resolve, and no module, docstring or page cites a module that does not exist."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT

from qharness.cli import reference


def test_the_site_builds_in_strict_mode(tmp_path):
    """README's build command, in a fresh process: `mkdocs build --strict` (mkdocs.yml sets strict too)."""
    block = re.search(r"```bash\n(\S*mkdocs build --strict)", (ROOT / "README.md").read_text())
    assert block, "README.md lost its docs build command"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    site = tmp_path / "site"
    assert (site / "index.html").is_file() and (site / "search" / "search_index.js").is_file()  # offline search
    for page in ("tutorials/own-data", "tutorials/qat-vs-ptq", "tutorials/many-devices", "reference/api"):
        assert (site / f"{page}.html").is_file(), page
    assert "qharness.api.prepare.prepare" in (site / "reference" / "api.html").read_text()


@pytest.mark.fast
def test_generated_pages_are_current():
    for path, text in reference.pages().items():
        assert path.read_text() == text, f"{path.name} is stale: run python -m qharness.cli.reference"


@pytest.mark.fast
def test_readme_recipe_table_is_current():
    text = (ROOT / "README.md").read_text()
    assert reference.readme_with_recipe_table(text) == text, "run: python -m qharness.cli.reference"
    from qharness.recipes.registry import known_recipes

    for name in known_recipes():
        assert f"| `{name}` |" in text


@pytest.mark.fast
def test_readme_is_short_and_its_links_resolve():
    for name in ("README.md", "BENCHMARKS.md", "DEVELOPING.md"):
        text = (ROOT / name).read_text()
        if name == "README.md":
            assert len(text.splitlines()) <= 250
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not target.startswith("http"):
                assert (ROOT / target).exists(), f"{name} links to {target}, which does not exist"


@pytest.mark.fast
def test_the_nav_reaches_the_pages_a_newcomer_looks_for():
    """One click from the navigation: own chat data, which recipe to ship, many GPUs."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    titles = {}

    def walk(items):
        for item in items:
            for title, value in item.items():
                walk(value) if isinstance(value, list) else titles.setdefault(title, value)

    walk(nav)
    for words, page in (
        ("chat", "tutorials/own-data.md"),
        ("which recipe", "tutorials/qat-vs-ptq.md"),
        ("GPUs", "tutorials/many-devices.md"),
    ):
        assert any(words.lower() in t.lower() and p == page for t, p in titles.items()), (words, titles)
    for page in titles.values():
        assert (ROOT / "docs" / page).is_file(), page


MODULE_PATH = re.compile(r"(?<![\w./])(?:qharness/[\w/]+\.py\b|qharness(?:\.\w+)+)")


@pytest.mark.fast
def test_modules_named_in_docs_and_docstrings_exist():
    """Every ``qharness/x/y.py`` path and ``qharness.x.y`` module named in pyproject.toml, the docs and the package's
    sources exists (a module moved or renamed leaves no stale pointer)."""
    files = [ROOT / "pyproject.toml", ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "DEVELOPING.md"]
    files += sorted((ROOT / "docs").rglob("*.md")) + sorted((ROOT / "qharness").rglob("*.py"))
    files += sorted((ROOT / "scripts").glob("*.py"))
    bad = []
    for f in files:
        for name in set(MODULE_PATH.findall(f.read_text())):
            if name.endswith(".py"):
                ok = (ROOT / name).exists()
            else:
                parts = name.split(".")
                # qharness.a.b.attr: the longest prefix that is a module or package
                ok = (
                    any(
                        (ROOT / "/".join(parts[:i])).with_suffix(".py").is_file()
                        or (ROOT / "/".join(parts[:i]) / "__init__.py").is_file()
                        for i in range(2, len(parts) + 1)
                    )
                    or parts[1] in _public_names()
                )
            if not ok:
                bad.append(f"{f.relative_to(ROOT)}: {name}")
    assert not bad, "modules that do not exist:\n" + "\n".join(sorted(bad))


def _public_names() -> set[str]:
    import qharness

    return set(qharness.__all__)
