"""A non-editable install works: the wheel built from the repo carries every module and data file, and the
installed package (not the checkout, not the editable install) lists its recipes and task templates and
calibrates a tiny model (about 35 s on an idle 2-core machine: the whole stack imports, quantizes and lowers).

The wheel is installed with ``pip install --no-deps --target SITE``; its dependencies come from this venv.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT, write_config

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]


def _source_files() -> list[str]:
    """The package's files as git sees them (tracked or new, not ignored: no caches, no build output)."""
    cmd = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "pyproject.toml", "README.md", "qharness"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return [n for n in out.stdout.splitlines() if (ROOT / n).is_file()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel`` of a copy of the tracked sources (an in-tree build would leave build/ in the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in _source_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    cmd = [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("qharness-*.whl")
    return whl


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    cmd = [*PIP, "install", "--no-deps", "--target", str(site), str(wheel)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return site


def run_installed(site: Path, cwd: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python ...`` with only the installed wheel importable as ``qharness`` (cwd outside the repo)."""
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.fast
def test_wheel_holds_every_module_and_data_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    package = [n for n in _source_files() if n.startswith("qharness/")]
    assert any(n.endswith(".yaml") for n in package)  # recipes and lm-eval task templates are among them
    assert [n for n in package if n not in names] == []


@pytest.mark.fast
def test_installed_wheel_lists_every_builtin_recipe_and_task_template(site, tmp_path):
    probe = "import qharness, qharness.evaluation.tasks as t\nprint(qharness.__file__)\n"
    probe += "print(*t.TEMPLATES.glob('*.yaml'))"
    r = run_installed(site, tmp_path, "-c", probe)
    assert r.returncode == 0, r.stderr[-3000:]
    where, templates = r.stdout.splitlines()
    assert Path(where).is_relative_to(site), where  # the wheel ran, not the checkout or the editable install
    shipped = sorted(Path(p).name for p in templates.split())
    assert shipped == sorted(p.name for p in (ROOT / "qharness/evaluation/lm_eval_tasks").glob("*.yaml"))

    r = run_installed(site, tmp_path, "-m", "qharness", "recipes")
    assert r.returncode == 0, r.stderr[-3000:]
    listed = [line.split()[0] for line in r.stdout.splitlines()[1:] if line.strip()]  # below the header line
    assert listed == sorted(p.stem for p in (ROOT / "qharness" / "recipes" / "builtin").glob("*.yaml"))


def test_installed_wheel_calibrates_a_tiny_model_to_a_pte_that_passes_parity(site, tiny_llama, corpus, tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(corpus.read_text()[:100_000])
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "ptq.yaml",
        tiny_llama,
        data,
        run,
        model={"mode": "ptq", "recipe": "xnnpack_int8_dynamic"},
        data={"seq_len": 16, "batch_size": 2},
        deploy={"max_seq_len": 32},
        calibration={"blocks": 2},
        parity={"eval_blocks": 2, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
        bench={"enabled": False},
        eval={"enabled": False},
    )
    r = run_installed(site, tmp_path, "-m", "qharness", "calibrate", str(cfg))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (run / "model.pte").is_file() and summary["recipe"] == "xnnpack_int8_dynamic"
    assert summary["parity"]["passed"], summary["parity"]
