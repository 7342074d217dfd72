"""Noise bands: per-block losses from the scoring functions, perplexity intervals (alone and paired against FP),
the latency tie rules, and the report calling ties ties (front, best under a budget, the words)."""

import json
import math
import random

import pytest
import torch

from qharness.checks.stats import latency_tie, loss_interval, paired_ratio, rank_test_p, with_intervals
from qharness.io.atomic import write_json_atomic
from qharness.reporting.ranking import compare_accuracy, compare_latency
from qharness.reporting.report import write_report


# --- numerics -----------------------------------------------------------------------------------
@pytest.mark.fast
def test_loss_interval_is_a_t_interval_on_the_mean_block_loss_exponentiated():
    blocks = [4.0, 4.2, 4.4, 4.6]  # mean 4.3, sample sd 0.2582, se 0.1291; t(0.975, 3) = 3.1824
    r = loss_interval(blocks)
    assert r["n_blocks"] == 4 and r["loss_se"] == pytest.approx(0.129099, rel=1e-5)
    assert r["ppl_ci"] == pytest.approx(
        [math.exp(4.3 - 3.18245 * 0.129099), math.exp(4.3 + 3.18245 * 0.129099)], rel=1e-5
    )
    assert loss_interval([4.0])["ppl_ci"] is None  # one block: no interval


@pytest.mark.fast
def test_paired_ratio_removes_the_block_to_block_variation_both_models_share():
    rng = random.Random(0)
    fp = [4.6 + rng.gauss(0, 0.3) for _ in range(32)]
    quant = [b + 0.02 + rng.gauss(0, 0.005) for b in fp]
    r = paired_ratio(quant, fp)
    assert r["ppl_ratio"] == pytest.approx(math.exp(sum(quant) / 32 - sum(fp) / 32))
    assert 1.0 < r["ci"][0] < r["ppl_ratio"] < r["ci"][1] < 1.03  # 2% worse, and the interval says so
    fp_ci, q_ci = loss_interval(fp)["ppl_ci"], loss_interval(quant)["ppl_ci"]
    assert q_ci[0] < fp_ci[1]  # unpaired, the two intervals overlap: only the pairing decides
    with pytest.raises(ValueError, match="same blocks"):
        paired_ratio(quant, fp[:-1])


@pytest.mark.fast
def test_with_intervals_adds_ci_se_and_vs_fp_and_keeps_old_entries():
    m = with_intervals(
        {
            "fp": {"loss": 4.5, "ppl": math.exp(4.5), "block_losses": [4.4, 4.6]},
            "pte": {"loss": 4.6, "ppl": math.exp(4.6), "block_losses": [4.5, 4.7]},
            "other": {"loss": 1.0, "ppl": math.e},
        }
    )
    assert m["pte"]["vs_fp"]["ppl_ratio"] == pytest.approx(math.exp(0.1)) and m["pte"]["n_blocks"] == 2
    assert m["pte"]["vs_fp"]["ci"] == pytest.approx([math.exp(0.1), math.exp(0.1)])  # the same shift on every block
    assert "vs_fp" not in m["fp"] and m["other"] == {"loss": 1.0, "ppl": math.e}
    assert list(m["pte"])[-1] == "block_losses"


@pytest.mark.fast
def test_exact_rank_test_and_the_latency_tie_rule():
    assert rank_test_p([1, 2, 3], [4, 5, 6]) == pytest.approx(2 / 20)  # the most extreme of C(6,3) orderings, two-sided
    assert rank_test_p([1, 2, 3, 4], [5, 6, 7, 8]) == pytest.approx(2 / 70)
    assert rank_test_p([1, 3, 5], [2, 4, 6]) > 0.5
    assert latency_tie([0.90, 0.92, 0.95], [0.93, 0.96, 0.97])  # ranges overlap
    assert latency_tie([0.90, 0.91, 0.92], [1.20, 1.21, 1.22])  # apart, but 3 processes each cannot show it (p = 0.1)
    assert not latency_tie([0.90, 0.91, 0.92, 0.93], [1.20, 1.21, 1.22, 1.23])  # 4 each: p = 0.029


