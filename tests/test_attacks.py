"""An attacker's tries on the CLI (issue #43, "Safe under attack"): planted code in a run directory or in the
working directory, names and paths that would write or delete outside their directory, strings from a
``summary.json`` that would inject spreadsheet formulas or Markdown/HTML into the report, sizes that would allocate
more memory than the machine has, and sweep inputs that were silently wrong. Each ends in one ``error: ... fix:``
line (or, for the report, a skipped run with a note), before any work."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT
from test_report import RUNS, summary

from qharness.errors import UserError
from qharness.io import write_json_atomic
from qharness.reporting.sweep import load_sweep, plan


def sweep_file(tmp_path, runs, **extra):
    spec = {"sweep_dir": str(tmp_path / "sweep"), "runs": runs, "report": {"wandb": False}, **extra}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


# ---------------------------------------------------------------- sweep names and inputs


@pytest.mark.parametrize("name", ["../../victim", "/tmp/victim", "a/b", "..", "x\ny", "tab\there", "rtl\u202eexe"])
def test_a_sweep_run_name_that_is_not_a_plain_name_is_refused(tmp_path, name):
    path = sweep_file(tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"], "name": name}])
    with pytest.raises(UserError, match=r"runs\[0\]\.name .* is not a plain name"):
        plan(load_sweep(path))


def test_a_recipe_path_whose_name_is_not_plain_is_refused(tmp_path):
    recipe = tmp_path / "bad\nname.yaml"
    recipe.write_text((ROOT / "qharness" / "recipes" / "builtin" / "xnnpack_int8_dynamic.yaml").read_text())
    path = sweep_file(tmp_path, [{"recipe": str(recipe), "modes": ["ptq"]}])
    with pytest.raises(UserError, match="run name .* is not a plain name"):
        plan(load_sweep(path))


def test_a_run_named_like_the_baseline_is_refused_not_dropped(tmp_path):
    path = sweep_file(tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"], "name": "xnnpack_fp32"}])
    with pytest.raises(UserError, match="two runs would be named xnnpack_fp32-ptq"):
        plan(load_sweep(path))


def test_mode_and_modes_together_are_refused(tmp_path):
    path = sweep_file(tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"], "mode": "qat"}])
    with pytest.raises(UserError, match=r"runs\[0\] has both mode and modes.*fix: keep one: modes: \['ptq', 'qat'\]"):
        load_sweep(path)


@pytest.mark.parametrize(
    "metric, message",
    [
        ("nonsense", "'nonsense': not a metric name"),
        ("hellaswag/acc", "no run evaluates task 'hellaswag'"),
        ("qharness_mc/acc", "task qharness_mc has no metric 'acc'"),
        ("qharness_mc/acc_mutual_info/nowhere", "not a metric name"),
        (3, "not a metric name"),
    ],
)
def test_a_report_metric_no_run_will_have_is_refused_before_the_runs(tmp_path, metric, message):
    path = sweep_file(
        tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}], report={"metric": metric, "wandb": False}
    )
    with pytest.raises(UserError, match="report.metric .*" + message.replace("[", r"\[")):
        plan(load_sweep(path))


@pytest.mark.parametrize(
    "metric", ["ppl", "decode_ms_per_token", "qharness_mc/acc_mutual_info", "qharness_ppl/bits_per_byte/fp"]
)
def test_report_metrics_the_runs_will_have_are_accepted(tmp_path, metric):
    path = sweep_file(
        tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}], report={"metric": metric, "wandb": False}
    )
    assert len(plan(load_sweep(path))) == 2


def test_a_task_metric_with_eval_disabled_is_refused(tmp_path):
    path = sweep_file(
        tmp_path,
        [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}],
        report={"metric": "qharness_mc/acc_mutual_info"},
        config={"eval": {"enabled": False}},
    )
    with pytest.raises(UserError, match="no run evaluates task 'qharness_mc' \\(eval.tasks: none, eval disabled\\)"):
        plan(load_sweep(path))


def test_a_sweep_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file")
    path = sweep_file(tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}], sweep_dir=str(tmp_path / "taken"))
    with pytest.raises(UserError, match="sweep_dir .*taken is a file, not a directory"):
        load_sweep(path)
    path = sweep_file(
        tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}], sweep_dir=str(tmp_path / "taken" / "sub")
    )
    with pytest.raises(UserError, match="lies under .*taken, which is a file"):
        load_sweep(path)


def test_a_run_directory_linked_out_of_the_sweep_is_refused(tmp_path):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "sweep" / "xnnpack_int8_dynamic-ptq").symlink_to(tmp_path / "elsewhere")
    path = sweep_file(tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}])
    with pytest.raises(UserError, match="its run directory .* lies outside"):
        plan(load_sweep(path))


# ---------------------------------------------------------------- planted code in the working directory


def test_child_pythons_do_not_import_from_the_working_directory(tmp_path):
    from qharness.upstream.process import python_command

    (tmp_path / "json.py").write_text("raise SystemExit('planted json.py ran')\n")
    r = subprocess.run(
        python_command("-c", "import json, sys; print(json.__file__)"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0 and "planted" not in r.stderr and str(tmp_path) not in r.stdout


def test_a_sweep_does_not_run_a_yaml_py_planted_in_the_working_directory(tmp_path):
    marker = tmp_path / "planted_ran"
    work = tmp_path / "work"
    work.mkdir()
    (work / "yaml.py").write_text(
        f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"
        "import sys; sys.path.remove(sys.path[0]); del sys.modules['yaml']; import yaml as _y; sys.modules['yaml'] = _y\n"
    )
    config = {
        "sweep_dir": str(tmp_path / "sweep"),
        "runs": [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}],
        "baseline": None,
        "config": {"model": {"checkpoint": str(tmp_path / "no_such_model")}},
        "report": {"wandb": False, "bench_processes": 0},
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(config))
    # the sweep itself as its console script starts it (no working directory on sys.path); its runs are children
    r = subprocess.run(
        [sys.executable, "-P", "-m", "qharness", "sweep", str(tmp_path / "sweep.yaml")],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    log = (tmp_path / "sweep" / "xnnpack_int8_dynamic-ptq" / "sweep.log").read_text()
    assert "no_such_model" in log, r.stdout + r.stderr  # the run started and failed on its model, as it should
    assert not marker.exists(), "the run process imported the planted yaml.py"
