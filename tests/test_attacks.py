"""An attacker's tries on the CLI: planted code in a run directory or in the
working directory, names and paths that would write or delete outside their directory, strings from a
``summary.json`` that would inject spreadsheet formulas or Markdown/HTML into the report, sizes that would allocate
more memory than the machine has, and sweep inputs that were silently wrong. Each ends in one ``error: ... fix:``
line (or, for the report, a skipped run with a note), before any work."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT
from test_report import RUNS, summary

from qharness.errors import UserError
from qharness.sweep.plan import plan
from qharness.sweep.spec import load_sweep


def sweep_file(tmp_path, runs, **extra):
    spec = {"sweep_dir": str(tmp_path / "sweep"), "runs": runs, "report": {"wandb": False}, **extra}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


# ---------------------------------------------------------------- sweep names and inputs


@pytest.mark.fast
@pytest.mark.parametrize("name", ["../../victim", "/tmp/victim", "a/b", "..", "x\ny", "tab\there", "rtl\u202eexe"])
def test_a_sweep_run_name_that_is_not_a_plain_name_is_refused(tmp_path, name):
    path = sweep_file(tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"], "name": name}])
    with pytest.raises(UserError, match=r"runs\[0\]\.name .* is not a plain name"):
        plan(load_sweep(path))


@pytest.mark.fast
def test_a_recipe_path_whose_name_is_not_plain_is_refused(tmp_path):
    recipe = tmp_path / "bad\nname.yaml"
    recipe.write_text((ROOT / "qharness" / "recipes" / "builtin" / "xnnpack_int8_dynamic.yaml").read_text())
    path = sweep_file(tmp_path, [{"recipe": str(recipe), "modes": ["ptq"]}])
    with pytest.raises(UserError, match="run name .* is not a plain name"):
        plan(load_sweep(path))


@pytest.mark.fast
def test_a_run_named_like_the_baseline_is_refused_not_dropped(tmp_path):
    path = sweep_file(tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"], "name": "xnnpack_fp32"}])
    with pytest.raises(UserError, match="two runs would be named xnnpack_fp32-ptq"):
        plan(load_sweep(path))


@pytest.mark.fast
def test_mode_and_modes_together_are_refused(tmp_path):
    path = sweep_file(tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"], "mode": "qat"}])
    with pytest.raises(UserError, match=r"runs\[0\] has both mode and modes.*fix: keep one: modes: \['ptq', 'qat'\]"):
        load_sweep(path)


@pytest.mark.fast
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


@pytest.mark.fast
@pytest.mark.parametrize(
    "metric", ["ppl", "decode_ms_per_token", "qharness_mc/acc_mutual_info", "qharness_ppl/bits_per_byte/fp"]
)
def test_report_metrics_the_runs_will_have_are_accepted(tmp_path, metric):
    path = sweep_file(
        tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}], report={"metric": metric, "wandb": False}
    )
    assert len(plan(load_sweep(path))) == 2


@pytest.mark.fast
def test_a_task_metric_with_eval_disabled_is_refused(tmp_path):
    path = sweep_file(
        tmp_path,
        [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}],
        report={"metric": "qharness_mc/acc_mutual_info"},
        config={"eval": {"enabled": False}},
    )
    with pytest.raises(UserError, match="no run evaluates task 'qharness_mc' \\(eval.tasks: none, eval disabled\\)"):
        plan(load_sweep(path))


@pytest.mark.fast
def test_a_sweep_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file")
    path = sweep_file(
        tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}], sweep_dir=str(tmp_path / "taken")
    )
    with pytest.raises(UserError, match="sweep_dir .*taken is a file, not a directory"):
        load_sweep(path)
    path = sweep_file(
        tmp_path, [{"recipe": "xnnpack_int8_dynamic", "modes": ["ptq"]}], sweep_dir=str(tmp_path / "taken" / "sub")
    )
    with pytest.raises(UserError, match="lies under .*taken, which is a file"):
        load_sweep(path)


@pytest.mark.fast
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


@pytest.mark.slow  # its run child can take minutes on a loaded machine; the fast check of -P is the test above
def test_a_sweep_does_not_run_a_yaml_py_planted_in_the_working_directory(tmp_path, tiny_llama, corpus):
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
        # passes the sweep's check of each run's config; the run itself then refuses its eval task (a child ran)
        # (the tests' tiny model: the embedded default would be pretrained first in this test's fresh cache)
        "config": {
            "model": {"checkpoint": str(tiny_llama)},
            "data": {"source": str(corpus)},
            "eval": {"enabled": True, "tasks": ["no_such_task_q"]},
        },
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
    assert "no_such_task_q" in log, r.stdout + r.stderr  # the run started and failed on its task, as it should
    assert not marker.exists(), "the run process imported the planted yaml.py"


# ---------------------------------------------------------------- paths of a run's outputs


def run_config(tmp_path, **sections):
    from conftest import write_config

    path = tmp_path / "run.yaml"
    write_config(path, "embedded", "embedded", tmp_path / "run", **sections)
    return path


@pytest.mark.fast
@pytest.mark.parametrize(
    "override, message",
    [
        (["--checkpoint.filename", "../../escaped"], "checkpoint.filename '../../escaped' is not a plain name"),
        (["--checkpoint.filename", "/tmp/escaped"], "checkpoint.filename '/tmp/escaped' is not a plain name"),
        (["--checkpoint.dirpath", "/tmp/elsewhere"], r"checkpoint.dirpath is set by qharness .*'/tmp/elsewhere'"),
        ({"checkpoint": {"filename": "a\nb"}}, r"checkpoint.filename 'a\\nb' is not a plain name"),
        ({"checkpoint": {"dirpath": "../.."}}, r"checkpoint.dirpath is set by qharness .*'../..'"),
        ({"deploy": {"filename": "a\nb.pte"}}, r"deploy.filename 'a\\nb.pte' must be a plain file name"),
    ],
)
def test_checkpoint_and_pte_names_stay_in_the_run_directory(tmp_path, override, message):
    from qharness.api.precheck import precheck

    sections = override if isinstance(override, dict) else {}
    extra = override if isinstance(override, list) else []
    with pytest.raises(UserError, match=message):
        precheck(["fit", "--config", str(run_config(tmp_path, **sections)), *extra])


def test_an_escaping_checkpoint_filename_is_one_line_from_the_cli(tmp_path):
    from conftest import run_cli

    r = run_cli("fit", "--config", run_config(tmp_path), "--checkpoint.filename", "../../escaped", timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "checkpoint.filename '../../escaped' is not a plain name" in r.stderr
    assert not (tmp_path / "escaped.ckpt").exists() and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the report: injection and bad summaries


def report_runs(tmp_path, **changes) -> tuple:
    """Two good runs and one whose summary gets ``changes`` (dotted keys: ``metrics.pte``)."""
    root = tmp_path / "runs"
    for name in ("fp", "int8-ptq", "evil"):
        s = summary(name, *RUNS[name if name != "evil" else "int4-ptq"])
        if name == "evil":
            for key, value in changes.items():
                *parents, last = key.split(".")
                target = s
                for p in parents:
                    target = target[p]
                target[last] = value
        (root / name).mkdir(parents=True)
        (root / name / "summary.json").write_text(json.dumps(s))  # NaN and Infinity as JSON's extension writes them
    return root


@pytest.mark.fast
def test_report_csv_neutralizes_formulas_and_markdown_escapes_rows_and_html(tmp_path):
    from qharness.reporting.report import write_report

    evil = "=cmd|' /C calc'!A0"
    html = "x | injected | row |\n| more | <script>alert(1)</script>"
    root = report_runs(tmp_path, recipe=html, backend=evil, model="@SUM(1+1)")
    write_report(root, wandb=False)
    cells = [c for row in csv.reader(open(root / "report.csv")) for c in row]
    assert "'" + evil in cells and "'@SUM(1+1)" in cells
    assert not any(c.startswith(("=", "+", "@")) for c in cells)
    md = (root / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 3  # header, rule, one row per run: nothing added
    assert {len(re.findall(r"(?<!\\)\|", line)) for line in table} == {table[0].count("|")}  # same columns
    assert "<script>" not in md and "&lt;script>alert(1)&lt;/script>" in md
    assert "x \\| injected \\| row \\|\\n\\| more \\| &lt;script>" in md


@pytest.mark.fast
def test_report_md_text_lines_carry_no_html_or_new_lines(tmp_path):
    from qharness.reporting.report import write_report

    root = report_runs(tmp_path, recipe="r\n# heading <img src=x onerror=alert(1)>")
    write_report(root, wandb=False, max_latency_ms=0.85)  # the evil run (0.8 ms) is the best: named in the text
    md = (root / "report.md").read_text()
    assert "<img" not in md and "&lt;img" in md
    assert "\n# heading" not in md and "r\\n# heading" in md


@pytest.mark.fast
@pytest.mark.parametrize(
    "changes, named",
    [
        ({"metrics.pte": "oops"}, "metrics.pte is not a JSON object"),
        ({"metrics.pte.ppl": "98"}, "TypeError"),
        ({"bench.pte.bandwidth_fraction": "98"}, "bandwidth_fraction is '98', not a number"),
        ({"parity.passed": "yes"}, "parity.passed is 'yes'"),
        ({"recipe": 3}, "recipe is int, not text"),
        ({"bench.pte.decode_tok_s": [1, 2]}, "decode_tok_s is not a JSON object"),
        ({"eval.tasks": {"toy": {"pte": {"acc,none": "high"}}}}, None),  # lm-eval's "N/A": left out, run kept
        ({"eval.tasks": {"a/b": {"pte": {"acc,none": 0.5}}}}, "is not a plain name"),
        ({"metrics.pte.block_losses": ["x"]}, "block_losses"),
        ({"val_blocks": [1, 2]}, "val_blocks is list"),
    ],
)
def test_a_summary_of_wrong_types_skips_that_run_with_a_note_not_the_report(tmp_path, changes, named):
    from qharness.reporting.report import write_report

    root = report_runs(tmp_path, **changes)
    result = write_report(root, wandb=False)
    runs = {r["run"] for r in result["rows"]}
    note = [line for line in result["text"].splitlines() if line.startswith("Skipped")]
    if named is None:
        assert runs == {"fp", "int8-ptq", "evil"} and not note
        return
    assert runs == {"fp", "int8-ptq"} and len(note) == 1
    assert str(root / "evil" / "summary.json") in note[0] and named in note[0]


def test_report_out_that_is_a_file_is_one_line(tmp_path):
    from conftest import run_cli

    root = report_runs(tmp_path)
    (tmp_path / "taken").write_text("a file")
    r = run_cli("report", root, "--out", tmp_path / "taken", "--no_wandb")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert f"--out {tmp_path / 'taken'} is a file, not a directory" in r.stderr


# ---------------------------------------------------------------- planted code in a run directory


@pytest.mark.fast
def test_a_task_yaml_planted_in_the_run_directory_never_runs(tiny_llama, corpus, tmp_path):
    from qharness.config import EvalConfig
    from qharness.evaluation.harness import run_eval
    from qharness.evaluation.lm_eval_adapter import QHarnessLM, hf_backend
    from qharness.sources.models import load_model_and_tokenizer

    run = tmp_path / "run"
    planted = run / "eval" / "tasks"
    planted.mkdir(parents=True)
    marker = tmp_path / "planted_ran"
    (planted / "docs.jsonl").write_text(json.dumps({"text": "planted " * 40}) + "\n")
    (planted / "evil.py").write_text(
        f"import pathlib\ndef process_docs(ds):\n    pathlib.Path({str(marker)!r}).write_text('ran')\n    return ds\n"
    )
    (planted / "evil.yaml").write_text(
        "task: qharness_ppl\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {planted / 'docs.jsonl'}\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: text\n"
        "process_docs: !function evil.process_docs\nmetric_list:\n  - metric: word_perplexity\n"
    )
    model, tok = load_model_and_tokenizer(str(tiny_llama))
    result = run_eval(
        {"fp": QHarnessLM(hf_backend(model, 32, 4), tok)},
        EvalConfig(tasks=["qharness_ppl"], limit=2, bootstrap_iters=0),
        [corpus.read_text()[-20_000:]],
        run,
    )
    assert not marker.exists(), "the planted task's !function ran"
    assert sorted(p.name for p in planted.iterdir()) == ["data", "qharness_ppl.yaml"]  # the asked task alone
    assert result["documents"] == {"qharness_ppl": 2} and "bits_per_byte" in result["tasks"]["qharness_ppl"]["fp"]


# ---------------------------------------------------------------- sizes the machine cannot hold


@pytest.mark.fast
def test_deploy_memory_is_estimated_from_the_config():
    from transformers import LlamaConfig

    from qharness.deploy.memory import check_deploy_memory, deploy_memory_bytes

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    kv, weights = deploy_memory_bytes(config, 1000)
    assert kv == 2 * 2 * 2 * 16 * 1000 * 4  # keys and values x layers x KV heads x head dim x positions x fp32
    assert weights == 4 * (100 * 64 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128))
    check_deploy_memory(config, 1000, available=kv + weights)  # fits exactly
    with pytest.raises(UserError, match=r"deploy.max_seq_len=100000000 needs a KV cache of about 51.2 GB.*fix: set"):
        check_deploy_memory(config, 100_000_000, available=16 * 10**9)


def test_a_kv_cache_larger_than_the_memory_is_one_line_before_any_work(tmp_path, tiny_llama):
    import shutil

    from conftest import run_cli

    from qharness.deploy.architectures import load_config
    from qharness.deploy.memory import available_memory_bytes, deploy_memory_bytes

    model = shutil.copytree(tiny_llama, tmp_path / "model")
    per_position = deploy_memory_bytes(load_config(str(model)), 1)[0]
    positions = 2 * available_memory_bytes() // per_position  # twice what the machine has
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 4 * positions  # the model allows it: the machine does not
    (model / "config.json").write_text(json.dumps(config))
    path = tmp_path / "run.yaml"
    from conftest import write_config

    write_config(path, model, "embedded", tmp_path / "run", model={"mode": "ptq"})
    r = run_cli("calibrate", "--config", path, "--deploy.max_seq_len", str(positions), timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert last.startswith(f"error: deploy.max_seq_len={positions} needs a KV cache of about") and "fix: set" in last
    assert not (tmp_path / "run" / "summary.json").exists()


# ---------------------------------------------------------------- property-based: names, paths, summary types

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_fuzz import more  # noqa: E402

# names an attacker tries: separators, "..", absolute paths, control and format characters, any unicode
name_parts = st.one_of(
    st.sampled_from(
        ["/", "\\", "..", ".", "\n", "\r", "\t", "\x00", "\x1b[31m", "\u2028", "\u202e", "~", "-", "=", "|"]
    ),
    st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=6),
)
names = st.lists(name_parts, min_size=0, max_size=4).map("".join) | st.text(max_size=300)


@pytest.mark.fast
@more(80)
@given(name=names)
def test_a_name_is_refused_in_one_line_or_stays_a_plain_entry_of_its_directory(name, tmp_path_factory):
    from qharness.io.names import check_name

    root = tmp_path_factory.getbasetemp() / "names"
    root.mkdir(exist_ok=True)
    try:
        check_name(name, "field", "example")
    except UserError as e:
        assert "\n" not in str(e) and "\r" not in str(e) and str(e).startswith("field ")
        return
    path = root / name
    assert path.resolve().parent == root.resolve() and path.name == name  # one entry, directly inside root
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o600)  # and the file system takes it
    os.close(fd)
    path.unlink()


@pytest.mark.fast
@more(40)
@given(name=names, mode=st.sampled_from(["ptq", "qat"]))
def test_a_sweep_run_name_is_refused_or_its_run_dir_is_inside_the_sweep(name, mode, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweepname")
    path = sweep_file(tmp, [{"recipe": "xnnpack_int8_dynamic", "modes": [mode], "name": name}])
    try:
        runs = plan(load_sweep(path))
    except UserError as e:
        assert "\n" not in str(e)
        return
    for run in runs:
        assert run.run_dir.resolve().parent == (tmp / "sweep").resolve()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6,
)
SUMMARY_FIELDS = [
    "model",
    "recipe",
    "backend",
    "metrics",
    "metrics.pte",
    "metrics.pte.ppl",
    "metrics.fp.ppl",
    "parity",
    "parity.passed",
    "pte",
    "pte.size_bytes",
    "bench",
    "bench.pte",
    "bench.pte.decode_tok_s",
    "bench_joint",
    "eval",
    "eval.tasks",
    "eval.tasks.toy",
    "eval.tasks.toy.pte",
    "evaluations",
    "val_blocks",
]


@pytest.mark.fast
@more(30)
@given(field=st.sampled_from(SUMMARY_FIELDS), value=json_values, text=names)
def test_a_summary_field_of_any_type_skips_that_run_or_reports_it_never_the_report(
    field, value, text, tmp_path_factory
):
    from unittest import mock

    from qharness.reporting.report import write_report

    tmp = tmp_path_factory.mktemp("summary")
    root = report_runs(tmp, **{field: value, "backend" if field != "backend" else "model": text})
    # the PNGs (a second each) are left out here; the wrong-type tests above draw them from the same checked rows
    with mock.patch("qharness.reporting.report.plot_pareto", return_value=b"png"):
        result = write_report(root, wandb=False)
    runs = {r["run"] for r in result["rows"]}
    skipped = [line for line in result["text"].splitlines() if line.startswith("Skipped")]
    assert runs == {"fp", "int8-ptq", "evil"} or (runs == {"fp", "int8-ptq"} and len(skipped) == 1)
    cells = [c for row in csv.reader(open(root / "report.csv")) for c in row]
    assert not any(c.startswith(("=", "+", "-", "@", "\t", "\r")) for c in cells if c and not _number_text(c))
    table = [line for line in (root / "report.md").read_text().splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(runs) and "<script" not in (root / "report.md").read_text()


def _number_text(cell: str) -> bool:
    try:
        float(cell)
        return True
    except ValueError:
        return False


def test_a_training_step_larger_than_the_memory_is_one_line_before_any_work(tmp_path, tiny_llama):
    """data.batch_size x data.seq_len within the model's context but past what one step holds here (attention scores):
    refused before the model loads, not an allocation failure or a swapping machine in the first step."""
    import shutil

    from conftest import run_cli, write_config
    from transformers import LlamaConfig

    from qharness.deploy.memory import available_memory_bytes, check_training_memory, training_memory_floor

    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    floor = training_memory_floor(config, 2, 10)
    assert floor >= 2 * 2 * 10 * 100 * 4 + 2 * 2 * 4 * 10 * 10 * 4  # logits and their gradient, one layer's scores
    check_training_memory(config, 2, 10, available=floor)  # fits exactly
    with pytest.raises(UserError, match=r"data.batch_size=2 x data.seq_len=10 needs at least .* fix: lower"):
        check_training_memory(config, 2, 10, available=floor - 1)

    model = shutil.copytree(tiny_llama, tmp_path / "model")
    seq_len, batch = 1 << 16, 2  # one layer's attention scores alone: 2 x 2 x 4 heads x 65536^2 floats (275 GB)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2 * seq_len  # the model allows it: the machine does not
    (model / "config.json").write_text(json.dumps(config))
    assert training_memory_floor(LlamaConfig(**config), batch, seq_len) > available_memory_bytes()
    path = write_config(
        tmp_path / "run.yaml",
        model,
        "embedded",
        tmp_path / "run",
        data={"seq_len": seq_len, "batch_size": batch},
        deploy={"enabled": False, "max_seq_len": seq_len + 1},
    )
    r = run_cli("fit", "--config", path, timeout=300)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert last.startswith(f"error: data.batch_size={batch} x data.seq_len={seq_len} needs at least"), last
    assert not (tmp_path / "run" / "checkpoints").exists()
