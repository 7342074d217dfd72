"""``qharness report`` on synthetic summary.json files: table, CSV, Pareto front, PNG, best under a budget, wandb."""

import csv
import json

import pytest
from conftest import run_cli

from qharness.io.atomic import write_json_atomic
from qharness.reporting.metric import resolve_metric
from qharness.reporting.ranking import best_under, pareto_front
from qharness.reporting.report import write_report
from qharness.reporting.rows import summary_row
from qharness.run.summary import RunSummary

# name: (recipe, mode, quantized, .pte ppl, decode ms/token, .pte MB, parity passed, toy/acc of the .pte)
RUNS = {
    "fp": ("xnnpack_fp32", "ptq", False, 98.0, 4.0, 4.20, True, 0.50),
    "int8-ptq": ("xnnpack_int8_dynamic", "ptq", True, 98.1, 1.0, 2.27, True, 0.49),
    "int8-qat": ("xnnpack_int8_dynamic", "qat", True, 98.6, 1.2, 2.27, True, 0.47),
    "int4-ptq": ("xnnpack_int4w_dynamic", "ptq", True, 105.0, 0.8, 1.60, True, 0.40),
    "8da4w-qat": ("xnnpack_8da4w", "qat", True, 99.0, 0.9, 1.77, True, 0.45),
    "broken": ("xnnpack_int4w_dynamic", "qat", True, 90.0, 0.5, 1.60, False, 0.60),  # failed parity: never picked
}
# Hand-computed front (lower latency, lower ppl): int8-qat is dominated by int8-ptq (faster and better);
# broken failed the gate; the rest trade latency for perplexity.
FRONT = ["int4-ptq", "8da4w-qat", "int8-ptq", "fp"]


def summary(name, recipe, mode, quantized, ppl, ms, mb, passed, acc):
    out = {
        "run_dir": f"runs/s/{name}",
        "model": "embedded",
        "recipe": recipe,
        "backend": "xnnpack",
        "mode": mode,
        "quantized": quantized,
        "seq_len": 128,
        "eval_blocks": 32,
        "metrics": {
            "fp": {"loss": 4.58, "ppl": 98.0},
            "converted": {"loss": 4.6, "ppl": ppl},
            "pte": {"loss": 4.6, "ppl": ppl},
        },
        "parity": {
            "max_abs_diff": 0.3,
            "argmax_agreement": 0.97 if passed else 0.5,
            "positions": 160,
            "ppl_rel_diff": 0.001,
            "passed": passed,
            "reasons": [],
        },
        "pte": {"path": f"runs/s/{name}/model.pte", "size_bytes": int(mb * 1e6), "max_seq_len": 256},
        # of the linear weight bytes (deploy/coverage.py); int4-ptq's recipe keeps one layer float
        "coverage": coverage(0.0 if not quantized else 0.969 if name == "int4-ptq" else 1.0),
        "eval": {
            "tasks": {
                "toy": {
                    "fp": {"acc,none": 0.5, "acc_stderr,none": 0.01},
                    "pte": {"acc,none": acc, "acc_stderr,none": 0.01},
                }
            }
        },
    }
    if passed:
        tok_s = 1000.0 / ms  # repetitions within +-2%
        out["bench"] = {
            "pte": {
                "decode_tok_s": {"median": tok_s, "min": 0.98 * tok_s, "max": 1.02 * tok_s},
                "prefill_tok_s": {"median": 5000.0, "min": 4900.0, "max": 5100.0},
                "bandwidth_fraction": 0.1,
                "peak_rss_mb": 300.0,
            }
        }
    return out


def coverage(fraction: float) -> dict:
    """A coverage record (``deploy/coverage_record.Coverage``) quantizing ``fraction`` of 1000 bytes of weights."""
    return {
        "weights": 16,
        "bytes": 1000,
        "quantized": 16,
        "quantized_bytes": round(1000 * fraction),
        "fraction": fraction,
    }


@pytest.fixture
def runs_dir(tmp_path):
    root = tmp_path / "sweep"
    for name, spec in RUNS.items():
        write_json_atomic(root / name / "summary.json", summary(name, *spec))
    (root / "half_written").mkdir()
    (root / "half_written" / "summary.json").write_text("{not json")  # skipped with a warning
    return root


