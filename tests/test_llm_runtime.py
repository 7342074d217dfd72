"""The .pte as an on-device LLM: runner metadata, ExecuTorch's TextLLMRunner, `qharness generate`, the benchmark."""

import json
import math
import re
import shutil

import pytest
import torch
from conftest import run_cli, runner_safe_head

PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def fit_run(fitted):
    run, _, r = fitted
    assert r.returncode == 0, r.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def varied_run(tmp_path_factory, tiny_llama):
    """A .pte (int8 dynamic) + tokenizer whose greedy text varies, through the lowering functions directly.

    The tiny Llama gets a random untied ``lm_head`` whose greedy text varies and that TextLLMRunner's Python
    ``token_callback`` can decode (``conftest.runner_safe_head``).
    """
    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer(str(tiny_llama))
    runner_safe_head(model, tok)
    recipe = load_recipe("xnnpack_int8_dynamic")
    calibration = torch.randint(0, len(tok), (1, 16))
    graph = quantize_for_deploy(model, recipe, 64, lambda g: g(calibration, torch.tensor([0])))
    run = tmp_path_factory.mktemp("varied")
    (run / "model.pte").write_bytes(
        lower_to_pte(graph, recipe, 64, runner_metadata(64, len(tok), tok.bos_token_id, [tok.eos_token_id]))
    )
    tok.save_pretrained(run / "tokenizer")
    return run


def test_the_pte_carries_the_runner_metadata(fit_run):
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(fit_run / "model.pte")
    values = {name: list(program.load_method(name).execute([])) for name in program.method_names - {"forward"}}
    assert values == {
        "get_max_seq_len": [64],
        "get_max_context_len": [64],
        "get_vocab_size": [384],
        "get_bos_id": [0],
        "get_eos_ids": [0],
        "use_kv_cache": [True],
        "use_sdpa_with_kv_cache": [True],  # the fast path: ExecuTorch's custom SDPA over the KV cache
        "enable_dynamic_shape": [True],
    }
    assert (fit_run / "tokenizer" / "tokenizer.json").is_file()


@pytest.mark.parametrize("which, prompt, new_tokens", [("fit_run", "First Citizen:", 8), ("varied_run", PROMPT, 24)])
def test_text_llm_runner_generates_what_our_greedy_loop_does(request, which, prompt, new_tokens):
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    from qharness.runtime.generate import generate, load_tokenizer
    from qharness.runtime.pte import PteModel

    run = request.getfixturevalue(
        which
    )  # in-process: qharness loaded the kernels; a fresh process: test_runner_snippet.py
    ours = generate(
        PteModel(run / "model.pte"), load_tokenizer(run / "tokenizer"), prompt, max_new_tokens=new_tokens, temperature=0
    )
    runner = TextLLMRunner(str(run / "model.pte"), str(run / "tokenizer"))
    pieces, stats = [], []
    # num_bos=1: the runner applies tokenizer.json's BOS post-processor only when asked to add BOS
    config = GenerationConfig(echo=False, max_new_tokens=new_tokens, temperature=0.0, num_bos=1)
    runner.generate(prompt, config, token_callback=pieces.append, stats_callback=stats.append)
    assert len(ours["new_tokens"]) == new_tokens
    assert "".join(pieces) == ours["text"]
    assert stats[0].num_prompt_tokens == ours["prompt_tokens"]
    if which == "varied_run":
        assert len(set(ours["new_tokens"])) > 5  # not one token repeated


def test_generate_streams_the_text_piece_by_piece(varied_run):
    from qharness.runtime.generate import generate, load_tokenizer
    from qharness.runtime.pte import PteModel

    pieces = []
    out = generate(
        PteModel(varied_run / "model.pte"),
        load_tokenizer(varied_run / "tokenizer"),
        PROMPT,
        max_new_tokens=12,
        temperature=0,
        on_text=pieces.append,
    )
    assert len([p for p in pieces if p]) > 5 and "".join(pieces) == out["text"]
    assert out["prefill_tok_s"] > 0 and out["decode_tok_s"] > 0


