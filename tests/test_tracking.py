"""wandb logging of a run, read back from its offline files: config, train/val curves, the final row."""

import json

import pytest
from wandb_offline import config, history, offline_run, tables

from qharness.reporting.rows import summary_row
from qharness.reporting.tracking import wandb_logged_in, wandb_mode
from qharness.run.summary import RunSummary


# not in the fast tier: it reads the session's `qharness fit` run (a subprocess, ~40 s on the tier's critical path)
def test_fit_logs_config_curves_and_the_final_row_offline(fitted):
    run_dir, _, r = fitted
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    run = offline_run(run_dir)  # offline: no account, files under <run dir>/wandb
    (logged,) = tables(run, "final_row")
    assert len(logged["data"]) == 1
    row = dict(zip(logged["columns"], logged["data"][0]))
    expected = summary_row(RunSummary.from_dict(summary))
    assert row.keys() == expected.keys()
    for key in (
        "model",
        "recipe",
        "mode",
        "ppl_fp",
        "ppl_fake_quant",
        "ppl_pte",
        "parity_passed",
        "parity_argmax_agreement",
        "parity_max_abs_diff",
        "pte_size_mb",
        "prefill_tok_s",
        "decode_tok_s",
        "bandwidth_fraction",
    ):
        assert row[key] == pytest.approx(expected[key]), key
    assert row["mode"] == "qat" and row["recipe"] == "xnnpack_int8_dynamic" and row["parity_passed"] is True
    assert row["ppl_pte"] == pytest.approx(summary["metrics"]["pte"]["ppl"])
    assert (
        row["decode_tok_s"] == pytest.approx(summary["bench"]["pte"]["decode_tok_s"]["median"])
        and row["decode_tok_s"] > 0
    )
    assert row["pte_size_mb"] == pytest.approx((run_dir / "model.pte").stat().st_size / 1e6)
    # noise bands: every model's per-block losses on the same blocks, its interval, and the paired ratio to FP
    m = summary["metrics"]
    for name in ("fp", "fake_quant", "converted", "pte"):
        assert len(m[name]["block_losses"]) == m[name]["n_blocks"] == summary["eval_blocks"], name
        assert m[name]["ppl_ci"][0] < m[name]["ppl"] < m[name]["ppl_ci"][1] and m[name]["loss_se"] > 0, name
    assert m["pte"]["vs_fp"]["ppl_ratio"] == pytest.approx(m["pte"]["ppl"] / m["fp"]["ppl"], rel=1e-4)
    assert m["pte"]["vs_fp"]["ci"][0] <= m["pte"]["vs_fp"]["ppl_ratio"] <= m["pte"]["vs_fp"]["ci"][1]
    assert len(summary["val_blocks"]) == 16 and len(summary["pte"]["sha256"]) == 64
    for key in (
        "ppl_pte_lo",
        "ppl_pte_hi",
        "ppl_pte_vs_fp_lo",
        "ppl_pte_vs_fp_hi",
        "decode_ms_per_token_lo",
        "latency_source",
    ):
        assert (
            row[key] == pytest.approx(expected[key]) if isinstance(expected[key], float) else row[key] == expected[key]
        ), key
    assert row["ppl_pte_lo"] < row["ppl_pte"] < row["ppl_pte_hi"]

    steps = history(run)
    train = [h["train/loss"] for h in steps if "train/loss" in h]
    val = [h["val/loss"] for h in steps if "val/loss" in h]
    assert len(train) == 3 and len(val) == 2  # logged every 2 steps, validated every 3, of 6 steps
    cfg = config(run)
    assert cfg["model"]["recipe"] == "xnnpack_int8_dynamic" and cfg["trainer"]["max_steps"] == 6
    assert list(run_dir.glob("lightning_logs/version_*/metrics.csv"))  # the CSV logs stay


@pytest.mark.fast
def test_wandb_mode_offline_unless_logged_in_or_set(tmp_path):
    netrc = tmp_path / "netrc"
    assert wandb_mode(env={"NETRC": str(netrc)}) == "offline"
    assert wandb_mode(env={"WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_mode(env={"WANDB_API_KEY": "k" * 40}) == "online"
    assert wandb_mode("offline", env={"WANDB_API_KEY": "k" * 40}) == "offline"  # wandb.mode wins
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_logged_in({"NETRC": str(netrc)}) and wandb_mode(env={"NETRC": str(netrc)}) == "online"
    assert not wandb_logged_in({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"})
