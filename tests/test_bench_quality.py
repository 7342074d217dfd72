"""scripts/bench_quality.py's bookkeeping (docs/benchmarks/quality.md): the sweep entries of the distillation settings, the
recovered fraction, and the choice of a setting on the selection blocks. The sweeps themselves are the benchmark."""

import importlib.util

import pytest
from conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_quality", ROOT / "scripts" / "bench_quality.py")
bq = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bq)


@pytest.mark.fast
def test_each_distillation_setting_is_a_run_of_the_learned_scale_twin_taught_by_the_seeds_control(tmp_path):
    runs = bq.variant_runs("xnnpack_8da4w", ["qat_lsq_kdft", "qat_lsq_kdft_kl", "qat_lsq_kdft_t2"], sweep_dir=tmp_path)
    assert [r["name"] for r in runs] == [
        "xnnpack_8da4w_lsq_kdft",
        "xnnpack_8da4w_lsq_kdft_kl",
        "xnnpack_8da4w_lsq_kdft_t2",
    ]
    assert {r["recipe"] for r in runs} == {"xnnpack_8da4w_lsq"}
    distill = [r["config"]["model"]["distill"] for r in runs]
    assert {d["teacher"] for d in distill} == {str(tmp_path / "fp32_finetune-qat")}
    assert [(d["hard_loss"], d["temperature"]) for d in distill] == [(True, 1.0), (False, 1.0), (True, 2.0)]
    # the run directory bench_quality reads back is the one the sweep writes (<name>-<mode>)
    assert bq.run_dir(tmp_path, "xnnpack_8da4w", "qat_lsq_kdft_kl") == tmp_path / "xnnpack_8da4w_lsq_kdft_kl-qat"


@pytest.mark.fast
def test_the_selected_variant_recovers_most_against_the_control_over_seeds():
    variants = ["ptq", "qat", "qat_lsq_kdft", "qat_lsq_kdft_kl"]
    per_seed = {  # ppl: PTQ 50, control 46 (4 to recover)
        1: {
            "fp": 47.0,
            "control": 46.0,
            "r": {"ptq": 50.0, "qat": 47.0, "qat_lsq_kdft": 46.5, "qat_lsq_kdft_kl": 48.0},
        },
        2: {
            "fp": 47.0,
            "control": 46.0,
            "r": {"ptq": 50.0, "qat": 47.2, "qat_lsq_kdft": 46.3, "qat_lsq_kdft_kl": 45.0},
        },
    }
    rows = bq.summarize(per_seed, ["r"], variants)
    by = {r["variant"]: r for r in rows}
    assert by["qat"]["recovered_vs_control"][0] == pytest.approx((0.75 + 0.7) / 2)
    assert by["qat_lsq_kdft"]["recovered_vs_control"][0] == pytest.approx((0.875 + 0.925) / 2)
    assert bq.selected(rows, "r") == "qat_lsq_kdft"  # the mean decides: _kl's one great seed does not
    assert bq.selected([r for r in rows if r["variant"] == "ptq"], "r") is None
    # the targets are judged for the variant chosen beforehand, else for the table's best (marked as such)
    assert bq.verdicts(rows, ["r"], "qat")[0].startswith("r: variant chosen beforehand qat recovers 72.5%")
    # what plain QAT leaves (27.5%) against the best other variant's gain interval (two seeds: +/-63.5%, too wide)
    assert bq.verdicts(rows, ["r"], "qat")[0].endswith(
        "plain QAT leaves 27.5% of PTQ's loss to gain, qat_lsq_kdft's gain interval is ±63.5% wide: too wide for any "
        "gain to show beyond the noise here"
    )
    narrow = {**by["qat_lsq_kdft"], "gain_over_qat_ci": (0.10, 0.20)}
    assert bq.headroom([by["qat"], narrow]).endswith(
        "leaves 27.5% of PTQ's loss to gain, qat_lsq_kdft's gain interval is ±5.0% wide"
    )
    nearly_all = {**by["qat"], "recovered_vs_control": (0.97, 0.01, 2)}
    assert bq.headroom([nearly_all, narrow]).endswith(
        "leaves 3.0% of PTQ's loss to gain, qat_lsq_kdft's gain interval is ±5.0% wide: too wide for any gain to show beyond the noise here"
    )
    assert bq.headroom([by["qat"]]) == "" and bq.headroom([narrow]) == ""
    assert "best variant (chosen on this table) qat_lsq_kdft recovers 90.0%" in bq.verdicts(rows, ["r"])[0]
    # PTQ variants (GPTQ rounding, rotations) may recover more, but the targets are about QAT variants
    gptq = {**by["qat_lsq_kdft"], "variant": "ptq_gptq", "recovered_vs_control": (0.99, 0.0, 2)}
    assert bq.selected([*rows, gptq], "r") == "qat_lsq_kdft"
    assert "best variant (chosen on this table) qat_lsq_kdft recovers" in bq.verdicts([*rows, gptq], ["r"])[0]
    assert bq.verdicts([*rows, gptq], ["r"], "ptq_gptq") == ["r: no finished QAT variant ptq_gptq"]
