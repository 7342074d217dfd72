"""One path: a run config run through the Python API (``qharness.api.jobs.run_job``, in this process) and through the
CLI (``qharness calibrate``, a subprocess) gives the same program, byte for byte, and the API hands back the typed
summary of what it wrote."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import run_cli, write_config

from qharness.api.jobs import run_job
from qharness.errors import UserError
from qharness.run.summary import PteInfo, RunSummary


def _ptq_config(tmp_path, tiny_llama, corpus, name: str):
    return write_config(
        tmp_path / f"{name}.yaml",
        tiny_llama,
        corpus,
        tmp_path / name,
        model={"recipe": "xnnpack_8da4w", "mode": "ptq"},
        data={"seq_len": 16},
        deploy={"max_seq_len": 32},
        parity={"eval_blocks": 4, "prompts": 1, "prompt_len": 8, "decode_steps": 3},
        calibration={"blocks": 2},
    )


def test_the_api_and_the_cli_calibrate_the_same_program(tmp_path, tiny_llama, corpus):
    cli_cfg = _ptq_config(tmp_path, tiny_llama, corpus, "cli")
    r = run_cli("calibrate", cli_cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    api_cfg = yaml.safe_load(_ptq_config(tmp_path, tiny_llama, corpus, "api").read_text())  # as a dict
    summary = run_job(api_cfg, "calibrate")
    assert isinstance(summary, RunSummary) and isinstance(summary.pte, PteInfo) and summary.passed
    assert summary == RunSummary.read(tmp_path / "api" / "summary.json")  # what it wrote is what it returned
    api_pte, cli_pte = (tmp_path / "api" / "model.pte").read_bytes(), (tmp_path / "cli" / "model.pte").read_bytes()
    assert api_pte == cli_pte and summary.pte.size_bytes == len(api_pte)
    cli_summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert cli_summary["pte"]["sha256"] == summary.pte.sha256
    assert cli_summary["metrics"]["pte"]["ppl"] == summary.metrics["pte"].ppl


def test_bad_input_through_the_api_is_the_clis_one_line_error_before_any_work(tmp_path, tiny_llama, corpus):
    cfg = yaml.safe_load(_ptq_config(tmp_path, tiny_llama, corpus, "bad").read_text())
    cfg["deploy"]["max_seq_len"] = 8  # not above data.seq_len
    with pytest.raises(UserError, match=r"deploy.max_seq_len=8 must exceed data.seq_len=16"):
        run_job(cfg, "calibrate")
    assert not (tmp_path / "bad").exists()  # refused before the run directory was made
    with pytest.raises(UserError, match="takes no run config"):
        run_job(cfg, "sweep")
    with pytest.raises(UserError, match="a YAML path or a dict"):
        run_job(["fit"], "fit")
