"""``qharness ship``: the decision rule on synthetic rows, the ladder's skips and stop (a fake runner counts which
runs happened), resume of a killed ship, the CLI's one-line refusals, and the chosen config re-running to the same
program (tiny model)."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from conftest import run_cli, write_config

from qharness.errors import UserError
from qharness.io.atomic import write_json_atomic
from qharness.shipping import climb
from qharness.shipping.decide import Goal, decide, misses
from qharness.shipping.record import ShipRecord
from qharness.shipping.spec import make_goal, parse_tolerance

BLOCKS = [5.0, 5.2, 4.9, 5.1]


def row(run, hi, size, lat=None, passed=True, shift=None, mid=None):
    """A report row as ``reporting/rows.py`` makes it: ``hi`` the upper end of the paired interval against FP."""
    mid = hi - 0.005 if mid is None else mid
    shift = math.log1p(mid) if shift is None else shift
    return {
        "run": run,
        "parity_passed": passed,
        "ppl_pte": 98 * (1 + mid),
        "ppl_pte_vs_fp": mid,
        "ppl_pte_vs_fp_lo": mid - 0.005,
        "ppl_pte_vs_fp_hi": hi,
        "pte_size_mb": size,
        "decode_ms_per_token": lat,
        "_blocks": {"pte": [b + shift for b in BLOCKS]},
        "_val": "v",
        "_sha256": run,
        "_decode_ms_samples": None,
    }


# --- the decision rule ---------------------------------------------------------------------------------------------


@pytest.mark.fast
def test_meets_means_the_upper_end_of_the_interval_within_the_tolerance_and_the_budgets():
    goal = Goal(0.02, max_size_mb=2.0)
    assert misses(row("a", 0.019, 1.8), goal) == []
    assert misses(row("b", 0.021, 1.8), goal) == ["ppl vs FP up to +2.10% > 2.00%"]  # the point estimate is 1.6%
    assert misses(row("c", 0.01, 2.3), goal) == [".pte 2.300 MB > 2 MB"]
    assert misses(row("d", 0.0, 1.0, passed=False), goal) == ["its .pte failed the parity gate"]


@pytest.mark.fast
def test_the_smallest_candidate_that_meets_everything_is_chosen():
    rows = [row("int8", 0.001, 2.28), row("w4", 0.011, 1.79), row("w3", 0.04, 1.6)]
    d = decide(rows, Goal(0.02), {"int8": 0, "w4": 1, "w3": 2})
    assert d.chosen["run"] == "w4" and d.tied == [] and d.closest is None
    assert "smallest" in d.text


@pytest.mark.fast
def test_a_tie_on_size_goes_to_the_more_accurate_beyond_the_noise_then_the_cheaper_rung():
    # equal sizes: w4_gptq is more accurate beyond the noise (its blocks are lower by a constant)
    rows = [row("w4", 0.012, 1.793), row("w4_gptq", 0.006, 1.793), row("w4_qat", 0.006, 1.795, shift=math.log1p(0.001))]
    order = {"w4": 1, "w4_gptq": 1, "w4_qat": 3}
    d = decide(rows, Goal(0.02), order)
    assert d.chosen["run"] == "w4_gptq"  # w4_qat ties it on accuracy? no: its blocks are lower still
    d = decide(rows[:2] + [row("w4_qat", 0.006, 1.795, mid=0.001)], Goal(0.02), order)
    assert {r["run"] for r in [d.chosen, *d.tied]} == {"w4", "w4_gptq", "w4_qat"}
    assert "tie on size" in d.text and "the cheaper rung" in d.text
    # the same accuracy within the noise (identical blocks): the cheaper rung wins
    same = [row("w4_gptq", 0.006, 1.793, shift=0.0), row("w4_qat", 0.006, 1.793, shift=0.0)]
    assert decide(same, Goal(0.02), {"w4_gptq": 1, "w4_qat": 3}).chosen["run"] == "w4_gptq"
    assert decide(same, Goal(0.02), {"w4_gptq": 3, "w4_qat": 1}).chosen["run"] == "w4_qat"


@pytest.mark.fast
def test_impossible_names_the_closest_candidate():
    rows = [row("int8", 0.001, 2.28), row("w4", 0.011, 1.79), row("w3", 0.04, 1.79)]
    d = decide(rows, Goal(0.0, max_size_mb=1.0), {})
    assert d.chosen is None and d.closest["run"] == "w4"  # misses 1.1% and 79%: the smallest worst miss
    assert d.text.startswith("no candidate meets") and "the closest is w4" in d.text


@pytest.mark.fast
def test_prefer_latency_picks_the_fastest():
    rows = [row("int8", 0.001, 2.28, lat=5.0), row("w4", 0.011, 1.79, lat=7.0)]
    assert decide(rows, Goal(0.02, prefer="latency"), {}).chosen["run"] == "int8"
    assert decide(rows, Goal(0.02), {}).chosen["run"] == "w4"
    assert decide(rows, Goal(0.02, max_latency_ms=6.0), {}).chosen["run"] == "int8"


@pytest.mark.parametrize("value,fraction", [("2%", 0.02), ("0%", 0.0), (" 1.5 % ", 0.015), (0.02, 0.02), (0, 0.0)])
def test_the_tolerance_is_a_percentage_or_a_fraction(value, fraction):
    assert parse_tolerance(value) == pytest.approx(fraction)


@pytest.mark.parametrize("value", ["2", "two%", "-1%", -0.1, True, float("nan")])
def test_a_bad_tolerance_is_refused(value):
    with pytest.raises(UserError, match="max_ppl_increase"):
        parse_tolerance(value)


@pytest.mark.fast
def test_bad_budgets_and_prefer_are_refused():
    with pytest.raises(UserError, match="--max_size_mb must be a positive number"):
        make_goal("2%", max_size_mb=0)
    with pytest.raises(UserError, match="--max_latency_ms must be a positive number"):
        make_goal("2%", max_latency_ms=-3)
    with pytest.raises(UserError, match="--prefer 'speed'"):
        make_goal("2%", prefer="speed")


# --- the ladder, with a fake runner ---------------------------------------------------------------------------------

# name -> (upper end of the interval against FP, .pte MB); missing: the run fails
RESULTS = {
    "xnnpack_fp32-ptq": (0.001, 5.37),
    "xnnpack_int8_dynamic-ptq": (0.001, 2.278),
    "xnnpack_8da4w-ptq": (0.011, 1.793),
    "xnnpack_8da4w_hqq-ptq": (0.010, 1.793),
    "xnnpack_8da4w_gptq-ptq": (0.009, 1.793),
    "xnnpack_8da4w_rot_gptq-ptq": (0.012, 1.793),
    "xnnpack_8da4w_tied8-ptq": (0.007, 1.95),  # an 8-bit table and lm_head: larger on the untied demo model
    "xnnpack_8da4w_zp-ptq": (0.006, 1.99),  # the same with zero points' offsets: larger still
    "xnnpack_8da4w_zp_split-ptq": (0.0058, 1.99),  # the same with the head's input as two int8 rows
    "autotune_2mb-ptq": (0.008, 1.95),
    "xnnpack_8da4w_lsq_gptq-qat": (0.004, 1.793),
    "xnnpack_8da4w_tied8-qat": (0.005, 1.95),
    "xnnpack_8da4w_zp_lsq-qat": (0.0045, 1.99),
    "xnnpack_8da4w_zp_split_lsq-qat": (0.0044, 1.99),
    "xnnpack_8da3w-ptq": (0.088, 1.793),
    "xnnpack_8da3w_gptq-ptq": (0.044, 1.793),
    "xnnpack_8da3w_pc-ptq": (0.09, 1.70),
    "xnnpack_8da3w_lsq_gptq-qat": (0.011, 1.793),
}


class FakeRunner:
    """Stands in for ``python -m qharness calibrate|fit|autotune``: writes the run's summary.json (and a stand-in
    .pte) from ``RESULTS``; ``calls`` lists the runs it made; ``kill`` raises on that run (a killed ship)."""

    def __init__(self, kill=None):
        self.calls, self.kill = [], kill

    def __call__(self, cmd, log_path):
        cfg = yaml.safe_load(open(cmd[cmd.index("--config") + 1]))
        run_dir = cfg["trainer"]["default_root_dir"]
        name = run_dir.rsplit("/", 1)[-1]
        sub = cmd[cmd.index("qharness") + 1]
        if name == self.kill:
            raise KeyboardInterrupt(name)
        self.calls.append((sub, name))
        log_path.write_text("log of " + name)
        if name not in RESULTS:
            return 1
        hi, size = RESULTS[name]
        mid = hi - 0.006
        with open(f"{run_dir}/model.pte", "wb") as f:
            f.write(name.encode())
        if sub == "autotune":
            with open(f"{run_dir}/autotuned.yaml", "w") as f:
                f.write("base: xnnpack_8da4w\ndescription: autotuned\n")
        shift = math.log1p(mid)
        write_json_atomic(
            f"{run_dir}/summary.json",
            {
                "run_dir": run_dir,
                "model": "m",
                "recipe": "autotuned" if sub == "autotune" else cfg["model"]["recipe"],
                "backend": "xnnpack",
                "mode": cfg["model"]["mode"],
                "quantized": cfg["model"]["recipe"] != "xnnpack_fp32",
                "seq_len": 32,
                "eval_blocks": 4,
                "val_blocks": "v",
                "metrics": {
                    "fp": {"ppl": 98.0, "block_losses": BLOCKS},
                    "pte": {
                        "ppl": 98.0 * (1 + mid),
                        "vs_fp": {"ppl_ratio": 1 + mid, "ci": [1 + mid - 0.006, 1 + hi]},
                        "block_losses": [b + shift for b in BLOCKS],
                    },
                },
                "parity": {"passed": True},
                "pte": {"path": f"{run_dir}/model.pte", "size_bytes": int(size * 1e6), "sha256": name},
            },
        )
        return 0


def ship_yaml(tmp_path, **extra):
    spec = {
        "ship_dir": str(tmp_path / "ship"),
        "baseline": "xnnpack_fp32",
        "jobs": 1,
        "bench_processes": 1,
        "config": {"model": {"checkpoint": str(tmp_path / "model")}, "data": {"source": "x.txt"}},
        **extra,
    }
    path = tmp_path / "ship.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def no_bench(monkeypatch):
    """No joint benchmark (the stand-in programs cannot run) and no report plots: the decision is the subject."""
    monkeypatch.setattr(climb, "_bench", lambda *a, **k: None)
    monkeypatch.setattr(climb, "_report", lambda *a, **k: None)


@pytest.mark.fast
def test_a_tolerance_4bit_ptq_meets_ends_without_training(tmp_path, no_bench):
    runner = FakeRunner()
    rec = climb.run_ship(ship_yaml(tmp_path), make_goal("2%"), runner=runner)
    assert [sub for sub, _ in runner.calls] == ["calibrate"] * 9  # the FP reference, int8, seven 4-bit PTQ
    assert rec.outcome == "chosen" and rec.chosen == "xnnpack_8da4w_gptq-ptq"  # the tie on size: most accurate
    states = {r.name: r.state for r in rec.rungs}
    assert states == {
        "int8_ptq": "tried",
        "int4_ptq": "tried",
        "mixed_ptq": "skipped",
        "int4_qat": "skipped",
        "int3_ptq": "skipped",
        "int3_qat": "skipped",
    }
    qat = next(r for r in rec.rungs if r.name == "int4_qat")
    assert "already meets everything" in qat.reason and "xnnpack_8da4w_gptq-ptq" in qat.reason
    assert rec.stop_reason.startswith("after int4_ptq, no further rung could change the answer")
    assert sorted(rec.tied) == ["xnnpack_8da4w-ptq", "xnnpack_8da4w_hqq-ptq", "xnnpack_8da4w_rot_gptq-ptq"]
    written = ShipRecord.read(tmp_path / "ship" / "ship.json")
    assert written.chosen == rec.chosen and written.outcome == "chosen"
    md = (tmp_path / "ship" / "ship.md").read_text()
    assert "| int4_qat | skipped |" in md and "CHOSEN" in md
    # chosen.yaml: the candidate's own run config, its recipe the chosen recipe file (the same settings), its output
    # a fresh directory; the slow test below re-runs one and compares the programs
    chosen = yaml.safe_load((tmp_path / "ship" / "chosen.yaml").read_text())
    ran = yaml.safe_load((tmp_path / "ship" / "xnnpack_8da4w_gptq-ptq" / "sweep_config.yaml").read_text())
    assert chosen["model"].pop("recipe") == str(tmp_path / "ship" / "chosen_recipe.yaml")
    assert chosen["trainer"].pop("default_root_dir") == str(tmp_path / "ship" / "chosen_rerun")
    ran["model"].pop("recipe"), ran["trainer"].pop("default_root_dir")
    assert chosen == ran
    assert (
        (tmp_path / "ship" / "chosen.yaml").read_text().startswith(f"# qharness calibrate {tmp_path}/ship/chosen.yaml")
    )
    from qharness.recipes.registry import load_recipe

    recipe = load_recipe(str(tmp_path / "ship" / "chosen_recipe.yaml"))
    assert recipe.settings == load_recipe("xnnpack_8da4w_gptq").settings
    assert (tmp_path / "ship" / "chosen.pte").read_bytes() == b"xnnpack_8da4w_gptq-ptq"


@pytest.mark.fast
def test_the_chosen_recipe_file_reads_the_same_from_the_ship_folder_when_its_base_is_relative(tmp_path):
    """A user's recipe ``mine/child.yaml`` with ``base: sibling.yaml``: copied verbatim into the ship folder, its
    relative base would be looked for there and not be found; ``chosen_recipe.yaml`` carries the merged fields. A chosen
    program with a data file (``model.ptd``: a tied table stored once) is copied with it (``chosen.ptd``)."""
    from qharness.recipes.registry import load_recipe
    from qharness.sweep.plan import SweepRun

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sibling.yaml").write_text("base: xnnpack_8da4w\ndescription: the user's 4-bit sibling\n")
    (mine / "child.yaml").write_text("base: sibling.yaml\ndescription: the user's recipe\n")
    run_dir = tmp_path / "runs" / "xnnpack_8da4w-ptq"
    run_dir.mkdir(parents=True)
    config = {
        "model": {"recipe": str(mine / "child.yaml"), "mode": "ptq"},
        "trainer": {"default_root_dir": str(run_dir)},
    }
    (run_dir / "c.yaml").write_text(yaml.safe_dump(config))
    FakeRunner()(["qharness", "calibrate", "--config", str(run_dir / "c.yaml")], tmp_path / "log")
    ship_dir = tmp_path / "ship"
    ship_dir.mkdir()
    run = SweepRun("xnnpack_8da4w-ptq", str(mine / "child.yaml"), "ptq", config, run_dir)
    climb.write_chosen(ship_dir, run, {})
    chosen = load_recipe(str(ship_dir / "chosen_recipe.yaml"))
    assert chosen.settings == load_recipe(str(mine / "child.yaml")).settings == load_recipe("xnnpack_8da4w").settings
    assert chosen.description == "the user's recipe"
    assert not (ship_dir / "chosen.ptd").exists()  # a self-contained .pte
    (run_dir / "model.ptd").write_bytes(b"the tied table, stored once")  # a program with a data file: it goes along
    climb.write_chosen(ship_dir, run, {})
    assert (ship_dir / "chosen.ptd").read_bytes() == b"the tied table, stored once"


def test_a_tolerance_only_qat_meets_ends_at_qat(tmp_path, no_bench):
    runner = FakeRunner()
    rec = climb.run_ship(ship_yaml(tmp_path), make_goal("0.5%", max_size_mb=2.0), runner=runner)
    # every QAT candidate trains: each one's PTQ sibling fits the budget
    assert [n for _, n in runner.calls][-5:] == [
        "autotune_2mb-ptq",
        "xnnpack_8da4w_lsq_gptq-qat",
        "xnnpack_8da4w_tied8-qat",
        "xnnpack_8da4w_zp_lsq-qat",
        "xnnpack_8da4w_zp_split_lsq-qat",
    ]
    assert ("fit", "xnnpack_8da4w_lsq_gptq-qat") in runner.calls
    assert rec.outcome == "chosen" and rec.chosen == "xnnpack_8da4w_lsq_gptq-qat"
    assert [r.state for r in rec.rungs][-2:] == ["skipped", "skipped"]  # fewer bits: not demanded
    assert "xnnpack_8da4w_lsq_gptq-qat already meets everything" in rec.rungs[-2].reason
    assert yaml.safe_load((tmp_path / "ship" / "chosen.yaml").read_text())["model"]["distill"]["kl_weight"] == 1.0


def test_a_qat_candidate_whose_ptq_sibling_is_over_the_size_budget_is_left_out_of_its_rung(
    tmp_path, no_bench, monkeypatch
):
    """A tied model (SmolLM2's case): the tied 8-bit program is the only 4-bit one under the budget, so of the QAT
    rung only its QAT sibling trains; the other is left out, and the record says why."""
    from qharness.sweep.plan import autotune_name

    monkeypatch.setitem(RESULTS, "xnnpack_8da4w_tied8-ptq", (0.007, 1.70))
    monkeypatch.setitem(RESULTS, "xnnpack_8da4w_tied8-qat", (0.003, 1.70))
    monkeypatch.setitem(RESULTS, autotune_name({"max_size_mb": 1.75}) + "-ptq", (0.009, 1.74))
    runner = FakeRunner()
    rec = climb.run_ship(ship_yaml(tmp_path), make_goal("0.5%", max_size_mb=1.75), runner=runner)
    assert ("fit", "xnnpack_8da4w_tied8-qat") in runner.calls
    assert not any(n == "xnnpack_8da4w_lsq_gptq-qat" for _, n in runner.calls)
    assert rec.outcome == "chosen" and rec.chosen == "xnnpack_8da4w_tied8-qat"
    qat = next(r for r in rec.rungs if r.name == "int4_qat")
    assert qat.state == "tried" and qat.candidates == ["xnnpack_8da4w_tied8-qat"]
    assert qat.reason.startswith("left out xnnpack_8da4w_lsq_gptq-qat: its programs are at least 1.793 MB")
    assert "over the 1.75 MB budget" in qat.reason
    assert "left out xnnpack_8da4w_lsq_gptq-qat" in (tmp_path / "ship" / "ship.md").read_text()


@pytest.mark.fast
def test_prune_leaves_out_each_qat_entry_its_own_sibling_rules_out_and_the_ladder_keeps_siblings_of_kept_entries():
    from qharness.shipping.ladder import ladder_for

    rung = next(r for r in ladder_for("xnnpack") if r.name == "int4_qat")
    assert rung.siblings == {
        "xnnpack_8da4w_lsq_gptq-qat": "xnnpack_8da4w_gptq-ptq",
        "xnnpack_8da4w_tied8-qat": "xnnpack_8da4w_tied8-ptq",
        "xnnpack_8da4w_zp_lsq-qat": "xnnpack_8da4w_zp-ptq",
        "xnnpack_8da4w_zp_split_lsq-qat": "xnnpack_8da4w_zp_split-ptq",
    }
    row = {"parity_passed": True, "ppl_pte_vs_fp_hi": 0.02}
    rows = {
        "xnnpack_8da4w_gptq-ptq": row
        | {"run": "xnnpack_8da4w_gptq-ptq", "pte_size_mb": 2.0, "decode_ms_per_token": 3.0},
        "xnnpack_8da4w_tied8-ptq": row
        | {"run": "xnnpack_8da4w_tied8-ptq", "pte_size_mb": 1.5, "decode_ms_per_token": 9.0},
        "xnnpack_8da4w_zp-ptq": row | {"run": "xnnpack_8da4w_zp-ptq", "pte_size_mb": 2.1, "decode_ms_per_token": 10.0},
        "xnnpack_8da4w_zp_split-ptq": row
        | {"run": "xnnpack_8da4w_zp_split-ptq", "pte_size_mb": 2.1, "decode_ms_per_token": 10.5},
    }
    # one sibling over the size budget, the other over the latency budget: the rung as a whole could still reach
    # both (its smallest and its fastest program are different ones), but neither of its entries can
    goal = Goal(0.005, max_size_mb=1.8, max_latency_ms=5.0)
    assert climb.skip_reason(rung, rows, {n: 4 for n in rows}, goal) is None
    pruned, left_out = climb.prune(rung, rows, goal)
    assert pruned.entries == ()
    assert [line.split(":")[0] for line in left_out] == [
        "xnnpack_8da4w_lsq_gptq-qat",
        "xnnpack_8da4w_tied8-qat",
        "xnnpack_8da4w_zp_lsq-qat",
        "xnnpack_8da4w_zp_split_lsq-qat",
    ]
    assert "over the 1.8 MB budget" in left_out[0] and "over the 5 ms budget" in left_out[1]
    # excluding a recipe drops its QAT entry and its sibling with it
    rung = next(
        r
        for r in ladder_for(
            "xnnpack", exclude=["xnnpack_8da4w_tied8", "xnnpack_8da4w_zp_lsq", "xnnpack_8da4w_zp_split_lsq"]
        )
        if r.name == "int4_qat"
    )
    assert rung.siblings == {"xnnpack_8da4w_lsq_gptq-qat": "xnnpack_8da4w_gptq-ptq"}
    assert [e["recipe"] for e in rung.entries] == ["xnnpack_8da4w_lsq_gptq"]


@pytest.mark.fast
def test_a_skip_names_every_candidate_that_meets_so_the_one_the_tie_rule_chooses_is_among_them():
    """SmolLM2's ship (real-model.md): zp (91.704 MB) and zp_split (91.708 MB, chosen by the tie rule) both met
    everything, and the skipped rungs named zp alone."""
    from qharness.shipping.ladder import ladder_for

    zp, split, w4 = "xnnpack_8da4w_zp-ptq", "xnnpack_8da4w_zp_split-ptq", "xnnpack_8da4w-ptq"
    rows = {
        zp: row(zp, 0.0396, 91.704, shift=math.log1p(0.0214)),
        split: row(split, 0.0395, 91.708, shift=math.log1p(0.0214)),
        w4: row(w4, 0.30, 89.0),  # misses: named nowhere
    }
    goal = Goal(0.051, max_size_mb=92)
    assert decide(list(rows.values()), goal, dict.fromkeys(rows, 1)).chosen["run"] == split  # the tie rule's pick
    ladder = {r.name: r for r in ladder_for("xnnpack", 92)}
    mixed = climb.skip_reason(ladder["mixed_ptq"], rows, dict.fromkeys(rows, 4), goal)
    assert mixed.startswith(f"{zp} already meets everything (as does {split}); per-layer mixed"), mixed
    left_out = climb.prune(ladder["int4_qat"], rows, goal)[1]  # zp's QAT sibling: no smaller than zp
    assert any(f"(as does {split})" in line and w4 not in line for line in left_out), left_out
    assert "(as do" not in climb.skip_reason(ladder["mixed_ptq"], {split: rows[split]}, {split: 4}, goal)


def test_fewer_bits_are_not_tried_when_accuracy_not_the_budget_is_what_misses(tmp_path, no_bench):
    runner = FakeRunner()
    rec = climb.run_ship(ship_yaml(tmp_path), make_goal("0.3%", max_size_mb=2.0), runner=runner)
    assert not any("8da3w" in n for _, n in runner.calls)
    assert rec.outcome == "impossible" and rec.closest == "xnnpack_8da4w_lsq_gptq-qat"
    assert "fit the budgets but miss the tolerance; fewer bits lose more accuracy" in rec.rungs[-2].reason
    assert "the closest is xnnpack_8da4w_lsq_gptq-qat" in rec.decision


def test_an_impossible_goal_says_so_with_the_closest_candidate(tmp_path, no_bench):
    runner = FakeRunner()
    rec = climb.run_ship(ship_yaml(tmp_path), make_goal("0%", max_size_mb=1.0), runner=runner)
    ran = [n for _, n in runner.calls]
    assert "autotune_1mb-ptq" not in ran and not any(sub == "fit" for sub, _ in runner.calls)  # cannot fit 1 MB
    assert ran[-2:] == ["xnnpack_8da3w_gptq-ptq", "xnnpack_8da3w_pc-ptq"]  # demanded by size
    assert rec.outcome == "impossible" and rec.chosen is None
    assert rec.closest == "xnnpack_8da3w_pc-ptq"  # 1.70 MB: the smallest worst miss
    assert "over the 1 MB budget" in rec.rungs[-1].reason  # 3-bit QAT: its PTQ sibling's size
    assert not (tmp_path / "ship" / "chosen.pte").exists()


@pytest.mark.fast
def test_a_killed_ship_continues_from_its_finished_rungs(tmp_path, no_bench):
    path = ship_yaml(tmp_path)
    killed = FakeRunner(kill="xnnpack_8da4w_gptq-ptq")
    with pytest.raises(KeyboardInterrupt):
        climb.run_ship(path, make_goal("2%"), runner=killed)
    partial = ShipRecord.read(tmp_path / "ship" / "ship.json")
    assert partial.outcome == "running" and [r.name for r in partial.rungs] == ["int8_ptq"]
    again = FakeRunner()
    rec = climb.run_ship(path, make_goal("2%"), runner=again)
    # only the runs the kill left unfinished ran again; the FP reference, int8 and the 4-bit runs before it: reused
    assert [n for _, n in again.calls] == [
        "xnnpack_8da4w_gptq-ptq",
        "xnnpack_8da4w_rot_gptq-ptq",
        "xnnpack_8da4w_tied8-ptq",
        "xnnpack_8da4w_zp-ptq",
        "xnnpack_8da4w_zp_split-ptq",
    ]
    states = {c.name: c.state for c in rec.candidates}
    assert states["xnnpack_int8_dynamic-ptq"] == "reused" and states["xnnpack_8da4w_gptq-ptq"] == "ran"
    assert rec.chosen == "xnnpack_8da4w_gptq-ptq"
    third = FakeRunner()  # the same decision again, nothing run
    assert climb.run_ship(path, make_goal("2%"), runner=third).chosen == rec.chosen and third.calls == []


# --- the command line -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max_ppl_increase", "2"], "--max_ppl_increase '2' is not a percentage"),
        (["--max_ppl_increase", "2%", "--max_size_mb", "0"], "--max_size_mb must be a positive number"),
        (["--max_ppl_increase", "2%", "--prefer", "speed"], "--prefer 'speed' is not one of size, latency"),
    ],
)
def test_the_cli_refuses_bad_input_in_one_line(tmp_path, args, message):
    r = run_cli("ship", ship_yaml(tmp_path), *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and message in r.stderr
    assert not (tmp_path / "ship").exists()


def test_the_cli_refuses_a_config_a_candidate_precheck_refuses(tmp_path):
    path = ship_yaml(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["config"] = {
        "model": {"checkpoint": "embedded"},
        "data": {"source": "embedded"},
        "trainer": {"max_steps": "many"},
    }
    path.write_text(yaml.safe_dump(spec))
    r = run_cli("ship", path, "--max_ppl_increase", "2%")
    assert r.returncode == 2, r.stderr
    assert (
        "candidate xnnpack_fp32-ptq" in r.stderr and "max_steps" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    )
    assert not (tmp_path / "ship" / "ship.json").exists()


# --- a real ship on the tiny model: the chosen config makes the same program ------------------------------------------


@pytest.mark.slow
def test_the_chosen_config_reruns_to_the_same_program(tmp_path, tiny_llama, corpus, monkeypatch):
    """A one-rung ladder (int8 PTQ) on the tiny Llama through the real CLI runs; then ``chosen.yaml`` re-run."""
    from qharness.shipping import ladder

    one = (ladder.LADDERS["xnnpack"][0],)
    monkeypatch.setitem(ladder.LADDERS, "xnnpack", one)
    monkeypatch.setattr(climb, "_report", lambda *a, **k: None)
    data = tmp_path / "text.txt"
    data.write_text(corpus.read_text()[:100_000])
    base = yaml.safe_load(
        write_config(tmp_path / "base.yaml", tiny_llama, data, tmp_path / "unused").read_text().split("\n", 1)[1]
    )
    base.pop("model")["checkpoint"]
    base["model"] = {"checkpoint": str(tiny_llama)}
    base["trainer"].pop("default_root_dir")
    spec = {"ship_dir": str(tmp_path / "ship"), "baseline": "xnnpack_fp32", "bench_processes": 1, "config": base}
    (tmp_path / "ship.yaml").write_text(yaml.safe_dump(spec))
    rec = climb.run_ship(tmp_path / "ship.yaml", make_goal("50%"))
    assert rec.outcome == "chosen" and rec.chosen == "xnnpack_int8_dynamic-ptq", rec.decision
    r = run_cli(*rec.rerun.split()[1:])
    assert r.returncode == 0, r.stderr[-3000:]
    first = json.loads((tmp_path / "ship" / "xnnpack_int8_dynamic-ptq" / "summary.json").read_text())
    again = json.loads((tmp_path / "ship" / "chosen_rerun" / "summary.json").read_text())
    assert again["pte"]["size_bytes"] == first["pte"]["size_bytes"]
    assert again["metrics"]["pte"]["ppl"] == pytest.approx(first["metrics"]["pte"]["ppl"], rel=1e-6)
    assert again["pte"]["sha256"] == first["pte"]["sha256"]


@pytest.mark.fast
def test_a_latency_goal_times_the_candidates_after_each_rung_and_picks_the_fastest(tmp_path, monkeypatch):
    """With ``prefer="latency"`` the candidates are timed jointly after each rung (a stand-in benchmark writes
    ``bench_joint``); the fastest that meets the tolerance wins, and the QAT rung (as fast as its PTQ sibling, slower
    than the chosen) is skipped."""
    from qharness.run.summary import RunSummary

    ms = {"xnnpack_int8_dynamic-ptq": 4.0, "xnnpack_8da4w_gptq-ptq": 6.0}
    benched = []

    def bench(spec, ship_dir, runs, rows):
        benched.append(sorted(rows))
        for name in rows:
            v = ms.get(name, 7.0)
            spread = {"median": v, "min": v * 0.99, "max": v * 1.01, "per_process": [v * 0.99, v * 1.01]}
            RunSummary.update(
                runs[name].run_dir / "summary.json", bench_joint={"processes": 2, "decode_ms_per_token": spread}
            )

    monkeypatch.setattr(climb, "_bench", bench)
    monkeypatch.setattr(climb, "_report", lambda *a, **k: None)
    rec = climb.run_ship(ship_yaml(tmp_path), make_goal("2%", prefer="latency"), runner=FakeRunner())
    assert rec.chosen == "xnnpack_int8_dynamic-ptq"
    assert [len(b) for b in benched] == [1, 8]  # after int8_ptq, then after int4_ptq: every candidate so far
    assert "4 ms/token" in rec.rungs[3].reason and rec.rungs[3].state == "skipped"
    assert {c.name: c.latency_ms for c in rec.candidates}["xnnpack_int8_dynamic-ptq"] == 4.0


@pytest.mark.fast
def test_exclude_leaves_recipes_out_of_the_ladder(tmp_path, no_bench):
    runner = FakeRunner()
    rec = climb.run_ship(ship_yaml(tmp_path), make_goal("2%"), runner=runner, exclude=["xnnpack_8da4w_gptq"])
    assert "xnnpack_8da4w_gptq-ptq" not in [n for _, n in runner.calls] and len(runner.calls) == 8
    assert rec.chosen == "xnnpack_8da4w_hqq-ptq" and rec.goal["exclude"] == ["xnnpack_8da4w_gptq"]
    with pytest.raises(UserError, match="--exclude xnnpack_nope: not a recipe of the xnnpack ladder"):
        climb.run_ship(ship_yaml(tmp_path), make_goal("2%"), runner=runner, exclude=["xnnpack_nope"])


@pytest.mark.fast
def test_excluding_every_recipe_of_the_ladder_is_bad_input_before_any_work(tmp_path, no_bench):
    from qharness.shipping.ladder import LADDERS

    every = sorted({e["recipe"] for rung in LADDERS["xnnpack"] for e in rung.entries})
    runner = FakeRunner()
    with pytest.raises(UserError, match="--exclude .* leaves no recipe of the xnnpack ladder to try") as e:
        climb.run_ship(ship_yaml(tmp_path), make_goal("2%"), runner=runner, exclude=every)
    assert "fix: exclude fewer of" in str(e.value) and "--max_size_mb" in str(e.value)
    assert runner.calls == [] and not list(tmp_path.rglob("ship.json"))  # nothing run, nothing written


@pytest.mark.fast
def test_the_joint_benchmark_is_kept_when_it_timed_these_candidates_together(tmp_path):
    write_json_atomic(tmp_path / "bench_joint.json", {"programs": {"a": {}, "b": {}}})
    timed = {"a": {"_decode_ms_samples": [1.0]}, "b": {"_decode_ms_samples": [2.0]}}
    assert climb._timed_together(tmp_path, {"a", "b"}, timed)
    assert climb._timed_together(tmp_path, {"a"}, timed)  # some of one joint session: still timed together
    assert not climb._timed_together(tmp_path, {"a", "b", "c"}, {**timed, "c": {"_decode_ms_samples": [1.0]}})
    assert not climb._timed_together(tmp_path, {"a", "b"}, {**timed, "b": {"_decode_ms_samples": None}})  # made again
    assert not climb._timed_together(tmp_path / "none", {"a", "b"}, timed)


def test_ship_help_lists_its_options():
    """(Its help says "2%": argparse formats help strings with %, which the docstring grammar now escapes.)"""
    r = run_cli("ship", "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    for option in ("--max_ppl_increase", "--max_size_mb", "--max_latency_ms", "--prefer", "--exclude", "e.g. 2%:"):
        assert option in r.stdout


@pytest.mark.fast
def test_qat_runs_when_only_a_larger_ptq_candidate_meets_the_tolerance(tmp_path, no_bench, monkeypatch):
    """int8 meets 0.5% but 4-bit PTQ does not: QAT's program (its PTQ sibling's size) would be smaller, so it runs."""
    monkeypatch.setitem(RESULTS, "xnnpack_8da4w_rot_gptq-ptq", (0.009, 1.789))
    runner = FakeRunner()
    rec = climb.run_ship(ship_yaml(tmp_path), make_goal("0.5%"), runner=runner)
    assert ("fit", "xnnpack_8da4w_lsq_gptq-qat") in runner.calls
    assert rec.chosen == "xnnpack_8da4w_lsq_gptq-qat"  # 1.793 MB against int8's 2.278
    assert {r.name: r.state for r in rec.rungs}["mixed_ptq"] == "skipped"  # no size budget


def test_the_latency_budget_reaches_the_autotune_rung():
    """With a size budget, the mixed-precision rung's autotune entry carries the ship's latency budget too (autotune
    then measures its per-layer latency table); without a latency budget it has the size budget alone."""
    from qharness.shipping.ladder import ladder_for

    def tuned(rungs):
        return [e["autotune"] for r in rungs for e in r.entries if "autotune" in e]

    assert tuned(ladder_for("xnnpack", 2.0, (), 0.6)) == [{"max_size_mb": 2.0, "max_latency_ms": 0.6}]
    assert tuned(ladder_for("xnnpack", 2.0)) == [{"max_size_mb": 2.0}]
    assert tuned(ladder_for("xnnpack", None, (), 0.6)) == []  # autotune's rung needs the size budget
