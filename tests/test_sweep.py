"""``qharness sweep``: plan, skip-on-rerun, failure recording and the report (a stand-in runner writes the
summaries); one real tiny sweep is marked slow."""

import json
import os
import shutil
import sys
import threading
import time

import pytest
import yaml
from conftest import ROOT, fake_measurement, run_cli, write_config
from test_bench import make_tiny_pte

from qharness.errors import UserError
from qharness.io.atomic import write_json_atomic
from qharness.sweep.launch import run_logged
from qharness.sweep.plan import depends_on, plan
from qharness.sweep.resume import is_done
from qharness.sweep.scheduler import run_sweep
from qharness.sweep.spec import load_sweep

PPL = {
    "xnnpack_fp32-ptq": 98.0,
    "xnnpack_int8_dynamic-ptq": 98.1,
    "xnnpack_int8_dynamic-qat": 98.6,
    "xnnpack_int4w_dynamic-ptq": 101.0,
}
MS = {
    "xnnpack_fp32-ptq": 3.0,
    "xnnpack_int8_dynamic-ptq": 1.0,
    "xnnpack_int8_dynamic-qat": 1.1,
    "xnnpack_int4w_dynamic-ptq": 0.9,
}


def sweep_yaml(tmp_path, max_steps=5, **extra):
    spec = {
        "sweep_dir": str(tmp_path / "sweep"),
        "runs": [
            {"recipe": "xnnpack_int8_dynamic", "modes": ["ptq", "qat"]},
            {"recipe": "xnnpack_int4w_dynamic", "mode": "ptq"},
        ],
        "config": {"model": {"checkpoint": str(tmp_path / "some_model")}, "trainer": {"max_steps": max_steps}},
        "report": {"max_latency_ms": 1.05, "wandb": False},
        **extra,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class FakeRunner:
    """Stands in for ``python -m qharness fit|calibrate``: writes the run's summary.json from its config."""

    def __init__(self, fail=(), pte=None, structure=None):
        self.calls, self.fail, self.pte, self.structure = [], set(fail), pte, structure or {}

    def __call__(self, cmd, log_path):
        cfg = yaml.safe_load(open(cmd[cmd.index("--config") + 1]))
        run_dir = cfg["trainer"]["default_root_dir"]
        name = f"{cfg['model']['recipe']}-{cfg['model']['mode']}"
        self.calls.append((cmd[cmd.index("qharness") + 1], name))  # the subcommand
        log_path.write_text("log of " + name)
        if name in self.fail:
            return 1
        pte = {"size_bytes": 2_000_000}
        if name in self.structure:  # the program's structure digest (deploy/structure.py)
            pte["structure"] = self.structure[name]
        if self.pte:  # a real (tiny) program in the run dir, as fit/calibrate leave one
            pte["path"] = str(shutil.copy(self.pte, f"{run_dir}/model.pte"))
        write_json_atomic(
            f"{run_dir}/summary.json",
            {
                "run_dir": run_dir,
                "model": "m",
                "recipe": cfg["model"]["recipe"],
                "backend": "xnnpack",
                "mode": cfg["model"]["mode"],
                "quantized": cfg["model"]["recipe"] != "xnnpack_fp32",
                "metrics": {"fp": {"ppl": 98.0}, "pte": {"ppl": PPL[name]}},
                "seq_len": 32,
                "eval_blocks": 8,
                "parity": {"passed": True},
                "pte": pte,
                "bench": {
                    "prompt_len": 8,
                    "decode_tokens": 4,
                    "reps": 2,
                    "pte": {
                        "decode_tok_s": {"median": 1000 / MS[name], "min": 1000 / MS[name], "max": 1000 / MS[name]}
                    },
                }
                if cfg.get("bench", {}).get("enabled", True)
                else None,  # bench.enabled: false, as the demo sweep: no benchmark of its own
            },
        )
        return 0


@pytest.mark.fast
def test_plan_puts_the_baseline_first_with_one_run_dir_each(tmp_path):
    runs = plan(load_sweep(sweep_yaml(tmp_path)))
    assert [(r.name, r.subcommand) for r in runs] == [
        ("xnnpack_fp32-ptq", "calibrate"),
        ("xnnpack_int8_dynamic-ptq", "calibrate"),
        ("xnnpack_int8_dynamic-qat", "fit"),
        ("xnnpack_int4w_dynamic-ptq", "calibrate"),
    ]
    qat = runs[2]
    assert qat.run_dir == tmp_path / "sweep" / "xnnpack_int8_dynamic-qat"
    assert qat.config["trainer"] == {"max_steps": 5, "default_root_dir": str(qat.run_dir)}
    assert qat.config["model"] == {
        "checkpoint": str(tmp_path / "some_model"),
        "recipe": "xnnpack_int8_dynamic",
        "mode": "qat",
    }
    assert qat.config["wandb"] == {"group": "sweep"}
    assert "bench" not in runs[0].config and qat.config["bench"] == {
        "eager": False
    }  # the eager FP model is measured once
    assert [r.config["eval"]["models"] for r in runs] == [
        ["fp", "pte"],
        ["pte"],
        ["fake_quant", "pte"],
        ["pte"],
    ]  # FP evaluated once


def test_rerun_skips_finished_runs_retries_failed_ones_and_reruns_changed_configs(tmp_path):
    path = sweep_yaml(tmp_path)
    first = FakeRunner(fail={"xnnpack_int8_dynamic-qat"})
    result = run_sweep(path, runner=first)
    assert [c[1] for c in first.calls] == list(PPL)  # every run, in order, although one failed
    assert {r["name"]: r["state"] for r in result["runs"]}["xnnpack_int8_dynamic-qat"] == "failed"
    assert [c[0] for c in first.calls] == ["calibrate", "calibrate", "fit", "calibrate"]
    rep = result["report"]
    assert {r["run"] for r in rep["rows"]} == {
        "xnnpack_fp32-ptq",
        "xnnpack_int8_dynamic-ptq",
        "xnnpack_int4w_dynamic-ptq",
    }
    assert rep["best"]["run"] == "xnnpack_int8_dynamic-ptq"  # <= 1.05 ms/token: int8 (98.1) beats int4 (101)
    assert "Failed run: xnnpack_int8_dynamic-qat (exit 1)" in rep["text"]
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"][2]["returncode"] == 1

    second = FakeRunner()
    result = run_sweep(path, runner=second)
    assert second.calls == [("fit", "xnnpack_int8_dynamic-qat")]  # only the failed run runs again
    assert [r["state"] for r in result["runs"]] == ["skipped", "skipped", "done", "skipped"]
    assert len(result["report"]["rows"]) == 4

    third = FakeRunner()
    run_sweep(sweep_yaml(tmp_path, max_steps=7), runner=third)  # another shared config: every run is stale
    assert len(third.calls) == 4
    fourth = FakeRunner()
    run_sweep(sweep_yaml(tmp_path, max_steps=7), runner=fourth, force=True)
    assert len(fourth.calls) == 4


@pytest.mark.fast
def test_a_stale_summary_does_not_count_as_done(tmp_path):
    path = sweep_yaml(tmp_path)
    run_sweep(path, runner=FakeRunner(), report=False)
    runs = plan(load_sweep(path))
    assert all(is_done(r) for r in runs)
    (runs[1].run_dir / "summary.json").unlink()
    assert not is_done(runs[1])
    failing = FakeRunner(fail={"xnnpack_fp32-ptq"})
    run_sweep(sweep_yaml(tmp_path, max_steps=9), runner=failing, report=False)
    assert not (runs[0].run_dir / "summary.json").exists()  # the old config's result is gone, not reported as this one


def test_the_sweep_times_every_finished_program_jointly(tmp_path, monkeypatch):
    """After the runs: one joint session (alternating rounds) over every finished run's .pte (the failed run left
    out), its bench_joint in each summary.json and all of them in bench_joint.json, at the sweep config's bench lengths even
    though the runs benchmarked nothing themselves (bench.enabled: false). The fresh processes are stood in for
    (their numbers are made up), so the test checks order, shapes and arithmetic, not speed."""
    import qharness.runtime.joint

    pte = make_tiny_pte(tmp_path / "tiny" / "model.pte")
    calls = []

    def fake_measure(**kw):  # process k of the run in directory d decodes (10 * (k + 1)) tok/s
        k = sum(c["path"] == kw["path"] for c in calls)
        calls.append(kw)
        tok_s = 10.0 * (k + 1)
        return fake_measurement(tok_s)

    monkeypatch.setattr(qharness.runtime.joint, "measure_in_fresh_process", fake_measure)
    path = sweep_yaml(tmp_path, report={"wandb": False, "bench_processes": 3})
    spec = yaml.safe_load(path.read_text())
    spec["config"]["bench"] = {"enabled": False, "prompt_len": 8, "decode_tokens": 4, "reps": 2}
    path.write_text(yaml.safe_dump(spec))
    result = run_sweep(path, runner=FakeRunner(fail={"xnnpack_int8_dynamic-qat"}, pte=pte))
    names = ["xnnpack_fp32-ptq", "xnnpack_int8_dynamic-ptq", "xnnpack_int4w_dynamic-ptq"]
    sweep = tmp_path / "sweep"
    assert [c["path"] for c in calls] == [
        str(sweep / n / "model.pte") for n in names + names[::-1] + names
    ]  # 3 rounds, every other one reversed
    assert {(c["prompt_len"], c["decode_tokens"], c["reps"]) for c in calls} == {
        (8, 4, 10)
    }  # the sweep's lengths, >= 10 reps
    assert len({c["threads"] for c in calls}) == 1  # one thread count for the whole session
    joint = json.loads((sweep / "bench_joint.json").read_text())
    assert list(joint["programs"]) == names and joint["sequence"] == names + names[::-1] + names
    for name in names:
        entry = json.loads((sweep / name / "summary.json").read_text())["bench_joint"]
        assert list(entry) == [
            "processes",
            "order",
            "load_avg_1m",
            "threads",
            "decode_tok_s",
            "prefill_tok_s",
            "decode_ms_per_token",
        ]
        assert (entry["processes"], entry["order"], len(entry["load_avg_1m"])) == (3, "alternating", 2)
        assert entry["decode_tok_s"] == {"median": 20.0, "min": 10.0, "max": 30.0, "per_process": [10.0, 20.0, 30.0]}
        assert entry["prefill_tok_s"]["median"] == 40.0
        assert entry["decode_ms_per_token"] == {
            "median": 50.0,
            "min": 1e3 / 30,
            "max": 100.0,
            "per_process": [100.0, 50.0, 1e3 / 30],
        }
    assert result["bench_joint"]["threads"] == joint["threads"]

    calls.clear()  # bench_processes: 0 turns the joint benchmark off
    run_sweep(
        sweep_yaml(tmp_path, report={"wandb": False, "bench_processes": 0}), runner=FakeRunner(pte=pte), report=False
    )
    assert calls == []


def test_programs_of_one_structure_are_timed_and_reported_as_one_latency_class(tmp_path, monkeypatch):
    """Two runs whose programs share a structure (a PTQ and a QAT program of one recipe) are one latency class: both
    timed in the rounds, their process medians pooled into one figure that both summaries hold, with the class's
    members; the report names the class, shows one figure for it and ties them on latency, though the QAT program's
    own processes were made slower. A run of another structure keeps its own figure. Stand-in timings, as above."""
    import qharness.runtime.joint
    from qharness.reporting.ranking import compare_latency

    pte = make_tiny_pte(tmp_path / "tiny" / "model.pte")
    own_tok_s = {"xnnpack_fp32-ptq": 100.0, "xnnpack_int8_dynamic-ptq": 300.0, "xnnpack_int8_dynamic-qat": 200.0}
    own_tok_s["xnnpack_int4w_dynamic-ptq"] = 400.0
    calls = []

    def fake_measure(**kw):  # each run's own speed, the k-th process 1% faster
        name = kw["path"].split(os.sep)[-2]
        tok_s = own_tok_s[name] * (1 + 0.01 * sum(c == name for c in calls))
        calls.append(name)
        return fake_measurement(tok_s)

    monkeypatch.setattr(qharness.runtime.joint, "measure_in_fresh_process", fake_measure)
    path = sweep_yaml(tmp_path, report={"wandb": False, "bench_processes": 2, "max_latency_ms": None})
    spec = yaml.safe_load(path.read_text())
    spec["config"]["bench"] = {"enabled": False, "prompt_len": 8, "decode_tokens": 4, "reps": 2}
    path.write_text(yaml.safe_dump(spec))
    structure = {"xnnpack_int8_dynamic-ptq": "s8", "xnnpack_int8_dynamic-qat": "s8", "xnnpack_int4w_dynamic-ptq": "s4"}
    result = run_sweep(path, runner=FakeRunner(pte=pte, structure=structure))
    sweep = tmp_path / "sweep"
    assert len(calls) == 8  # every program timed, 2 processes each
    entry = {n: json.loads((sweep / n / "summary.json").read_text())["bench_joint"] for n in own_tok_s}
    cls = ["xnnpack_int8_dynamic-ptq", "xnnpack_int8_dynamic-qat"]
    assert entry[cls[0]] == entry[cls[1]]
    assert entry[cls[0]]["latency_class"] == cls
    assert entry[cls[0]]["decode_tok_s"]["per_process"] == [300.0, 200.0, 303.0, 202.0]  # pooled round by round
    assert entry[cls[0]]["decode_tok_s"]["median"] == 251.0
    assert "latency_class" not in entry["xnnpack_int4w_dynamic-ptq"]
    assert entry["xnnpack_int4w_dynamic-ptq"]["decode_tok_s"]["per_process"] == [400.0, 404.0]
    joint = json.loads((sweep / "bench_joint.json").read_text())  # each member's own timings are kept there
    assert joint["programs"][cls[1]]["unpooled"]["decode_tok_s"]["per_process"] == [200.0, 202.0]

    rows = {r["run"]: r for r in result["report"]["rows"]}
    assert rows[cls[0]]["decode_ms_per_token"] == rows[cls[1]]["decode_ms_per_token"]
    assert rows[cls[0]]["latency_class_id"] == rows[cls[1]]["latency_class_id"] == "L1"
    assert rows["xnnpack_int4w_dynamic-ptq"].get("latency_class_id") is None
    assert "one latency class" in compare_latency(rows[cls[0]], rows[cls[1]]).text
    assert compare_latency(rows[cls[0]], rows[cls[1]]).sign == 0
    report = (sweep / "report.md").read_text()
    assert f"Latency class L1: {', '.join(cls)}: one program structure" in report
    assert "| latency class |" in report


@pytest.mark.fast
@pytest.mark.parametrize(
    "spec, message",
    [
        ({"runs": [{"recipe": "xnnpack_fp32", "modes": ["qat"]}]}, "does not support mode 'qat'"),
        ({"runs": [{"recipe": "nope", "modes": ["ptq"]}]}, "unknown recipe 'nope'"),
        ({"runs": []}, "needs runs"),
        ({"runs": [{"recipe": "xnnpack_fp32"}]}, "names no modes"),
        ({"runs": [{"recipe": "xnnpack_fp32", "modes": ["ptq"]}], "extra": 1}, "unknown keys ['extra']"),
        (
            {"runs": [{"recipe": "xnnpack_fp32", "modes": ["ptq"]}], "report": {"bench_processes": -1}},
            "bench_processes must be a whole number",
        ),
        ({"runs": [{"recipe": "xnnpack_fp32", "modes": ["ptq"]}], "jobs": 0}, "jobs must be a whole number >= 1"),
        ({"runs": [{"recipe": "xnnpack_fp32", "modes": ["ptq"]}], "jobs": "2"}, "jobs must be a whole number >= 1"),
        (
            {"runs": [{"recipe": "xnnpack_fp32", "modes": ["ptq"]}], "jobs": 2, "report": {"bench_processes": 0}},
            "2 runs at a time with report.bench_processes: 0",
        ),
        (
            {
                "runs": [
                    {"recipe": "xnnpack_int8_dynamic", "modes": ["qat"]},
                    {"recipe": "xnnpack_int8_dynamic", "modes": ["qat"], "config": {"model": {"lr": 1.0}}},
                ]
            },
            "two runs would be named xnnpack_int8_dynamic-qat",
        ),
    ],
)
def test_bad_sweep_configs_fail_before_any_run(tmp_path, spec, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan(load_sweep(path))


@pytest.mark.fast
def test_a_sweep_of_thousands_of_runs_is_refused_until_max_runs_allows_it(tmp_path):
    runs = [{"recipe": "xnnpack_int8_dynamic", "name": f"v{k}", "modes": ["ptq"]} for k in range(10_000)]
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump({"runs": runs, "sweep_dir": str(tmp_path / "s")}))
    with pytest.raises(UserError, match=r"plans 10001 runs .*more than max_runs: 100.*fix: set max_runs: 10001"):
        load_sweep(path)
    path.write_text(yaml.safe_dump({"runs": runs, "sweep_dir": str(tmp_path / "s"), "max_runs": 10_001}))
    assert load_sweep(path)["max_runs"] == 10_001  # said in the config: the sweep may plan them
    path.write_text(yaml.safe_dump({"runs": runs[:1], "max_runs": 0}))
    with pytest.raises(UserError, match="max_runs must be a whole number >= 1"):
        load_sweep(path)


@pytest.mark.fast
@pytest.mark.parametrize(
    "where, what",
    [("/", "the filesystem root"), ("~", "your home directory itself"), ("/etc/qh", "in a system directory")],
)
def test_a_sweep_dir_of_the_root_home_or_a_system_directory_is_refused(tmp_path, where, what):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"runs": [{"recipe": "xnnpack_fp32", "modes": ["ptq"]}], "sweep_dir": where}))
    with pytest.raises(UserError, match=f"sweep_dir {where} is {what}") as e:
        load_sweep(path)
    assert "\n" not in str(e.value) and "fix: name a directory of its own" in str(e.value)


