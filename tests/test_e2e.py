"""The real CLI end to end on a tiny Llama over the generated corpus: fit -> .pte -> runtime -> parity."""

import json

import pytest
import torch
from conftest import copy_of_fitted, run_cli, write_config

from qharness.errors import UserError


def test_fit_writes_a_pte_that_passes_parity(fitted):
    run, _, r = fitted
    assert r.returncode == 0, r.stderr[-3000:]
    assert "parity PASSED" in r.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity"]["passed"] and summary["recipe"] == "xnnpack_int8_dynamic"
    assert summary["pte"]["export_path"] == "fast" and summary["pte"]["fallback_reason"] is None
    assert summary["parity"]["positions"] == 2 * (16 + 4)  # every prompt position and decode step
    m = summary["metrics"]
    assert set(m) == {"fp", "fake_quant", "converted", "pte"}
    assert abs(m["pte"]["ppl"] - m["converted"]["ppl"]) / m["converted"]["ppl"] < 0.02
    assert summary["parity"]["argmax_agreement"] >= 0.9
    cov = summary["coverage"]  # the Llama control: every projection (7 per layer and lm_head) quantized
    assert cov["weights"] == cov["quantized"] == 15 and cov["fraction"] == 1.0 and cov["float"] == {}
    assert "quantized: 100.0% of linear weight bytes (15 of 15 weights)" in r.stdout
    assert (run / "model.pte").stat().st_size == summary["pte"]["size_bytes"] > 10_000
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    assert (run / "checkpoints" / "last.ckpt").is_file()


# not in the fast tier: it reads the session's `qharness fit` run (a subprocess, ~40 s on the tier's critical path)
def test_the_pte_decodes_token_by_token_like_a_full_prefill(fitted):
    from qharness.runtime.pte import PteModel

    run, _, r = fitted
    assert r.returncode == 0, r.stderr[-3000:]
    pte = PteModel(run / "model.pte")
    prompt = torch.tensor([[5, 17, 42, 9, 100, 7]])
    tokens = prompt
    logits = pte(prompt, 0)
    assert logits.shape == (1, 1, 384) and torch.isfinite(logits).all()  # the fast path: last-token logits
    for _ in range(5):
        nxt = logits[0, -1].argmax().view(1, 1)
        logits = pte(nxt, tokens.shape[1])
        tokens = torch.cat([tokens, nxt], 1)
    full = pte(tokens[:, :-1], 0)  # a fresh prefill of the same sequence reproduces the decode
    assert full[0, -1].argmax() == tokens[0, -1]