# --- scoring ------------------------------------------------------------------------------------
@pytest.mark.fast
def test_both_scoring_functions_return_the_same_block_losses_in_block_order():
    from qharness.checks.parity import score_batched, score_deployed

    torch.manual_seed(0)
    table = torch.randn(11, 11)  # a bigram model: logits of the next token from the current one
    x = torch.randint(0, 11, (6, 8))
    y = torch.roll(x, -1, 1)
    batched = score_batched(lambda t: table[t], x, y, batch_size=3)
    all_positions = score_deployed(lambda t, start: table[t], x, y)
    last_only = score_deployed(lambda t, start: table[t][:, -1:], x, y)  # the fast path's shape
    direct = [torch.nn.functional.cross_entropy(table[xi], yi).item() for xi, yi in zip(x, y)]
    for r in (batched, all_positions, last_only):
        assert r["block_losses"] == pytest.approx(direct, abs=1e-5)
        assert r["loss"] == pytest.approx(sum(direct) / 6, abs=1e-5) and r["ppl"] == pytest.approx(math.exp(r["loss"]))


@pytest.mark.fast
def test_validation_blocks_id_names_the_exact_tokens():
    from qharness.run.results import validation_blocks_id

    x = torch.arange(24).view(3, 8)
    y = x + 1
    assert validation_blocks_id(x, y) == validation_blocks_id(x.clone(), y.clone())
    assert validation_blocks_id(x[:2], y[:2]) != validation_blocks_id(x, y)  # fewer eval_blocks
    assert validation_blocks_id(x.view(4, 6), y.view(4, 6)) != validation_blocks_id(x, y)  # another seq_len


# --- the report ---------------------------------------------------------------------------------
RNG = random.Random(0)
FP = [4.6 + RNG.gauss(0, 0.3) for _ in range(32)]  # per-block losses vary a lot between blocks...


def shifted(shift, seed):
    rng = random.Random(seed)
    return [b + shift + rng.gauss(0, 0.01) for b in FP]  # ...models differ little, and consistently, per block