def test_pareto_front_and_budget_on_a_hand_computed_example(runs_dir):
    result = write_report(runs_dir, wandb=False)
    assert result["metric"] == "ppl_pte" and result["lower_is_better"]
    assert result["front"] == FRONT
    rows = {r["run"]: r for r in result["rows"]}
    assert rows["fp"]["mode"] == "fp" and rows["int8-qat"]["mode"] == "qat"  # the unquantized recipe is the FP baseline
    assert result["best"]["run"] == "fp"  # no budget: the lowest perplexity that passed parity
    assert best_under(result["rows"], "ppl_pte", True, max_latency_ms=0.95)["run"] == "8da4w-qat"
    assert best_under(result["rows"], "ppl_pte", True, max_latency_ms=0.85)["run"] == "int4-ptq"
    assert best_under(result["rows"], "ppl_pte", True, max_latency_ms=2.0, max_size_mb=2.0)["run"] == "8da4w-qat"
    assert best_under(result["rows"], "ppl_pte", True, max_size_mb=2.3)["run"] == "int8-ptq"
    assert best_under(result["rows"], "ppl_pte", True, max_latency_ms=0.6) is None  # only the failed run is that fast


@pytest.mark.fast
def test_the_size_front_ranks_by_pte_size_not_latency(runs_dir):
    """A fast but large program is on the latency front and off the size front (int8-ptq is smaller and better)."""
    write_json_atomic(
        runs_dir / "fast-big" / "summary.json",
        summary("fast-big", "xnnpack_fp32", "ptq", True, 100.0, 0.7, 3.0, True, 0.4),
    )
    result = write_report(runs_dir, wandb=False, max_size_mb=2.0)
    assert "fast-big" in result["front"] and "fast-big" not in result["front_size"]
    assert result["front_size"] == FRONT  # sizes here happen to order the other runs as latency does
    rows = {r["run"]: r for r in result["rows"]}
    assert rows["int8-ptq"]["pareto_size"] and not rows["int8-qat"]["pareto_size"]
    assert (runs_dir / "pareto_size.png").read_bytes()[:4] == b"\x89PNG"
    assert "Pareto front by .pte size" in result["text"]


@pytest.mark.fast
def test_higher_is_better_metric_from_lm_eval_results(runs_dir):
    result = write_report(runs_dir, metric="toy/acc", wandb=False)
    assert result["metric"] == "eval/toy/acc/pte" and not result["lower_is_better"]
    # (ms, acc): int4-ptq (0.8, .40), 8da4w-qat (0.9, .45), int8-ptq (1.0, .49), int8-qat (1.2, .47), fp (4.0, .50);
    # every acc has stderr 0.01: differences within 1.96 * sqrt(2) * 0.01 = 0.028 tie, so fp (.50) ties int8-ptq (.49)
    # on accuracy and is slower beyond the noise: dominated.
    assert result["front"] == ["int4-ptq", "8da4w-qat", "int8-ptq"]
    assert best_under(result["rows"], result["metric"], False, max_latency_ms=1.5)["run"] == "int8-ptq"
    assert resolve_metric("toy/acc/fp", result["rows"]) == ("eval/toy/acc/fp", False)
    from qharness.errors import UserError

    with pytest.raises(UserError, match="toy/acc"):
        resolve_metric("nope/acc", result["rows"])


@pytest.mark.fast
def test_pareto_front_unit_cases():
    assert pareto_front([(1, 10), (2, 8), (3, 9), (4, 5)], lower_is_better=True) == [0, 1, 3]
    assert pareto_front([(1, 10), (2, 8), (3, 9), (4, 5)], lower_is_better=False) == [0]
    assert pareto_front([(2, 5), (1, 5)], lower_is_better=True) == [1]  # equal metric: the faster one dominates
    assert pareto_front([], lower_is_better=True) == []


