"""The run summary type: versioned, merged on update, read the same by every reader; atomic writes keep the umask."""

import json
import os
import stat

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


def test_round_trip_and_kind(tmp_path):
    s = _summary()
    s.write(tmp_path / "summary.json")
    back = RunSummary.read(tmp_path / "summary.json")
    assert back == s and back.kind == "ptq" and back.schema_version == SCHEMA_VERSION
    assert _summary(quantized=False, recipe="xnnpack_fp32").kind == "fp"


def test_the_pte_is_found_in_the_run_directory_wherever_the_run_was_started(tmp_path, monkeypatch):
    """summary.json records pte.path as the run was given it (relative to where it started); a reader in another
    directory, or of a moved run, finds the file in the run directory."""
    run = tmp_path / "elsewhere" / "runs" / "x"
    run.mkdir(parents=True)
    (run / "model.pte").write_bytes(b"pte")
    s = _summary(pte={"path": "runs/x/model.pte", "size_bytes": 3})
    monkeypatch.chdir(tmp_path)
    assert not (tmp_path / s.pte["path"]).exists() and s.pte_file(run).read_bytes() == b"pte"
    assert _summary(pte={}).pte_file(run) == run


def test_update_merges_and_appends_evaluations(tmp_path):
    path = tmp_path / "summary.json"
    _summary(eval={"tasks": {"qharness_ppl": {}}}).write(path)
    RunSummary.update(path, bench={"pte": {"decode_tok_s": {"median": 5.0}}})
    RunSummary.update(path, evaluations=[{"tasks": {"qharness_mc": {}}}])
    s = RunSummary.read(path)
    assert s.eval == {"tasks": {"qharness_ppl": {}}}  # the run's own table survives
    assert s.bench["pte"]["decode_tok_s"]["median"] == 5.0 and s.evaluations == [{"tasks": {"qharness_mc": {}}}]
    with pytest.raises(KeyError):
        RunSummary.update(path, nonsense=1)


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


def test_atomic_writes_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_json_atomic(tmp_path / "a.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.json").st_mode) == 0o640
    assert json.loads((tmp_path / "a.json").read_text()) == {"a": 1}
