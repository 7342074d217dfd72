"""The run summary type: versioned, merged on update, read the same by every reader; atomic writes keep the umask."""

import json
import os
import stat
from pathlib import Path

import pytest

from qharness.errors import UserError
from qharness.io.atomic import write_json_atomic
from qharness.run.summary import SCHEMA_VERSION, RunSummary


def _summary(**kw):
    base = dict(
        run_dir="runs/x",
        model="embedded",
        recipe="xnnpack_int8_dynamic",
        backend="xnnpack",
        mode="ptq",
        quantized=True,
        seq_len=32,
        eval_blocks=8,
        metrics={"pte": {"ppl": 3.0}},
        pte={"size_bytes": 10},
    )
    return RunSummary(**{**base, **kw})


@pytest.mark.fast
def test_round_trip_and_kind(tmp_path):
    s = _summary()
    s.write(tmp_path / "summary.json")
    back = RunSummary.read(tmp_path / "summary.json")
    assert back == s and back.kind == "ptq" and back.schema_version == SCHEMA_VERSION
    assert _summary(quantized=False, recipe="xnnpack_fp32").kind == "fp"


@pytest.mark.fast
def test_the_pte_is_found_in_the_run_directory_wherever_the_run_was_started(tmp_path, monkeypatch):
    """summary.json records pte.path as the run was given it (relative to where it started); a reader in another
    directory, or of a moved run, finds the file in the run directory."""
    run = tmp_path / "elsewhere" / "runs" / "x"
    run.mkdir(parents=True)
    (run / "model.pte").write_bytes(b"pte")
    s = _summary(pte={"path": "runs/x/model.pte", "size_bytes": 3})
    monkeypatch.chdir(tmp_path)
    assert not (tmp_path / s.pte.path).exists() and s.pte_file(run).read_bytes() == b"pte"
    assert _summary(pte={}).pte_file(run) == run


@pytest.mark.fast
def test_update_merges_and_appends_evaluations(tmp_path):
    path = tmp_path / "summary.json"
    _summary(eval={"tasks": {"qharness_ppl": {}}}).write(path)
    RunSummary.update(path, bench={"pte": {"decode_tok_s": {"median": 5.0, "min": 4.0, "max": 6.0}}})
    RunSummary.update(path, evaluations=[{"tasks": {"qharness_mc": {}}}])
    s = RunSummary.read(path)
    assert s.eval == {"tasks": {"qharness_ppl": {}}}  # the run's own table survives
    assert s.bench.pte.decode_tok_s.median == 5.0 and s.evaluations == [{"tasks": {"qharness_mc": {}}}]
    assert (path.read_text().count('"min"'), s.bench.eager) == (1, None)  # unmeasured fields stay out of the JSON
    with pytest.raises(KeyError):
        RunSummary.update(path, nonsense=1)


@pytest.mark.fast
def test_version_1_summaries_are_read_and_newer_ones_refused(tmp_path):
    old = _summary().to_dict()
    del old["schema_version"], old["quantized"]
    old["recipe"] = "xnnpack_fp32"
    write_json_atomic(tmp_path / "v1.json", old)
    assert RunSummary.read(tmp_path / "v1.json").kind == "fp"  # asked the recipe, not the name
    v3 = {k: v for k, v in _summary().to_dict().items() if k != "coverage"} | {"schema_version": 3}
    write_json_atomic(tmp_path / "v3.json", v3)  # written before coverage was measured
    assert RunSummary.read(tmp_path / "v3.json").coverage is None
    write_json_atomic(tmp_path / "v9.json", {**_summary().to_dict(), "schema_version": SCHEMA_VERSION + 1})
    with pytest.raises(UserError, match="newer than this qharness reads"):
        RunSummary.read(tmp_path / "v9.json")


@pytest.mark.fast
@pytest.mark.parametrize(
    "content, message",
    [
        ("[1, 2]", "not a JSON object"),
        ("{", "cannot be read"),
        ('{"run_dir": "x"}', "lacks field"),
        ('{"zzz": 1}', "unknown field"),
    ],
)
def test_malformed_summaries_are_one_line_errors(tmp_path, content, message):
    (tmp_path / "s.json").write_text(content)
    with pytest.raises(UserError, match=message):
        RunSummary.read(tmp_path / "s.json")