@pytest.mark.fast
def test_table_csv_and_png_are_written(runs_dir):
    import matplotlib.pyplot as plt

    write_report(runs_dir, runs_dir / "out", max_latency_ms=0.95, wandb=False)
    md = (runs_dir / "out" / "report.md").read_text()
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    body = {
        cells[0]: dict(zip(header, cells))
        for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines[1:])
    }
    assert set(body) == set(RUNS)  # the unreadable summary is skipped
    assert {n for n, r in body.items() if r["Pareto"] == "*"} == set(FRONT)
    assert body["broken"]["parity"] == "FAILED" and body["int8-ptq"]["parity"] == "passed"
    assert (body["fp"]["quantized"], body["int8-ptq"]["quantized"], body["int4-ptq"]["quantized"]) == (
        "0.0%",
        "100.0%",
        "96.9%",
    )
    # latency [min, max] of the own benchmark's repetitions (+-2% tok/s); lm-eval metrics +- their stderr
    assert body["8da4w-qat"][".pte ppl"] == "99.000" and body["8da4w-qat"]["decode ms/tok"] == "0.900 [0.882, 0.918]"
    assert body["8da4w-qat"]["toy/acc"] == "0.450 ± 0.010" and body["int8-ptq"]["vs FP"] == "+0.10%"
    assert "Best under decode <= 0.95 ms/token: xnnpack_8da4w/qat (8da4w-qat)" in md
    with open(runs_dir / "out" / "report.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert float(rows["int4-ptq"]["ppl_pte"]) == 105.0 and float(rows["int4-ptq"]["pte_size_mb"]) == 1.6
    assert rows["fp"]["pareto"] == "True" and rows["int8-qat"]["pareto"] == "False"
    assert json.loads((runs_dir / "out" / "report.json").read_text())["front"] == FRONT
    png = runs_dir / "out" / "pareto.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = plt.imread(png)[..., :3]
    assert img.shape[:2] == (720, 1080)
    crimson = (
        (abs(img[..., 0] - 220 / 255) < 0.08)
        & (abs(img[..., 1] - 20 / 255) < 0.08)
        & (abs(img[..., 2] - 60 / 255) < 0.08)
    ).sum()
    assert crimson > 200  # the front's line and labels are drawn


@pytest.mark.fast
def test_a_busy_machine_during_benchmarks_is_noted(runs_dir):
    assert "Note:" not in write_report(runs_dir, wandb=False)["text"]
    path = runs_dir / "int8-ptq" / "summary.json"
    busy = json.loads(path.read_text())
    busy["bench"].update(load_avg_1m=5.5, cpus=2)
    write_json_atomic(path, busy)
    text = write_report(runs_dir, wandb=False)["text"]
    assert (
        "Note: 1 of 6 benchmarks ran while other processes kept the CPUs busy (load average up to 5.5 on 2 CPUs)"
        in text
    )


def test_report_cli_and_its_wandb_table(runs_dir):
    from wandb_offline import offline_run, tables

    r = run_cli("report", runs_dir, "--max_size_mb", "2", "--out", runs_dir / "rep")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Best under .pte <= 2 MB: xnnpack_8da4w/qat (8da4w-qat)" in r.stdout
    assert f"Pareto plot: {runs_dir / 'rep' / 'pareto.png'}" in r.stdout
    table = tables(offline_run(runs_dir / "rep"), "report/table")
    assert len(table) == 1
    logged = [dict(zip(table[0]["columns"], row)) for row in table[0]["data"]]
    assert {row["run"]: row["ppl_pte"] for row in logged} == {n: spec[3] for n, spec in RUNS.items()}
    assert {row["run"] for row in logged if row["pareto"]} == set(FRONT)


def test_report_of_a_directory_without_runs_is_a_clear_error(tmp_path):
    r = run_cli("report", tmp_path, "--no_wandb")
    assert r.returncode == 2 and "no summary.json under" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.fast
def test_summary_row_of_a_real_summary_layout():
    s = summary("x", "xnnpack_int8_dynamic", "qat", True, 98.6, 1.25, 2.27, True, 0.47)
    row = summary_row(RunSummary.from_dict(s))
    assert row["run"] == "x" and row["decode_ms_per_token"] == pytest.approx(1.25) and row["decode_tok_s"] == 800.0
    assert row["eval/toy/acc/pte"] == 0.47 and row["eval/toy/acc/fp"] == 0.5
    assert row["eval/toy/acc_stderr/pte"] == 0.01  # lm-eval's standard error travels with its metric (table, wandb row)
    assert (
        row["latency_source"] == "own bench (1 process)" and row["ppl_pte_lo"] is None
    )  # no block losses: no interval
    del s["quantized"]  # an older summary: the recipe says whether it quantizes (RunSummary reads it)

    def row_of(d):
        return summary_row(RunSummary.from_dict(d))

    assert row_of(s)["mode"] == "qat" and row_of({**s, "recipe": "xnnpack_fp32", "mode": "ptq"})["mode"] == "fp"


@pytest.mark.fast
def test_impossible_sizes_and_latencies_skip_the_run_with_a_note_naming_file_and_field(runs_dir):
    for name, edit in (
        ("int4-ptq", lambda s: s["pte"].update(size_bytes=-5)),  # was on both fronts
        ("8da4w-qat", lambda s: s["bench"]["pte"]["decode_tok_s"].update(median=float("nan"))),
    ):
        path = runs_dir / name / "summary.json"
        data = json.loads(path.read_text())
        edit(data)
        path.write_text(json.dumps(data))  # NaN as JSON's NaN, as a hand-written summary holds it
    result = write_report(runs_dir, wandb=False)
    assert {r["run"] for r in result["rows"]} == set(RUNS) - {"int4-ptq", "8da4w-qat"}
    assert "int4-ptq" not in result["front"] + result["front_size"]
    notes = [line for line in result["text"].splitlines() if line.startswith("Skipped")]
    assert any(f"{runs_dir / 'int4-ptq' / 'summary.json'}: pte.size_bytes is -5" in n for n in notes), notes
    assert any("8da4w-qat" in n and "bench.pte.decode_tok_s.median is nan" in n for n in notes), notes


@pytest.mark.fast
def test_a_huge_summary_or_text_field_is_skipped_before_matplotlib(runs_dir, monkeypatch):
    from qharness.reporting import collect

    path = runs_dir / "int8-qat" / "summary.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "recipe": "r" * 5000}))  # a name no plot label can hold
    big = runs_dir / "int4-ptq" / "summary.json"
    big.write_text(big.read_text() + " " * 20_000)
    monkeypatch.setattr(collect, "MAX_SUMMARY_BYTES", 10_000)  # stands for 16 MB
    result = write_report(runs_dir, wandb=False)
    assert {r["run"] for r in result["rows"]} == set(RUNS) - {"int8-qat", "int4-ptq"}
    text = result["text"]
    assert "int8-qat/summary.json: recipe is 5000 characters long (at most 1000)" in text
    assert "int4-ptq/summary.json: 0 MB, more than a run summary holds" in text
    assert max(len(line) for line in text.splitlines()) < 2000


def _row(k: int, ms: float, ppl: float, mb: float) -> dict:
    """A report row of run ``k`` with no noise estimate (so its comparisons are exact)."""
    return {
        "run": f"r{k:05d}",
        "recipe": "x",
        "mode": "ptq",
        "parity_passed": True,
        "decode_ms_per_token": ms,
        "pte_size_mb": mb,
        "ppl_pte": ppl,
    }


@pytest.mark.fast
def test_the_ranking_of_thousands_of_runs_makes_a_near_linear_number_of_comparisons(monkeypatch):
    import random

    from qharness.reporting import ranking

    rng = random.Random(0)
    rows = [_row(k, rng.random(), 100 + 10 * rng.random(), 1 + rng.random()) for k in range(3000)]
    rows += [dict(rows[0], run="copy")]  # the same figures as r00000: a tie
    calls = 0
    compare = ranking.compare_accuracy

    def counted(*args):
        nonlocal calls
        calls += 1
        if calls > 100 * len(rows):  # all pairs would be 9 million
            raise AssertionError("the ranking compares (nearly) every pair of runs")
        return compare(*args)

    monkeypatch.setattr(ranking, "compare_accuracy", counted)
    for axis in ("latency", "size"):
        front, ties = ranking.noisy_front(rows, "ppl_pte", True, axis=axis)
        exact = pareto_front([(r[ranking.AXES[axis]], r["ppl_pte"]) for r in rows], lower_is_better=True)
        assert {r["run"] for r in front} == {rows[i]["run"] for i in exact}  # no noise: the exact front
        assert ties["copy"] == ["r00000"]
    best = ranking.best_choice(rows, "ppl_pte", True, max_latency_ms=0.5)["best"]
    assert best["ppl_pte"] == min(r["ppl_pte"] for r in rows if r["decode_ms_per_token"] <= 0.5)
