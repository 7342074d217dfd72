"""The Python API's documented examples, each run verbatim in a fresh interpreter as a user pastes or runs it: the
README's "From Python" snippet (default suite) and ``examples/*.py`` (slow: the same behaviour, in-process, is in
tests/test_api.py). Each ends in a ``.pte`` whose parity gate passed and that generated text."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from qharness.run.summary import RunSummary

HEADING = "## From Python"


def readme_python_snippet() -> str:
    """The first ```python block after the README's "From Python" heading."""
    text = (ROOT / "README.md").read_text()
    assert HEADING in text, f"README.md lost its {HEADING!r} section"
    block = re.search(r"```python\n(.*?)```", text.split(HEADING, 1)[1], re.S)
    assert block, f"no ```python block under {HEADING!r}"
    return block.group(1)


def run_python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-P", *args], cwd=cwd, capture_output=True, text=True, timeout=1200, env=os.environ.copy()
    )
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
    return r


def check_run(out_dir: Path, printed: str) -> None:
    """The run's ``.pte`` passed the gate (its summary.json) and the last line printed the generated text's repr."""
    summary = RunSummary.read(out_dir / "summary.json")
    assert summary.passed is True, summary.parity
    assert (out_dir / "model.pte").is_file() and (out_dir / "tokenizer" / "tokenizer.json").is_file()
    generated = ast.literal_eval(re.search(r"('.*'|\".*\")\s*$", printed.strip().splitlines()[-1]).group(1))
    assert len(generated) > 0, printed[-500:]


def test_readme_python_snippet_runs_verbatim(tmp_path):
    code = readme_python_snippet()
    assert len(code.strip().splitlines()) <= 15
    r = run_python(["-c", code], cwd=tmp_path)
    out_dir = tmp_path / re.search(r'qharness\.export\(qm, "([^"]+)"', code).group(1)
    check_run(out_dir, r.stdout)
    assert RunSummary.read(out_dir / "summary.json").mode == "qat"


@pytest.mark.slow
@pytest.mark.parametrize("example, mode", [("qat_plain_loop.py", "qat"), ("ptq.py", "ptq")])
def test_example_runs_verbatim(example, mode, tmp_path):
    r = run_python([str(ROOT / "examples" / example), str(tmp_path / "out")], cwd=tmp_path)
    check_run(tmp_path / "out", r.stdout)
    assert RunSummary.read(tmp_path / "out" / "summary.json").mode == mode


@pytest.mark.fast
def test_the_docs_show_each_example_whole():
    """docs/python-api.md shows each example script whole (the code a reader pastes is the code the slow tests run
    verbatim): every example file is one of the page's ``python`` blocks, character for character."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "python-api.md").read_text(), re.S)
    examples = sorted((ROOT / "examples").glob("*.py"))
    assert len(examples) == 4
    for path in examples:
        assert path.read_text() in blocks, f"{path.name} is not shown whole in docs/python-api.md"
