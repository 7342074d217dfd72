"""The benchmark's timing method: spread arithmetic, the joint bench (alternating rounds) through the CLI, the thread
setting. No timing is asserted: the tests check what was run, in which order, and the shape of what is written."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import fake_measurement, run_cli

from qharness.runtime.spread import max_over_min, pair_ratios, spread, verdict


def make_tiny_pte(path, max_seq_len: int = 32):
    """A random-init 1-layer Llama (dim 32, vocab 128) lowered with xnnpack_fp32: a real .pte in seconds."""
    import torch

    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.sources.embedded import EmbeddedSpec, new_llama

    torch.manual_seed(0)
    spec = EmbeddedSpec(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    recipe = load_recipe("xnnpack_fp32")
    graph = quantize_for_deploy(new_llama(spec, 128).eval(), recipe, max_seq_len, lambda g: None)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lower_to_pte(graph, recipe, max_seq_len, runner_metadata(max_seq_len, 128, 0, [0], True)))
    return path


@pytest.fixture(scope="module")
def tiny_pte(tmp_path_factory):
    return make_tiny_pte(tmp_path_factory.mktemp("tiny_pte") / "model.pte")


@pytest.mark.fast
def test_spread_is_median_min_max_of_the_process_medians():
    s = spread([5.0, 1.0, 4.0, 2.0, 3.0])
    assert s == {"median": 3.0, "min": 1.0, "max": 5.0, "per_process": [5.0, 1.0, 4.0, 2.0, 3.0]}
    assert max_over_min(s) == 5.0
    assert spread([2.0, 4.0])["median"] == 3.0
    with pytest.raises(ValueError):
        spread([])


@pytest.mark.fast
def test_pte_bench_returns_typed_positive_figures_that_the_summary_keeps(tiny_pte, tmp_path):
    """``qharness.Pte.bench`` (the API's ``qharness bench``): one fresh process, a typed ``Bench`` whose figures are
    positive and consistent, no eager model; ``RunSummary.update`` keeps it and reads it back equal."""
    import math

    import qharness
    from qharness.errors import UserError
    from qharness.run.summary import RunSummary
    from qharness.runtime.bench import format_bench
    from qharness.runtime.bench_record import Bench, MedianRange, ModelBench
    from qharness.runtime.pte import PteModel

    pte = qharness.Pte(PteModel(tiny_pte), tokenizer=None)  # the tiny .pte has no tokenizer/; bench needs none
    r = pte.bench(prompt_len=4, decode_tokens=4, reps=1, threads=1)
    assert isinstance(r, Bench) and isinstance(r.pte, ModelBench) and r.eager is None and r.pte_vs_eager is None
    assert (r.prompt_len, r.decode_tokens, r.reps, r.threads, r.vocab_size) == (4, 4, 1, 1, 128)
    for name in ("load_s", "prefill_tok_s", "decode_tok_s", "decode_tok_per_cpu_s"):
        m = getattr(r.pte, name)
        assert isinstance(m, MedianRange) and 0 < m.min <= m.median <= m.max < math.inf, name
    assert r.pte.size_bytes == tiny_pte.stat().st_size and 0 < r.pte.weight_bytes < r.pte.size_bytes
    assert 0 < r.pte.base_rss_mb <= r.pte.peak_rss_mb and r.pte.bandwidth_fraction > 0 and r.bandwidth_gb_s > 0
    table = format_bench(r)
    assert ".pte (ExecuTorch)" in table and "eager" not in table and "1 threads" in table
    blank = dict(model="m", recipe="xnnpack_fp32", backend="xnnpack", mode="ptq", quantized=False, seq_len=8)
    RunSummary(run_dir=str(tmp_path), eval_blocks=1, **blank).write(tmp_path / "summary.json")
    assert RunSummary.update(tmp_path / "summary.json", bench=r).bench == r
    assert RunSummary.read(tmp_path / "summary.json").bench == r
    with pytest.raises(UserError, match="bench reps must be >= 1"):
        pte.bench(reps=0)


@pytest.mark.fast
def test_pair_ratios_pair_process_k_of_a_with_process_k_of_b():
    r = pair_ratios([2.0, 3.0, 8.0], [1.0, 3.0, 2.0])
    assert r["per_process"] == [2.0, 1.0, 4.0] and (r["median"], r["min"], r["max"]) == (2.0, 1.0, 4.0)
    with pytest.raises(ValueError):
        pair_ratios([1.0], [1.0, 2.0])


@pytest.mark.fast
@pytest.mark.parametrize(
    "values, target, higher, expected",
    [
        ([0.88, 0.93, 0.99], 1.05, False, "MET"),  # whole spread at or below the target
        ([0.95, 1.00, 1.10], 1.05, False, "TIE/UNDECIDED"),  # straddles it
        ([1.10, 1.20, 1.30], 1.05, False, "NOT MET"),
        ([2.1, 2.5, 3.0], 2.0, True, "MET"),
        ([1.9, 2.5, 3.0], 2.0, True, "TIE/UNDECIDED"),
        ([1.2, 1.5, 1.9], 2.0, True, "NOT MET"),
        ([1.05, 1.05], 1.05, False, "MET"),
    ],
)
def test_verdict_needs_the_whole_spread_on_the_right_side(values, target, higher, expected):
    assert verdict(spread(values), target, higher) == expected


def test_bench_cli_times_two_programs_in_alternating_rounds_and_writes_bench_joint(tiny_pte, tmp_path):
    a, b = tmp_path / "a" / "model.pte", tmp_path / "b" / "model.pte"
    for p in (a, b):
        p.parent.mkdir()
        shutil.copy(tiny_pte, p)
    (tmp_path / "a" / "summary.json").write_text(
        json.dumps(
            {
                "run_dir": str(tmp_path / "a"),
                "model": "m",
                "recipe": "xnnpack_fp32",
                "backend": "xnnpack",
                "mode": "ptq",
                "quantized": False,
                "seq_len": 32,
                "eval_blocks": 8,
                "bench": {"reps": 7},
            }
        )
    )
    out = tmp_path / "joint.json"
    r = run_cli(
        "bench",
        "--pte",
        a,
        "--pte",
        b,
        "--processes",
        "2",
        "--reps",
        "1",
        "--prompt_len",
        "8",
        "--decode_tokens",
        "4",
        "--threads",
        "1",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    joint = json.loads(out.read_text())
    assert joint["sequence"] == [str(a), str(b), str(b), str(a)]  # rounds A B, B A: one fresh process each
    assert (joint["processes"], joint["order"], joint["threads"]) == (2, "alternating", 1)
    assert len(joint["load_avg_1m"]) == 2
    for p in joint["programs"].values():
        for key in ("decode_tok_s", "prefill_tok_s", "decode_ms_per_token"):
            s = p[key]
            assert len(s["per_process"]) == 2 and s["min"] <= s["median"] <= s["max"] and 0 < s["min"]
        assert [round(1e3 / x, 9) for x in p["decode_tok_s"]["per_process"]] == [
            round(x, 9) for x in p["decode_ms_per_token"]["per_process"]
        ]
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["bench"] == {"reps": 7} and summary["recipe"] == "xnnpack_fp32"  # merged, not replaced
    assert set(summary["bench_joint"]) == {
        "processes",
        "order",
        "load_avg_1m",
        "threads",
        "decode_tok_s",
        "prefill_tok_s",
        "decode_ms_per_token",
    }
    assert summary["bench_joint"]["decode_tok_s"] == joint["programs"][str(a)]["decode_tok_s"]
    assert not (tmp_path / "b" / "summary.json").exists()
    assert "every other one reversed" in r.stdout and str(b) in r.stdout


@pytest.mark.fast
def test_a_place_in_the_round_weighs_on_every_program_alike(monkeypatch):
    """Two identical programs on a machine where the first process of each round runs 20% slower (what 135M FP32 vs
    export_llm showed: 1.14x with ours first, 0.87x with theirs first). Reversing every other round gives both the
    same process medians, and their ratio straddles 1 (a tie); with one order in every round, A would lose every
    round and the verdict would call B faster."""
    import qharness.runtime.joint as joint

    calls = []

    def fake_measure(**kw):
        first = len(calls) % 2 == 0  # two programs: a round is two consecutive processes
        calls.append(kw["path"])
        return fake_measurement(80.0 if first else 100.0)

    monkeypatch.setattr(joint, "measure_in_fresh_process", fake_measure)
    programs = {n: {"kind": "pte", "path": n, "vocab_size": 8} for n in ("A", "B")}
    out = joint.interleaved(programs, 8, 4, 1, 4, threads=1, log=lambda *_: None)
    assert calls == out["sequence"] == ["A", "B", "B", "A", "A", "B", "B", "A"] and out["order"] == "alternating"
    a, b = (out["programs"][n]["decode_tok_s"] for n in ("A", "B"))
    assert a["median"] == b["median"] == 90.0
    ratio = pair_ratios(a["per_process"], b["per_process"])
    assert (ratio["min"], ratio["max"]) == (0.8, 1.25) and verdict(ratio, 1.0, False) == "TIE/UNDECIDED"
    assert [joint.round_order(["A", "B", "C"], k) for k in range(3)] == [list("ABC"), list("CBA"), list("ABC")]


def test_bench_cli_refuses_bad_counts(tiny_pte):
    r = run_cli("bench", "--pte", tiny_pte, "--processes", "0")
    assert r.returncode == 2 and "--processes must be >= 1" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("bench", "--pte", tiny_pte, "--threads", "0")
    assert r.returncode == 2 and "--threads must be >= 1" in r.stderr


@pytest.mark.parametrize(
    "option, value", [("reps", "0"), ("reps", "-3"), ("prompt_len", "0"), ("decode_tokens", "-1"), ("processes", "0")]
)
def test_bench_refuses_a_count_below_one_before_loading_anything(tmp_path, option, value):
    """``--reps 0`` ran the default 5 reps; every count is checked before the .pte (here: none) is even looked at."""
    r = run_cli("bench", "--pte", tmp_path / "none.pte", f"--{option}", value)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip() == f"error: bench --{option} must be >= 1 (got {value}). fix: pass --{option} " + (
        "5" if option in ("reps", "processes") else "128" if option == "prompt_len" else "64"
    )


def test_the_runtime_sets_executorch_and_torch_threads(tiny_pte, tmp_path, monkeypatch):
    """QHARNESS_THREADS sizes ExecuTorch's threadpool and caps torch's threads in a process that loads a .pte."""
    code = (
        f"import torch; torch.set_num_threads(2); from qharness.runtime.pte import PteModel; PteModel({str(tiny_pte)!r});"
        "from executorch.extension.pybindings import portable_lib as p; print(p._threadpool_get_thread_count(), torch.get_num_threads())"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "QHARNESS_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1", "1"]
    import qharness.runtime.pte as pte
    from qharness.errors import UserError

    monkeypatch.setattr(pte, "_THREADS", None)  # this process's choice not made yet: the variable is read
    monkeypatch.setenv("QHARNESS_THREADS", "two")
    with pytest.raises(UserError, match="QHARNESS_THREADS='two' is not a thread count"):
        pte.runtime_threads()


def test_profile_shows_where_two_programs_spend_their_time_through_the_cli(tiny_pte, tmp_path):
    """``qharness profile``: ETDump events of a real .pte, summed by name, two programs side by side."""
    from qharness.runtime.profile import event_name

    assert event_name("Fully Connected (NC, F32) GEMM #12") == "Fully Connected (NC, F32) GEMM"
    assert event_name("native_call_custom_sdpa.out") == "custom_sdpa.out"
    other = tmp_path / "b" / "model.pte"
    other.parent.mkdir()
    shutil.copy(tiny_pte, other)
    r = run_cli("profile", "--pte", tiny_pte, "--pte", other, "--prompt_len", "8", "--decode_tokens", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.match(r"threads: \d+ \(free cores now\)\n", r.stdout)  # what the times ran on, first
    prefill, decode = r.stdout.split("event (decode step)")
    head = prefill[prefill.index("event (prefill)") :].splitlines()[0]
    assert f"{tiny_pte.parent} calls" in head and f"{other.parent} calls" in head  # same file names: their folders
    for table in (prefill, decode):
        rows = {line.split("  ")[0]: line.split() for line in table.splitlines() if line.strip()}
        assert "Method::execute" in rows and "DELEGATE_CALL" in rows
        assert any(name.endswith("[xnnpack]") for name in rows)  # the delegate's own kernels
        assert float(rows["Method::execute"][-1]) > 0
    bad = run_cli("profile", "--pte", tiny_pte, "--decode_tokens", "0")
    assert bad.returncode == 2 and "profile --decode_tokens must be >= 1 (got 0)" in bad.stderr
    one = run_cli(
        "profile", "--pte", tiny_pte, "--prompt_len", "4", "--decode_tokens", "2", "--reps", "1", "--threads", "1"
    )
    assert one.returncode == 0 and one.stdout.startswith("threads: 1 (--threads)\n"), one.stderr[-2000:]
    bad = run_cli("profile", "--pte", tiny_pte, "--threads", "0")
    assert bad.returncode == 2 and "profile --threads must be >= 1 (got 0)" in bad.stderr


@pytest.mark.fast
def test_one_fast_copy_does_not_set_the_bandwidth_bound(monkeypatch):
    """The bound's bandwidth is the median of fresh copies: one copy at 1.7x the others (as measured here once in 16)
    moves it nowhere; the real measurement is a positive rate."""
    from qharness.runtime import measure

    assert measure.copy_rate(mib=8, reps=2) > 0
    rates = iter([40.0, 74.0, 41.0, 42.0, 39.0, 43.0, 38.0])
    monkeypatch.setattr(measure, "copy_rate", lambda mib: next(rates))
    assert measure.memory_bandwidth() == 41.0


def test_the_bandwidth_bound_counts_the_weights_a_decode_step_reads(tiny_pte, tmp_path):
    """A decoded token reads one row of the embedding table, not the table: the .pte's weight bytes are its size less
    its embedding tables (here FP32, vocab 128 x 32), the eager model's its parameters less an untied input embedding
    (a tied one is also the lm_head, read whole)."""
    import torch

    from qharness.runtime.measure import measure_in_fresh_process
    from qharness.runtime.pte import embedding_bytes
    from qharness.sources.embedded import EmbeddedSpec, new_llama

    assert embedding_bytes(tiny_pte) == 128 * 32 * 4
    args = {"vocab_size": 128, "prompt_len": 4, "decode_tokens": 2, "reps": 1, "threads": 1}
    m = measure_in_fresh_process(kind="pte", path=str(tiny_pte), **args)
    assert (m["size_bytes"], m["weight_bytes"]) == (tiny_pte.stat().st_size, tiny_pte.stat().st_size - 128 * 32 * 4)

    spec = EmbeddedSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    for tied in (True, False):
        model = new_llama(spec, 128)
        if not tied:
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        model.save_pretrained(tmp_path / str(tied))
        params = sum(p.numel() for p in model.parameters())
        m = measure_in_fresh_process(kind="eager", path=str(tmp_path / str(tied)), **args)
        assert m["weight_bytes"] == 4 * (params if tied else params - 128 * 32), tied


def test_embedding_bytes_of_a_4bit_table_are_its_packed_rows_and_scales(tmp_path):
    """8da4w with 4-bit embeddings: the table is looked up by a quantized-embedding kernel outside the delegates; its
    packed 4-bit rows and per-group scales are what embedding_bytes counts."""
    import torch

    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.runtime.pte import embedding_bytes, operators
    from qharness.sources.embedded import EmbeddedSpec, new_llama

    torch.manual_seed(0)
    recipe_path = tmp_path / "emb4.yaml"
    recipe_path.write_text(
        "base: xnnpack_8da4w\ndescription: 8da4w + 4-bit embeddings\nquantizer:\n  embedding_bits: 4\n"
    )
    recipe = load_recipe(str(recipe_path))
    spec = EmbeddedSpec(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    graph = quantize_for_deploy(new_llama(spec, 128).eval(), recipe, 32, lambda g: None)
    pte = tmp_path / "model.pte"
    pte.write_bytes(lower_to_pte(graph, recipe, 32, runner_metadata(32, 128, 0, [0], True)))
    assert any("embedding" in op for op in operators(pte)["operators"])
    assert 128 * 64 // 2 <= embedding_bytes(pte) < 128 * 64  # the packed table (+ its scales), not FP32's 4 bytes


@pytest.mark.parametrize("tied", [True, False])
def test_a_table_that_an_undelegated_lm_head_also_reads_is_not_subtracted(tmp_path, tied):
    """Without a delegate a tied lm_head's matmul reads the embedding's own constant whole: it stays in the bytes a
    decode step reads. Untied, the lookup table alone is subtracted."""
    import torch

    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.runtime.pte import embedding_bytes, operators
    from qharness.sources.embedded import EmbeddedSpec, new_llama

    torch.manual_seed(0)
    (tmp_path / "portable.yaml").write_text("base: xnnpack_fp32\ndescription: no delegate\npartitioners: []\n")
    recipe = load_recipe(str(tmp_path / "portable.yaml"))
    spec = EmbeddedSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    model = new_llama(spec, 128).eval()
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    graph = quantize_for_deploy(model, recipe, 32, lambda g: None)
    pte = tmp_path / "model.pte"
    pte.write_bytes(lower_to_pte(graph, recipe, 32, runner_metadata(32, 128, 0, [0], True)))
    assert operators(pte)["delegates"] == []
    assert embedding_bytes(pte) == (0 if tied else 128 * 32 * 4)


def _one_error_line(r) -> str:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and len(errors) == 1 and " fix: " in errors[0], r.stderr[-2000:]
    return errors[0]


def _foreign_pte(path):
    """A program another tool made: a Linear layer's forward(x: float[1, 4]), no runner methods."""
    import torch

    from qharness.upstream import imports

    ep = torch.export.export(torch.nn.Linear(4, 4).eval(), (torch.randn(1, 4),))
    path.write_bytes(imports.to_edge_transform_and_lower(ep, partitioner=[]).to_executorch().buffer)
    return path


def test_a_program_from_another_tool_is_named_when_it_loads(tmp_path):
    """evaluate/bench/generate --pte of a foreign program: one line naming what it lacks when it loads (was the
    runtime's 'set_inputs() failed 0x12' at the first call)."""
    from qharness.errors import UserError
    from qharness.runtime.pte import PteModel, _check_inputs

    foreign = _foreign_pte(tmp_path / "foreign.pte")
    with pytest.raises(UserError, match=r"foreign.pte lacks the method\(s\) get_max_context_len that qharness runs"):
        PteModel(foreign)
    from qharness.upstream import imports

    program = imports.executorch_runtime().load_program(foreign)  # kept alive while its method is used
    method = program.load_method("forward")
    with pytest.raises(UserError, match=r"its forward takes 1 input\(s\); qharness feeds tokens \[1, n\] int64"):
        _check_inputs(foreign, "forward", method.metadata)
    line = _one_error_line(run_cli("bench", "--pte", foreign))
    assert "lacks the method(s) get_max_context_len" in line


def test_a_malformed_tokenizer_is_one_line(tiny_pte, tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"')
    line = _one_error_line(run_cli("generate", "--pte", tiny_pte, "--prompt", "hi", "--tokenizer", tmp_path / "tok"))
    assert "tokenizer.json is not a tokenizer.json that tokenizers can read" in line


@pytest.mark.parametrize("kind", ["remote code", "pickle"])
def test_bench_refuses_an_eager_model_it_would_have_to_run_or_unpickle(tiny_pte, tmp_path, kind):
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    if kind == "remote code":
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
        (model / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # a valid, empty header
    else:
        (model / "pytorch_model.bin").write_bytes(b"not really a pickle")
    (model / "config.json").write_text(json.dumps(config))
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tiny_pte, run / "model.pte")
    summary = {"run_dir": str(run), "model": str(model), "recipe": "xnnpack_fp32", "backend": "xnnpack"}
    summary |= {"mode": "ptq", "quantized": False, "seq_len": 16, "eval_blocks": 4}
    (run / "summary.json").write_text(json.dumps(summary))
    line = _one_error_line(run_cli("bench", "--pte", run / "model.pte", "--reps", "1"))
    expected = "auto_map: remote code" if kind == "remote code" else "its weights are not safetensors"
    assert f"the model of {run / 'summary.json'}, but " in line and expected in line, line