@pytest.mark.fast
def test_atomic_writes_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_json_atomic(tmp_path / "a.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o640
    assert json.loads((tmp_path / "a.json").read_text()) == {"a": 1}


DATA = Path(__file__).parent / "data"


@pytest.mark.fast
def test_a_summary_written_before_the_sections_were_typed_reads_as_typed_sections(tmp_path):
    """tests/data/summary_v4_qat.json: a QAT run's summary.json as the writer before typed sections wrote it (schema 4,
    learned scales, the fake-quant gate, the benchmark); read into the typed sections, printed, and written back as
    the very same JSON."""
    from qharness.deploy.coverage_record import Coverage
    from qharness.run.summary import FakeQuantAgreement, Parity, PteInfo, Score
    from qharness.run.table import format_table
    from qharness.runtime.bench_record import Bench

    path = DATA / "summary_v4_qat.json"
    s = RunSummary.read(path)
    assert isinstance(s.pte, PteInfo) and s.pte.size_bytes == 205824 and s.pte.kv_cache == "fp32"
    assert isinstance(s.parity, Parity) and s.passed is True and s.parity.learned_scales.exact == 15
    assert isinstance(s.parity.fake_quant, FakeQuantAgreement) and s.parity.fake_quant.gated
    assert (
        isinstance(s.metrics["pte"], Score)
        and s.metrics["pte"].vs_fp.ci[0] < 1
        and s.layers.counts == {"8da4w-g32": 15}
    )
    assert s.timings.lower_s > 0 and s.bench.pte.decode_tok_s.median > s.bench.eager.decode_tok_s.median > 0
    assert isinstance(s.bench, Bench) and s.bench.pte_vs_eager.decode_speedup > 1 and s.bench_joint is None
    assert isinstance(s.coverage, Coverage) and s.coverage.fraction == 1.0 and s.coverage.rules[0].rule == "recipe"
    table = format_table(s)
    assert ".pte vs trained fake-quant PASSED" in table and "0.21 MB" in table
    s.write(tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(path.read_text())


@pytest.mark.fast
def test_a_section_field_this_qharness_does_not_know_is_one_line_naming_the_version(tmp_path):
    data = json.loads((DATA / "summary_v4_qat.json").read_text())
    data["parity"]["from_the_future"] = 1
    write_json_atomic(tmp_path / "s.json", data)
    with pytest.raises(UserError, match=r"schema_version 4\): parity has unknown field\(s\) from_the_future"):
        RunSummary.read(tmp_path / "s.json")


@pytest.mark.fast
def test_coverage_bench_and_joint_sections_read_typed_and_write_back_the_same_json(tmp_path):
    """tests/data/summary_v4_ptq_joint.json: written by the writer before coverage/bench/bench_joint were typed (a
    float weight kept by a recipe rule, a .pte-only benchmark, a joint benchmark entry, lm-eval tables): read as
    typed records, shown by the table and the report row, written back as the very same JSON."""
    from qharness.deploy.coverage_record import Coverage, FloatWeight
    from qharness.reporting.rows import noise_of, summary_row
    from qharness.run.table import format_table
    from qharness.runtime.bench_record import Bench, JointEntry, Spread

    path = DATA / "summary_v4_ptq_joint.json"
    s = RunSummary.read(path)
    assert (
        isinstance(s.coverage, Coverage) and s.coverage.quantized == 15 and s.coverage.unused == ["model.unused_proj"]
    )
    assert s.coverage.float["lm_head"] == FloatWeight(
        "layers[0] (match 'lm_head')", "recipe rule", False, "linear", 49152
    )
    assert s.coverage.failures() == {} and [r.quantized for r in s.coverage.rules] == [15, 0]
    assert isinstance(s.bench, Bench) and s.bench.eager is None and s.bench.pte_vs_eager is None
    assert isinstance(s.bench_joint, JointEntry) and isinstance(s.bench_joint.decode_ms_per_token, Spread)
    assert s.eval["tasks"]["qharness_ppl"]["pte"]["word_perplexity,none"] == 12.5  # task-keyed: plain data
    assert "quantized: 88.9% of linear weight bytes (15 of 16 weights; float: lm_head (recipe rule))" in format_table(s)
    row, noise = summary_row(s), noise_of(s)
    assert row["latency_source"] == "joint (3 processes)" and row["quantized_fraction"] == s.coverage.fraction
    assert (row["decode_ms_per_token"], row["decode_ms_per_token_lo"], row["decode_ms_per_token_hi"]) == (
        10.0,
        8.0,
        12.5,
    )
    assert row["peak_rss_mb"] == s.bench.pte.peak_rss_mb and row["decode_speedup_vs_eager"] is None
    assert row["eval/qharness_mc/acc/pte"] == 0.5 and noise["_decode_ms_samples"] == [10.0, 8.0, 12.5]
    s.write(tmp_path / "summary.json")
    assert (tmp_path / "summary.json").read_bytes() == path.read_bytes()


@pytest.mark.fast
@pytest.mark.parametrize("section", ["coverage", "bench", "bench_joint"])
def test_a_benchmark_or_coverage_field_this_qharness_does_not_know_is_one_line(tmp_path, section):
    data = json.loads((DATA / "summary_v4_ptq_joint.json").read_text())
    inner = {"coverage": data["coverage"]["float"]["lm_head"], "bench": data["bench"]["pte"]}
    inner.get(section, data[section])["from_the_future"] = 1
    write_json_atomic(tmp_path / "s.json", data)
    with pytest.raises(UserError, match=r"schema_version 4\): [a-z_.]+ has unknown field\(s\) from_the_future"):
        RunSummary.read(tmp_path / "s.json")