def test_generate_cli_is_deterministic_with_a_seed(varied_run):
    args = [
        "generate",
        "--pte",
        varied_run / "model.pte",
        "--prompt",
        PROMPT,
        "--max_new_tokens",
        "20",
        "--temperature",
        "1.0",
        "--top_k",
        "50",
    ]
    first, second, other = run_cli(*args, "--seed", "7"), run_cli(*args, "--seed", "7"), run_cli(*args, "--seed", "8")
    for r in (first, second, other):
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.startswith(PROMPT) and "decode" in r.stderr and "tok/s" in r.stderr
    assert first.stdout == second.stdout
    assert other.stdout != first.stdout  # the seed does drive the sampling


def test_generate_says_when_the_kv_cache_stops_it(varied_run):
    """Asking for more tokens than the cache holds ends at the cache, with a line saying so (not silently)."""
    r = run_cli(
        "generate", "--pte", varied_run / "model.pte", "--prompt", PROMPT, "--max_new_tokens", "100000",
        "--temperature", "1.0", "--seed", "3",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    prompt, generated = map(int, re.search(r"\[(\d+) prompt tokens, (\d+) generated\]", r.stderr).groups())
    assert prompt + generated == 64, "this seed must reach the end of the 64-token cache (pick another seed)"
    assert "stopped before 100000 new tokens: the .pte's KV cache holds 64 tokens" in r.stderr


def test_generate_refuses_a_prompt_longer_than_the_kv_cache(varied_run, tmp_path):
    from qharness.errors import UserError
    from qharness.runtime.generate import load_tokenizer

    r = run_cli("generate", "--pte", varied_run / "model.pte", "--prompt", "x" * 200)
    assert r.returncode == 2 and "KV cache holds 64" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(UserError, match="no tokenizer at"):
        load_tokenizer(tmp_path)


def _positive_finite(section: dict) -> None:
    for key in ("load_s", "prefill_tok_s", "decode_tok_s"):
        assert all(0 < section[key][s] < math.inf for s in ("median", "min", "max")), key
        assert section[key]["min"] <= section[key]["median"] <= section[key]["max"]
    for key in ("peak_rss_mb", "base_rss_mb", "size_bytes", "weight_bytes", "bandwidth_fraction"):
        assert 0 < section[key] < math.inf, key
    assert section["peak_rss_mb"] >= section["base_rss_mb"]


def test_fit_benchmarks_the_pte_and_the_eager_model(fit_run):
    bench = json.loads((fit_run / "summary.json").read_text())["bench"]
    assert (bench["prompt_len"], bench["decode_tokens"], bench["reps"]) == (16, 8, 2)
    assert 0 < bench["bandwidth_gb_s"] < math.inf
    _positive_finite(bench["pte"])
    _positive_finite(bench["eager"])
    assert bench["pte"]["size_bytes"] == (fit_run / "model.pte").stat().st_size
    assert all(0 < v < math.inf for v in bench["pte_vs_eager"].values())


def test_bench_cli_prints_a_table_and_adds_it_to_summary_json(varied_run, tiny_llama, tmp_path):
    shutil.copytree(varied_run, tmp_path / "run")
    from qharness.run.summary import RunSummary

    stand_in = RunSummary(
        run_dir=str(tmp_path / "run"),
        model=str(tiny_llama),
        recipe="xnnpack_int8_dynamic",
        backend="xnnpack",
        mode="ptq",
        quantized=True,
        seq_len=16,
        eval_blocks=1,
    )
    (tmp_path / "run" / "summary.json").write_text(json.dumps(stand_in.to_dict()))
    r = run_cli(
        "bench", "--pte", tmp_path / "run" / "model.pte", "--prompt_len", "8", "--decode_tokens", "4", "--reps", "2"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert ".pte (ExecuTorch)" in r.stdout and "eager FP (PyTorch)" in r.stdout and ".pte vs eager" in r.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["recipe"] == "xnnpack_int8_dynamic"  # kept
    _positive_finite(summary["bench"]["pte"])
    _positive_finite(summary["bench"]["eager"])
    r = run_cli("bench", "--pte", tmp_path / "run" / "model.pte", "--prompt_len", "60", "--decode_tokens", "8")
    assert r.returncode == 2 and "exceeds the .pte's KV cache (64 positions)" in r.stderr
