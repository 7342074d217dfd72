"""One path: the same model, recipe and data through the CLI (``qharness calibrate``, a subprocess), through the
Python API's job (``qharness.run_job``, in this process) and through its stages (``qharness.prepare`` ->
``calibrate`` -> ``export`` of the model the user loaded) give the same program, byte for byte; the API hands back the
typed summary of what it wrote."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import run_cli, write_config

import qharness
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


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory, tiny_llama, corpus):
    """``qharness calibrate`` of the tiny Llama with xnnpack_8da4w, in a subprocess: its run directory."""
    tmp = tmp_path_factory.mktemp("one_path")
    r = run_cli("calibrate", _ptq_config(tmp, tiny_llama, corpus, "cli"))
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "cli"


def test_run_job_and_the_cli_calibrate_the_same_program(cli_run, tmp_path, tiny_llama, corpus):
    api_cfg = yaml.safe_load(_ptq_config(tmp_path, tiny_llama, corpus, "api").read_text())  # as a dict
    summary = run_job(api_cfg, "calibrate")
    assert isinstance(summary, RunSummary) and isinstance(summary.pte, PteInfo) and summary.passed
    assert summary == RunSummary.read(tmp_path / "api" / "summary.json")  # what it wrote is what it returned
    api_pte, cli_pte = (tmp_path / "api" / "model.pte").read_bytes(), (cli_run / "model.pte").read_bytes()
    assert api_pte == cli_pte and summary.pte.size_bytes == len(api_pte)
    cli_summary = json.loads((cli_run / "summary.json").read_text())
    assert cli_summary["pte"]["sha256"] == summary.pte.sha256
    assert cli_summary["metrics"]["pte"]["ppl"] == summary.metrics["pte"].ppl


@pytest.mark.slow  # a third deployment (~45 s); the default suite has run_job vs the CLI above
def test_the_api_stages_and_the_cli_calibrate_the_same_program(cli_run, tmp_path, tiny_llama, corpus):
    """``qharness.prepare`` -> ``calibrate`` -> ``export`` of the model as a user loads it, with the config's data
    (calibration.blocks from the training split; the validation blocks with their next tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qharness.data.datamodule import TextDataModule

    dm = TextDataModule(source=str(corpus), tokenizer=str(tiny_llama), seq_len=16, batch_size=4)
    dm.setup("fit")
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_llama), AutoTokenizer.from_pretrained(tiny_llama)
    prepared = qharness.prepare(model, "xnnpack_8da4w", mode="ptq", batch_size=4, seq_len=16, tokenizer=tok)
    result = qharness.export(
        qharness.calibrate(prepared, [dm.train_x[:2]]),
        tmp_path / "stages",
        validation=torch.cat([dm.val_x, dm.val_y[:, -1:]], 1),
        max_seq_len=32,
        parity={"eval_blocks": 4, "prompts": 1, "prompt_len": 8, "decode_steps": 3},
    )
    cli = RunSummary.read(cli_run / "summary.json")
    assert result.pte_path.read_bytes() == (cli_run / "model.pte").read_bytes() and result.parity.passed
    assert result.summary.pte.sha256 == cli.pte.sha256
    assert result.summary.metrics["pte"].ppl == pytest.approx(cli.metrics["pte"].ppl)


@pytest.mark.fast
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