def joint(per_process):
    ms = sorted(per_process)
    spread = {"median": ms[len(ms) // 2], "min": ms[0], "max": ms[-1], "per_process": per_process}
    tok = [1000 / v for v in per_process]
    return {
        "processes": len(per_process),
        "decode_ms_per_token": spread,
        "decode_tok_s": {"median": sorted(tok)[len(tok) // 2], "min": min(tok), "max": max(tok), "per_process": tok},
        "prefill_tok_s": {"median": 5000.0, "min": 4900.0, "max": 5100.0, "per_process": [5000.0] * len(tok)},
    }


def new_summary(name, recipe, mode, blocks, per_process, mb, sha=None, val="v1"):
    metrics = with_intervals(
        {
            "fp": {"loss": sum(FP) / 32, "ppl": math.exp(sum(FP) / 32), "block_losses": FP},
            "pte": {"loss": sum(blocks) / 32, "ppl": math.exp(sum(blocks) / 32), "block_losses": blocks},
        }
    )
    return {
        "run_dir": f"runs/s/{name}",
        "model": "embedded",
        "recipe": recipe,
        "backend": "xnnpack",
        "mode": mode,
        "quantized": True,
        "seq_len": 128,
        "eval_blocks": 32,
        "val_blocks": val,
        "metrics": metrics,
        "parity": {
            "max_abs_diff": 0.3,
            "argmax_agreement": 0.97,
            "positions": 160,
            "ppl_rel_diff": 0.001,
            "passed": True,
            "reasons": [],
        },
        "pte": {
            "path": f"runs/s/{name}/model.pte",
            "size_bytes": int(mb * 1e6),
            "max_seq_len": 256,
            "sha256": sha or name * 4,
        },
        "bench": {"pte": {"decode_tok_s": {"median": 1000.0, "min": 900.0, "max": 1100.0}}},  # the joint benchmark wins
        "bench_joint": joint(per_process),
    }


# name: (recipe, mode, block losses, joint per-process decode ms, .pte MB)
SWEEP = {
    "a": ("xnnpack_8da4w", "ptq", shifted(0.050, 1), [0.90, 0.92, 0.95, 0.91, 0.93], 1.6),
    "b": ("xnnpack_8da4w_hqq", "ptq", shifted(0.052, 2), [0.93, 0.96, 0.97, 0.92, 0.94], 1.8),  # ties a on both axes
    "c": (
        "xnnpack_int4w",
        "ptq",
        shifted(0.100, 3),
        [0.70, 0.71, 0.72, 0.70, 0.73],
        1.4,
    ),  # clearly worse, clearly faster
    "d": (
        "xnnpack_8da4w",
        "qat",
        shifted(0.049, 4),
        [1.20, 1.22, 1.25, 1.21, 1.23],
        1.6,
    ),  # ties a on ppl, clearly slower
    "e": (
        "xnnpack_int8_dynamic",
        "ptq",
        shifted(0.005, 5),
        [1.50, 1.52, 1.55, 1.51, 1.53],
        2.5,
    ),  # clearly better, slower
}


@pytest.fixture
def sweep(tmp_path):
    for name, spec in SWEEP.items():
        write_json_atomic(tmp_path / name / "summary.json", new_summary(name, *spec))
    return tmp_path


def rows_of(result):
    return {r["run"]: r for r in result["rows"]}


@pytest.mark.fast
def test_block_losses_inside_the_noise_tie_and_a_clear_difference_wins(sweep):
    rows = rows_of(write_report(sweep, wandb=False))
    ab = compare_accuracy(rows["a"], rows["b"], "ppl_pte", True)
    assert ab.sign == 0 and "paired over 32 blocks" in ab.text  # 0.2% apart per block, inside the noise
    ac = compare_accuracy(rows["a"], rows["c"], "ppl_pte", True)
    assert (
        ac.sign == 1 and compare_accuracy(rows["c"], rows["a"], "ppl_pte", True).sign == -1
    )  # 5% apart on every block
    assert (
        rows["a"]["ppl_pte_lo"] < rows["c"]["ppl_pte"] < rows["a"]["ppl_pte_hi"]
    )  # though c's ppl lies in a's own interval
    assert rows["a"]["ppl_pte_vs_fp_lo"] < rows["a"]["ppl_pte_vs_fp"] < rows["a"]["ppl_pte_vs_fp_hi"]


@pytest.mark.fast
def test_pareto_front_and_best_under_budget_treat_noise_as_ties(sweep):
    result = write_report(sweep, max_size_mb=2.0, wandb=False)
    assert result["front"] == ["c", "a", "b", "e"]  # d: same ppl as a, slower beyond the noise
    rows = rows_of(result)
    assert rows["a"]["ties"] == "tie with b" and rows["b"]["ties"] == "tie with a" and rows["c"]["ties"] is None
    assert result["best"]["run"] == "a" and result["best_tied_with"] == ["b"]
    best_line = next(line for line in result["text"].splitlines() if line.startswith("Best under"))
    assert best_line.startswith(
        "Best under .pte <= 2 MB: tie between xnnpack_8da4w/ptq (a) and xnnpack_8da4w_hqq/ptq (b) (vs xnnpack_8da4w_hqq/ptq (b): ppl "
    )
    assert "paired over 32 blocks" in best_line and "ranges overlap (joint benchmark, 5 and 5 processes)" in best_line
    assert "; pick by size: xnnpack_8da4w/ptq (a): ppl " in best_line
    assert "tie with b" in result["text"] and "Latency noise" not in result["text"]  # every run has a joint benchmark
    md = (sweep / "report.md").read_text()
    row_a = next(line for line in md.splitlines() if line.startswith("| a |"))
    assert f"{rows['a']['decode_ms_per_token']:.3f} [0.900, 0.950]" in row_a and "tie with b" in row_a
    assert (
        f"| {rows['a']['ppl_pte']:.3f} [{rows['a']['ppl_pte_lo']:.3f}, {rows['a']['ppl_pte_hi']:.3f}] | +5.27% [+4.94%, +5.60%] |"
        in row_a
    )
    assert "xnnpack_8da4w/ptq (a, tie with b); xnnpack_8da4w_hqq/ptq (b, tie with a);" in result["text"]
    saved = json.loads((sweep / "report.json").read_text())
    assert not any(k.startswith("_") for r in saved["rows"] for k in r)  # block losses stay in the summaries


@pytest.mark.fast
def test_a_clear_accuracy_win_is_named_with_its_interval(sweep):
    result = write_report(sweep, wandb=False)
    assert result["best"]["run"] == "e" and result["best_tied_with"] == []
    best_line = next(line for line in result["text"].splitlines() if line.startswith("Best under"))
    assert best_line.startswith("Best under no budget: xnnpack_int8_dynamic/ptq (e): ppl ")
    assert "; vs the runner-up xnnpack_8da4w/qat (d): ppl -4.28% [-4.81%, -3.76%], paired over 32 blocks" in best_line


def test_the_decision_is_the_same_whatever_order_and_point_estimates(sweep):
    first = write_report(sweep, wandb=False)["text"]
    assert write_report(sweep, wandb=False)["text"] == first
    # b's median now a hair better than a's: the choice is still a tie, picked by size
    path = sweep / "b" / "summary.json"
    s = json.loads(path.read_text())
    s["bench_joint"] = joint([0.89, 0.96, 0.97, 0.90, 0.88])
    write_json_atomic(path, s)
    result = write_report(sweep, max_size_mb=2.0, wandb=False)
    assert result["best"]["run"] == "a" and result["best_tied_with"] == ["b"]


def test_the_bench_joint_overlap_rule_and_the_own_bench_fallback(sweep):
    rows = rows_of(write_report(sweep, wandb=False))
    assert compare_latency(rows["a"], rows["b"]).sign == 0  # per-process ranges overlap
    assert (
        compare_latency(rows["c"], rows["a"]).sign == 1
        and "rank test p=0.0079" in compare_latency(rows["c"], rows["a"]).text
    )
    few = dict(rows["c"], _decode_ms_samples=[0.70, 0.71, 0.72])
    far = dict(rows["a"], _decode_ms_samples=[0.90, 0.92, 0.95])
    assert compare_latency(few, far).sign == 0  # apart, but 3 processes each: the rank test cannot tell (p = 0.1)
    # without bench_joint, the own benchmark's [min, max] over repetitions: overlap ties, and it is called weak
    for name, (lo, hi) in {"a": (1000, 1100), "b": (1050, 1150)}.items():
        path = sweep / name / "summary.json"
        s = json.loads(path.read_text())
        del s["bench_joint"]
        s["bench"]["pte"]["decode_tok_s"] = {"median": (lo + hi) / 2, "min": lo, "max": hi}
        write_json_atomic(path, s)
    result = write_report(sweep, wandb=False)
    rows = rows_of(result)
    assert rows["a"]["latency_source"] == "own bench (1 process)" and rows["a"][
        "decode_ms_per_token_hi"
    ] == pytest.approx(1.0)
    cmp = compare_latency(rows["a"], rows["b"])
    assert cmp.sign == 0 and "weak evidence" in cmp.text
    assert "Latency noise: 2 of 5 runs have no joint benchmark" in result["text"]


@pytest.mark.fast
def test_identical_programs_never_appear_different(sweep):
    # the QAT run produced the very .pte of the PTQ run; its own latency measurement happened to be slower
    spec = SWEEP["a"]
    write_json_atomic(
        sweep / "a_qat" / "summary.json",
        new_summary("a_qat", spec[0], "qat", spec[2], [1.20, 1.22, 1.25, 1.21, 1.23], spec[4], sha="a" * 4),
    )
    result = write_report(sweep, wandb=False)
    assert {"a", "a_qat"} <= set(result["front"])
    rows = rows_of(result)
    assert "a_qat" in rows["a"]["ties"] and "a" in rows["a_qat"]["ties"]
    assert (
        "the same .pte (sha256), so the difference is measurement noise"
        in compare_latency(rows["a"], rows["a_qat"]).text
    )


@pytest.mark.fast
def test_runs_on_other_validation_blocks_are_compared_unpaired_and_said_so(sweep):
    path = sweep / "c" / "summary.json"
    s = json.loads(path.read_text())
    s["val_blocks"] = "v2"  # another seq_len or eval_blocks
    write_json_atomic(path, s)
    result = write_report(sweep, wandb=False)
    rows = rows_of(result)
    cmp = compare_accuracy(rows["a"], rows["c"], "ppl_pte", True)
    assert cmp.sign == 0 and "unpaired" in cmp.text  # 5% apart, but the blocks vary by far more than that
    assert "Accuracy noise: the runs were scored on different validation blocks" in result["text"]


@pytest.mark.fast
def test_the_png_draws_error_bars(sweep):
    import io

    import matplotlib.pyplot as plt

    from qharness.reporting.plot import plot_pareto

    rows = list(rows_of(write_report(sweep, wandb=False)).values())
    bare = [{k: v for k, v in r.items() if not k.endswith(("_lo", "_hi"))} for r in rows]
    front = {"a", "b", "c", "e"}

    def dark_blue(png):  # the bars: opaque lines in the ptq colour, beyond the translucent markers
        img = plt.imread(io.BytesIO(png))[..., :3]
        return (
            (abs(img[..., 0] - 0.12) < 0.08) & (abs(img[..., 1] - 0.47) < 0.08) & (abs(img[..., 2] - 0.71) < 0.08)
        ).sum()

    with_bars, without = (
        dark_blue(plot_pareto(rows, "ppl_pte", True, front, "t")),
        dark_blue(plot_pareto(bare, "ppl_pte", True, front, "t")),
    )
    assert with_bars > without + 60  # 145 vs 17 pixels when written


@pytest.mark.fast
def test_the_report_says_what_qat_recovers_per_ptq_qat_pair(tmp_path):
    """<name>-ptq / <name>-qat pairs: PTQ's loss against FP, QAT against PTQ (paired), the recovered fraction against
    FP and against the fine-tuned FP control; a PTQ loss inside the noise gets no fraction."""
    ms = [1.0, 1.0, 1.0, 1.0, 1.0]
    runs = {  # run dir: (recipe, mode, block-loss shift over FP)
        "xnnpack_8da3w-ptq": ("xnnpack_8da3w", "ptq", 0.070),
        "xnnpack_8da3w-qat": ("xnnpack_8da3w_lsq", "qat", 0.020),
        "xnnpack_int8-ptq": ("xnnpack_int8_dynamic", "ptq", 0.0005),
        "xnnpack_int8-qat": ("xnnpack_int8_dynamic", "qat", 0.0010),
        "xnnpack_fp32-qat": ("xnnpack_fp32", "qat", 0.005),
        "lonely-ptq": ("xnnpack_8da4w", "ptq", 0.030),  # no QAT twin: no line
    }
    for i, (name, (recipe, mode, shift)) in enumerate(runs.items()):
        s = new_summary(name, recipe, mode, shifted(shift, i), ms, 1.0)
        s["quantized"] = recipe != "xnnpack_fp32"
        write_json_atomic(tmp_path / name / "summary.json", s)
    result = write_report(tmp_path, wandb=False)
    rows = rows_of(result)
    lines = [line for line in result["text"].splitlines() if line.startswith("- ")]
    assert len(lines) == 2 and "What QAT recovers" in result["text"]
    three = next(line for line in lines if line.startswith("- xnnpack_8da3w:"))
    p, q = rows["xnnpack_8da3w-ptq"]["ppl_pte"], rows["xnnpack_8da3w-qat"]["ppl_pte"]
    fp, control = rows["xnnpack_8da3w-ptq"]["ppl_fp"], rows["xnnpack_fp32-qat"]["ppl_pte"]
    assert "QAT (xnnpack_8da3w_lsq) against PTQ" in three and "better beyond the noise" in three
    assert f"recovered {(p - q) / (p - fp):.0%} of PTQ's loss" in three
    assert f"({(p - q) / (p - control):.0%} against the fine-tuned FP control xnnpack_fp32-qat" in three
    int8 = next(line for line in lines if line.startswith("- xnnpack_int8:"))
    assert "a tie (inside the noise)" in int8 and "nothing for QAT to recover" in int8 and "recovered" not in int8