def test_sweep_cli_bad_config_is_one_line_exit_2(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"runs": [{"recipe": "xnnpack_fp32", "modes": ["qat"]}]}))
    r = run_cli("sweep", path)
    assert r.returncode == 2 and "does not support mode 'qat'" in r.stderr and "Traceback" not in r.stderr


def test_run_logged_tees_output_and_returns_the_exit_code(tmp_path, capfdbinary):
    code = run_logged(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        tmp_path / "x.log",
    )
    assert code == 3
    log = (tmp_path / "x.log").read_text()
    assert "out" in log and "err" in log
    assert b"out" in capfdbinary.readouterr().out


@pytest.mark.fast
def test_the_shipped_sweep_covers_fp_ptq_and_qat():
    runs = plan(load_sweep(ROOT / "configs" / "sweep_xnnpack.yaml"))
    assert runs[0].name == "xnnpack_fp32-ptq" and len(runs) >= 5
    assert {r.mode for r in runs} == {"ptq", "qat"} and all(r.config["model"]["checkpoint"] == "embedded" for r in runs)


@pytest.mark.slow
def test_a_real_tiny_sweep_and_its_rerun(tmp_path, tiny_llama, corpus):
    base = yaml.safe_load(write_config(tmp_path / "base.yaml", tiny_llama, corpus, tmp_path / "unused").read_text())
    del base["trainer"]["default_root_dir"]
    spec = {
        "sweep_dir": str(tmp_path / "sweep"),
        "runs": [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}],
        "config": base,
        "report": {"wandb": False},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    r = run_cli("sweep", tmp_path / "s.yaml")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Pareto plot:" in r.stdout and (tmp_path / "sweep" / "pareto.png").is_file()
    rows = json.loads((tmp_path / "sweep" / "report.json").read_text())["rows"]
    assert {(x["recipe"], x["mode"]) for x in rows} == {("xnnpack_fp32", "fp"), ("xnnpack_int8_dynamic", "ptq")}
    again = run_cli("sweep", tmp_path / "s.yaml")
    assert again.returncode == 0 and again.stdout.count("finished earlier with the same config, skipped") == 2