@pytest.mark.slow  # ~75 s: four CLI runs; the default suite resumes a killed run (SIGKILL, below), exports from a
# checkpoint after a crash (test_a_crash_while_lowering_...) and fails the gate through the CLI (test_parity_faults)
def test_resume_continues_from_the_checkpoint_and_export_finishes_from_it(tmp_path, tiny_llama, corpus):
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "r.yaml",
        tiny_llama,
        corpus,
        run,
        deploy={"enabled": False, "max_seq_len": 64},
        bench={"enabled": False},
    )
    first = run_cli("fit", cfg, "--trainer.max_steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    second = run_cli("fit", cfg, "--trainer.max_steps", "6", "--ckpt_path", "last")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restoring states from the checkpoint" in second.stdout + second.stderr
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert not (run / "model.pte").exists()
    strict = run_cli("export", cfg, "--parity.max_abs_diff", "1e-12")  # a gate no .pte can pass
    assert strict.returncode == 1, strict.stderr[-3000:]
    assert "parity gate failed" in strict.stderr and "parity.max_abs_diff" in strict.stderr
    assert (run / "model.FAILED_PARITY.pte").is_file() and not (run / "model.pte").exists()
    assert json.loads((run / "summary.json").read_text())["parity"]["passed"] is False
    export = run_cli("export", cfg, "--ckpt_path", "last")
    assert export.returncode == 0, export.stderr[-3000:]
    assert "parity PASSED" in export.stdout and (run / "model.pte").is_file()


def test_a_failed_gate_through_the_cli_keeps_the_program_apart_and_says_what_to_try(fitted, tmp_path):
    """``qharness export`` with a gate no ``.pte`` can pass: exit 1, one line naming the failed tolerance and what to
    try, the program kept as ``model.FAILED_PARITY.pte`` (no ``model.pte``), ``summary.json`` saying so, and
    ``qharness generate RUN`` naming the file that is there."""
    off = {"enabled": False}
    run, cfg = copy_of_fitted(fitted, tmp_path, bench=off, eval=off, wandb=off)
    (run / "model.pte").unlink()
    strict = run_cli("export", cfg, "--parity.max_abs_diff", "1e-12")
    assert strict.returncode == 1, strict.stderr[-3000:]
    error = [line for line in strict.stderr.splitlines() if "parity gate failed" in line]
    assert len(error) == 1 and "parity.max_abs_diff" in error[0] and "qharness ship" in error[0], strict.stderr[-3000:]
    assert (run / "model.FAILED_PARITY.pte").is_file() and not (run / "model.pte").exists()
    assert json.loads((run / "summary.json").read_text())["parity"]["passed"] is False
    gen = run_cli("generate", run, "--prompt", "To be", "--max_new_tokens", "2")
    assert gen.returncode != 0 and "model.FAILED_PARITY.pte" in gen.stderr, gen.stderr[-2000:]


def test_export_without_a_checkpoint_is_a_clear_error(tmp_path, tiny_llama, corpus):
    from qharness.api.precheck import precheck

    cfg = write_config(tmp_path / "r.yaml", tiny_llama, corpus, tmp_path / "nothing_here")
    r = run_cli("export", cfg)
    assert r.returncode == 2
    assert "last.ckpt does not exist" in r.stderr and "Traceback" not in r.stderr
    # found by the config's own check, before Lightning, the model or the architecture check loads (was after them)
    for argv in (["export", "--config", str(cfg)], ["fit", "--config", str(cfg), "--ckpt_path=last"]):
        with pytest.raises(UserError, match=r"nothing_here/checkpoints/last.ckpt does not exist"):
            precheck(argv)
    with pytest.raises(UserError, match=r"checkpoint .*elsewhere.ckpt does not exist"):
        precheck(["export", "--config", str(cfg), "--ckpt_path", str(tmp_path / "elsewhere.ckpt")])
    assert precheck(["fit", "--config", str(cfg)]) is not None  # a fit that starts afresh needs none


@pytest.mark.fast
def test_gate_names_each_failed_tolerance():
    from qharness.checks.parity import gate
    from qharness.config import ParityConfig

    ok = {"ppl_rel_diff": 0.001, "argmax_agreement": 0.99, "max_abs_diff": 0.1}
    assert gate(ok, ParityConfig(max_abs_diff=0.2)) == []
    bad = {"ppl_rel_diff": 0.05, "argmax_agreement": 0.5, "max_abs_diff": 0.3}
    reasons = gate(bad, ParityConfig(max_abs_diff=0.2))
    assert len(reasons) == 3
    assert (
        "parity.max_ppl_rel_diff" in reasons[0]
        and "parity.min_argmax_agreement" in reasons[1]
        and "parity.max_abs_diff" in reasons[2]
    )


def test_calibrate_ptq_static_with_its_own_calibration_data(tmp_path, tiny_llama, corpus):
    run = tmp_path / "ptq"
    calib = tmp_path / "calib.txt"
    calib.write_text(corpus.read_text()[300_000:340_000])
    cfg = write_config(
        tmp_path / "ptq.yaml",
        tiny_llama,
        corpus,
        run,
        model={"mode": "ptq", "recipe": "xnnpack_int8_static"},
        calibration={"source": str(calib), "blocks": 8},
        bench={"enabled": False},
    )
    r = run_cli("calibrate", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Predicting" in r.stdout + r.stderr  # Lightning's progress bar over the calibration blocks
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mode"] == "ptq" and summary["recipe"] == "xnnpack_int8_static" and summary["parity"]["passed"]
    assert "fake_quant" not in summary["metrics"]  # PTQ trains nothing: 'converted' is its quantized model
    assert summary["metrics"]["converted"]["ppl"] != summary["metrics"]["fp"]["ppl"]  # quantization did something


def test_calibrate_refuses_qat_mode(tmp_path, tiny_llama, corpus):
    from qharness.api.precheck import precheck

    cfg = write_config(tmp_path / "q.yaml", tiny_llama, corpus, tmp_path / "q")
    r = run_cli("calibrate", cfg)
    assert r.returncode == 2 and "calibrate needs model.mode: ptq" in r.stderr
    with pytest.raises(UserError, match="calibrate needs model.mode: ptq"):  # before torch loads (was after the model)
        precheck(["calibrate", "--config", str(cfg)])


@pytest.mark.slow  # ~40 s; the default suite resumes killed runs to the same result (test_killed_run_resumes_...)
def test_resumed_run_ends_where_an_uninterrupted_run_ends(tmp_path, tiny_llama, corpus):
    """A run killed right after its step-3 checkpoint (mid-epoch) and resumed with ``--ckpt_path last``
    ends with the same weights and observer state as the uninterrupted 8-step run.

    Tolerance: 1e-6 absolute on every tensor (CPU, deterministic kernels, same seed)."""
    import shutil

    off = {"deploy": {"enabled": False, "max_seq_len": 64}, "bench": {"enabled": False}}
    a_cfg = write_config(
        tmp_path / "a.yaml",
        tiny_llama,
        corpus,
        tmp_path / "a",
        trainer={"max_steps": 8},
        checkpoint={"save_top_k": -1},
        **off,
    )
    b_cfg = write_config(tmp_path / "b.yaml", tiny_llama, corpus, tmp_path / "b", trainer={"max_steps": 8}, **off)
    assert run_cli("fit", a_cfg).returncode == 0
    step3 = next((tmp_path / "a" / "checkpoints").glob("*step=3.ckpt"))
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copy(step3, tmp_path / "b" / "checkpoints" / "last.ckpt")  # what a killed run leaves behind
    r = run_cli("fit", b_cfg, "--ckpt_path", "last")
    assert r.returncode == 0, r.stderr[-3000:]
    a = torch.load(tmp_path / "a" / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "b" / "checkpoints" / "last.ckpt", weights_only=True)
    s3 = torch.load(step3, weights_only=True)
    assert a["global_step"] == b["global_step"] == 8 and s3["global_step"] == 3

    def max_diff(x, y):
        return max(
            (x["state_dict"][k].float() - y["state_dict"][k].float()).abs().max().item() for k in x["state_dict"]
        )

    assert max_diff(a, b) < 1e-6
    assert max_diff(a, s3) > 1e-4  # the comparison can tell different training states apart


def _final_val_loss(run):
    import csv

    rows = list(csv.DictReader(open(next(run.glob("lightning_logs/version_*/metrics.csv")))))
    return [float(r["val/loss"]) for r in rows if r.get("val/loss")][-1]


@pytest.mark.slow  # ~45 s; the default suite's killed-run test compares two fresh fits to 1e-6
def test_same_config_and_seed_give_the_same_final_validation_loss(tmp_path, tiny_llama, corpus):
    off = {"deploy": {"enabled": False, "max_seq_len": 64}, "bench": {"enabled": False}}
    losses = []
    for name in ("x", "y"):
        cfg = write_config(
            tmp_path / f"{name}.yaml", tiny_llama, corpus, tmp_path / name, trainer={"max_steps": 6}, **off
        )
        assert run_cli("fit", cfg).returncode == 0
        losses.append(_final_val_loss(tmp_path / name))
    assert losses[0] == losses[1]
    other = write_config(
        tmp_path / "z.yaml", tiny_llama, corpus, tmp_path / "z", trainer={"max_steps": 6}, data={"seed": 7}, **off
    )
    assert run_cli("fit", other).returncode == 0
    assert _final_val_loss(tmp_path / "z") != losses[0]  # another shuffle seed is another run


def test_divergence_stops_with_one_line_and_keeps_the_last_good_checkpoint(tmp_path, tiny_llama, corpus):
    cfg = write_config(
        tmp_path / "nan.yaml",
        tiny_llama,
        corpus,
        tmp_path / "nan",
        model={"lr": 1.0e30, "warmup_steps": 0},
        trainer={"max_steps": 30},
        checkpoint={"every_n_train_steps": 1},
        bench={"enabled": False},
    )
    r = run_cli("fit", cfg)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "error: training" in r.stderr and "the last checkpoint is kept" in r.stderr and "Traceback" not in r.stderr
    last = torch.load(tmp_path / "nan" / "checkpoints" / "last.ckpt", weights_only=True)
    assert 0 < last["global_step"] < 30
    for name, v in last["state_dict"].items():
        if v.is_floating_point():  # no NaN; inf only where an observer's running min/max has seen nothing yet
            assert not v.isnan().any() and (name.endswith(("min_val", "max_val")) or v.isfinite().all()), name
    assert not (tmp_path / "nan" / "model.pte").exists()


def _kill_after_first_checkpoint(cfg, run, sig):
    """Start ``qharness fit``, send ``sig`` once its first periodic checkpoint exists; return the step reached."""
    import os
    import subprocess
    import sys
    import time

    from conftest import ROOT

    proc = subprocess.Popen(
        [sys.executable, "-m", "qharness", "fit", str(cfg)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ.copy(),
    )
    deadline = time.time() + 300
    while not (run / "checkpoints" / "last.ckpt").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    assert proc.returncode != 0, "the run finished before it could be killed"
    time.sleep(0.5)
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]


# SIGTERM in the slow tier (~45 s): the default suite has SIGKILL here and SIGTERM's save in test_api_lightning
@pytest.mark.parametrize("sig_name", [pytest.param("SIGTERM", marks=pytest.mark.slow), "SIGKILL"])
def test_killed_run_resumes_to_the_uninterrupted_result(sig_name, tmp_path, tiny_llama, corpus):
    import signal

    off = {"deploy": {"enabled": False, "max_seq_len": 64}, "bench": {"enabled": False}}
    sections = dict(trainer={"max_steps": 40, "val_check_interval": 20}, checkpoint={"every_n_train_steps": 5}, **off)
    straight = write_config(tmp_path / "a.yaml", tiny_llama, corpus, tmp_path / "a", **sections)
    killed = write_config(tmp_path / "b.yaml", tiny_llama, corpus, tmp_path / "b", **sections)
    assert run_cli("fit", straight).returncode == 0
    step = _kill_after_first_checkpoint(killed, tmp_path / "b", getattr(signal, sig_name))
    assert 0 < step < 40
    r = run_cli("fit", killed, "--ckpt_path", "last")
    assert r.returncode == 0, r.stderr[-3000:]
    # Lightning warns of "unreliable results" on a mid-epoch resume unless the loader has a state_dict; ours
    # continues at the next batch (the comparison below), so qharness hides that warning (upstream/quiet.py)
    assert "dataloader is not resumable" not in r.stderr
    a = torch.load(tmp_path / "a" / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "b" / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 40
    assert (
        max((a["state_dict"][k].float() - b["state_dict"][k].float()).abs().max().item() for k in a["state_dict"])
        < 1e-6
    )


def test_a_crash_while_lowering_keeps_the_checkpoint_and_export_finishes(tmp_path, tiny_llama, corpus, monkeypatch):
    import qharness.deploy.lower
    from qharness.cli.main import main
    from qharness.deploy.architectures import check_architecture
    from qharness.recipes.registry import load_recipe

    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, tmp_path / "c", bench={"enabled": False})
    # the deploy probe before training passed (it is remembered): the crash comes at the run's own lowering
    check_architecture(str(tiny_llama), recipe=load_recipe("xnnpack_int8_dynamic"), max_seq_len=64)

    def broken(*args, **kwargs):
        raise RuntimeError("forced failure while lowering")

    monkeypatch.setattr(qharness.deploy.lower, "lower_program", broken)  # what the run lowers with
    with pytest.raises(RuntimeError, match="forced failure while lowering"):
        main(["fit", str(cfg)])
    assert torch.load(tmp_path / "c" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert not (tmp_path / "c" / "model.pte").exists()
    monkeypatch.undo()
    r = run_cli("export", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "parity PASSED" in r.stdout and (tmp_path / "c" / "model.pte").is_file()


@pytest.mark.slow
def test_a_crash_while_evaluating_keeps_the_run_and_evaluate_finishes(tmp_path, tiny_llama, corpus, monkeypatch):
    import qharness.evaluation.harness
    from qharness.cli.main import main

    cfg = write_config(
        tmp_path / "c.yaml", tiny_llama, corpus, tmp_path / "c", bench={"enabled": False}, eval={"enabled": True}
    )

    def broken(*args, **kwargs):
        raise RuntimeError("forced failure while evaluating")

    monkeypatch.setattr(qharness.evaluation.harness, "run_eval", broken)
    with pytest.raises(RuntimeError, match="forced failure while evaluating"):
        main(["fit", str(cfg)])
    run = tmp_path / "c"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert (run / "model.pte").is_file() and json.loads((run / "summary.json").read_text())["eval"] is None
    monkeypatch.undo()
    r = run_cli("evaluate", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["eval"] is None
    )  # the run itself never evaluated; evaluate adds its table beside, never as the run's own
    assert set(summary["evaluations"][-1]["tasks"]) == {"qharness_ppl", "qharness_mc"}
    assert (run / summary["evaluations"][-1]["file"]).is_file()