@pytest.mark.fast
def test_named_variants_of_one_recipe_get_their_own_run_dirs(tmp_path):
    path = tmp_path / "s.yaml"
    distill = {"model": {"distill": {"kl_weight": 1.0}}}
    path.write_text(
        yaml.safe_dump(
            {
                "sweep_dir": str(tmp_path / "sweep"),
                "runs": [
                    {"recipe": "xnnpack_fp32", "modes": ["ptq"]},  # the baseline again: one run
                    {"recipe": "xnnpack_int8_dynamic", "modes": ["ptq", "qat"]},
                    {"recipe": "xnnpack_int8_dynamic", "modes": ["qat"], "name": "int8_distill", "config": distill},
                ],
            }
        )
    )
    runs = plan(load_sweep(path))
    assert [r.name for r in runs] == [
        "xnnpack_fp32-ptq",
        "xnnpack_int8_dynamic-ptq",
        "xnnpack_int8_dynamic-qat",
        "int8_distill-qat",
    ]
    assert runs[3].run_dir == tmp_path / "sweep" / "int8_distill-qat" and runs[3].recipe == "xnnpack_int8_dynamic"
    assert runs[3].config["model"]["distill"] == {"kl_weight": 1.0} and "distill" not in runs[2].config["model"]


class SlowRunner(FakeRunner):
    """FakeRunner that takes 0.3 s per run and records when each started and ended (runs may overlap)."""

    def __init__(self):
        super().__init__()
        self.spans, self.lock, self.running, self.most = {}, threading.Lock(), 0, 0

    def __call__(self, cmd, log_path):
        name = log_path.parent.name
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        start = time.perf_counter()
        time.sleep(0.3)
        code = super().__call__(cmd, log_path)
        with self.lock:
            self.running -= 1
            self.spans[name] = (start, time.perf_counter())
        return code


@pytest.mark.fast
def test_jobs_run_runs_side_by_side_and_a_run_waits_for_the_run_it_names(tmp_path):
    """jobs: 2 keeps two runs going at once; a run whose config names another run's directory (here its teacher)
    starts only after that run ended; the records keep the plan's order and a rerun skips them all as before."""
    teacher = str(tmp_path / "sweep" / "xnnpack_int8_dynamic-qat")
    path = sweep_yaml(tmp_path, jobs=2)
    spec = yaml.safe_load(path.read_text())
    spec["runs"].append(
        {
            "recipe": "xnnpack_int8_dynamic",
            "name": "int8_kd",
            "modes": ["qat"],
            "config": {"model": {"distill": {"teacher": teacher}}},
        }
    )
    path.write_text(yaml.safe_dump(spec))
    runs = plan(load_sweep(path))
    assert [r.name for r in runs if depends_on(runs[-1], r)] == ["xnnpack_int8_dynamic-qat"]
    runner = SlowRunner()
    result = run_sweep(path, runner=runner, report=False)
    assert [r["name"] for r in result["runs"]] == [r.name for r in runs]
    assert all(r["state"] == "done" for r in result["runs"]) and runner.most == 2
    assert runner.spans["int8_kd-qat"][0] >= runner.spans["xnnpack_int8_dynamic-qat"][1]
    assert [r["name"] for r in json.loads((tmp_path / "sweep" / "sweep.json").read_text())["runs"]] == [
        r.name for r in runs
    ]
    again = SlowRunner()
    assert [r["state"] for r in run_sweep(path, runner=again, report=False, jobs=3)["runs"]] == ["skipped"] * 5
    assert again.calls == []


@pytest.mark.fast
def test_depends_on_finds_a_path_inside_an_earlier_run_dir_only(tmp_path):
    spec = {
        "sweep_dir": str(tmp_path / "sweep"),
        "runs": [
            {"recipe": "xnnpack_8da4w", "modes": ["ptq"]},
            {"recipe": "xnnpack_8da4w", "name": "a", "modes": ["ptq"], "config": {"data": {"source": "text.txt"}}},
        ],
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    base, first, second = plan(load_sweep(tmp_path / "s.yaml"))
    assert not any(depends_on(r, e) for r in (first, second) for e in (base, first) if r is not e)
    second.config["model"]["distill"] = {"teacher": os.path.relpath(first.run_dir)}  # relative paths count too
    assert depends_on(second, first) and not depends_on(second, base)
    second.config["model"]["distill"] = {"teacher": str(first.run_dir) + "_other"}  # a sibling is not inside
    assert not depends_on(second, first)


def test_run_logged_without_echo_logs_only_and_sets_the_threads(tmp_path, capfdbinary, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("QHARNESS_THREADS", "3")  # a setting of the user's wins
    code = run_logged(
        [
            sys.executable,
            "-c",
            "import os; print('threads', os.environ['OMP_NUM_THREADS'], os.environ['QHARNESS_THREADS'])",
        ],
        tmp_path / "x.log",
        echo=False,
        threads=1,
    )
    assert code == 0 and "threads 1 3" in (tmp_path / "x.log").read_text()
    assert b"threads" not in capfdbinary.readouterr().out


def test_the_sweep_cli_runs_two_real_runs_at_a_time(tmp_path, tiny_llama, corpus):
    """``qharness sweep --jobs 2`` on the tiny Llama, as a user runs it: both runs finish, their output is in their
    sweep.log (not on the console), the joint benchmark and the report follow."""
    base = yaml.safe_load(write_config(tmp_path / "base.yaml", tiny_llama, corpus, tmp_path / "unused").read_text())
    del base["trainer"]["default_root_dir"]
    base["bench"] = {"enabled": False, "prompt_len": 8, "decode_tokens": 4, "reps": 2}
    spec = {
        "sweep_dir": str(tmp_path / "sweep"),
        "runs": [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}],
        "config": base,
        "report": {"wandb": False, "bench_processes": 1},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    r = run_cli("sweep", tmp_path / "s.yaml", "--jobs", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[sweep] 2 runs at a time" in r.stdout and "parity PASSED" not in r.stdout
    for name in ("xnnpack_fp32-ptq", "xnnpack_int8_dynamic-ptq"):
        assert "parity PASSED" in (tmp_path / "sweep" / name / "sweep.log").read_text()
    assert "timing 2 programs jointly" in r.stdout and "Pareto plot:" in r.stdout
    bad = run_cli("sweep", tmp_path / "s.yaml", "--jobs", "0")
    assert bad.returncode == 2 and "--jobs must be a whole number >= 1" in bad.stderr and "Traceback" not in bad.stderr


def test_a_run_config_the_precheck_refuses_stops_the_sweep_before_any_run(tmp_path, tiny_llama, corpus):
    """A run whose own config is bad (data.seq_len -1 in its config) is one line naming the run before the baseline or
    any other run starts; it used to fail (exit 1) after the runs before it had run."""
    from conftest import run_cli

    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "sweep_dir": str(tmp_path / "sw"),
                "config": {"model": {"checkpoint": str(tiny_llama)}, "data": {"source": str(corpus), "seq_len": 32}},
                "runs": [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"], "config": {"data": {"seq_len": -1}}}],
            }
        )
    )
    r = run_cli("sweep", sweep)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: sweep {sweep}: run xnnpack_int8_dynamic-ptq: data.seq_len must be at least 2 (got -1). "
        "fix: e.g. data.seq_len: 128"
    )
    assert not (tmp_path / "sw").exists()  # nothing ran, nothing was written


def test_the_shipped_sweep_passes_the_run_config_checks():
    from conftest import ROOT, run_cli

    r = run_cli("sweep", ROOT / "configs" / "sweep_xnnpack.yaml", "--dry_run")
    assert r.returncode == 0 and "xnnpack_8da3w-qat" in r.stdout, r.stderr[-2000:]
