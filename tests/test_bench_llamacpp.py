"""scripts/bench_llamacpp.py's arithmetic on per-window log-probabilities (docs/benchmarks/real-model.md): the
increase over float, the paired ratio, and the fraction of a start's loss recovered. Building llama.cpp and scoring
the windows are the benchmark."""

import importlib.util

import numpy as np
import pytest
import yaml
from conftest import ROOT, fake_measurement, write_gguf

spec = importlib.util.spec_from_file_location("bench_llamacpp", ROOT / "scripts" / "bench_llamacpp.py")
bl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bl)

WINDOWS, POSITIONS = 40, 127


def logp(loss_per_window) -> np.ndarray:
    """Per-position log-probabilities whose window means are ``-loss_per_window``."""
    return -np.repeat(np.asarray(loss_per_window, dtype=float)[:, None], POSITIONS, axis=1)


@pytest.mark.fast
def test_recovered_is_the_share_of_the_starts_loss_over_float_that_is_gone():
    rng = np.random.default_rng(0)
    float_loss = 3.4 + rng.normal(0, 0.3, WINDOWS)
    ref = logp(float_loss)
    start = logp(float_loss + 0.05)  # PTQ: 0.05 nats a token over float
    r = bl.recovered(logp(float_loss + 0.01), start, ref)
    assert r["recovered"] == pytest.approx(0.8)
    assert r["recovered_ci"] == pytest.approx([0.8, 0.8])  # the same share in every window: no spread
    assert bl.recovered(start, start, ref)["recovered"] == pytest.approx(0.0)
    assert bl.recovered(ref, start, ref)["recovered"] == pytest.approx(1.0)


@pytest.mark.fast
def test_recovered_resamples_the_windows_of_both_programs_together():
    rng = np.random.default_rng(1)
    float_loss = 3.4 + rng.normal(0, 0.3, WINDOWS)
    start_excess = 0.05 + rng.normal(0, 0.02, WINDOWS)
    ref, start = logp(float_loss), logp(float_loss + start_excess)
    # a program that keeps a fifth of the start's loss in every window: paired, the share is 80% in every resample
    assert bl.recovered(logp(float_loss + 0.2 * start_excess), start, ref)["recovered_ci"] == pytest.approx([0.8, 0.8])
    # one whose loss does not follow the start's windows: the interval widens around its point
    r = bl.recovered(logp(float_loss + 0.01 + rng.normal(0, 0.01, WINDOWS)), start, ref)
    lo, hi = r["recovered_ci"]
    assert lo < r["recovered"] < hi and hi - lo > 0.05


@pytest.mark.fast
def test_quality_row_reads_the_increase_and_the_ratio_in_perplexity():
    float_loss = np.full(WINDOWS, 3.0)
    row = bl.quality_row(
        logp(float_loss + 0.01),
        np.zeros((WINDOWS, POSITIONS)),
        logp(float_loss),
        np.zeros((WINDOWS, POSITIONS)),
        logp(float_loss + 0.05),
    )
    assert row["ppl_increase"] == pytest.approx(np.expm1(0.01))
    assert row["vs_ratio"] == pytest.approx(np.exp(-0.04))
    assert row["top1_agreement"] == 1.0


@pytest.mark.parametrize(
    "option, value, refusal",
    [
        ("--versus", "qharness nope", "--versus 'qharness nope' is not a program of this run"),
        ("--recovered-from", "qharness nope", "--recovered-from 'qharness nope' is not a program of this run"),
        ("--recovered-from", "llama.cpp F32", "--recovered-from 'llama.cpp F32' is not a program of this run"),
        ("--chunks", "0", "--chunks 0 scores no window"),
        ("--pair", ("llama.cpp Q8_0", "qharness nope"), "--pair 'qharness nope' is not a program of this run"),
        ("--depth", "0", "--depth 0: qharness decodes after a prompt of at least one token"),
    ],
)
def test_a_bad_option_is_refused_before_llama_cpp_is_built(tiny_llama, tmp_path, monkeypatch, option, value, refusal):
    from qharness.sources.models import load_model_and_tokenizer

    gguf = write_gguf(tmp_path / "tiny.gguf", *load_model_and_tokenizer(str(tiny_llama)))
    built = []
    monkeypatch.setattr(bl, "llama_cpp", lambda *a: built.append(a))
    argv = ["bench_llamacpp.py", "--gguf", str(gguf), "--runs", str(tmp_path / "none"), "--work", str(tmp_path / "w")]
    monkeypatch.setattr("sys.argv", [*argv, option, *((value,) if isinstance(value, str) else value)])
    with pytest.raises(SystemExit, match=refusal):
        bl.main()
    assert built == []


def test_every_window_is_scored_unless_chunks_limits_them(tmp_path, monkeypatch):
    """llama-perplexity scores every window of the text unless ``--chunks`` is passed: the script passes it only when
    the user limits the windows (40 windows of SmolLM2's 140 made a tie of a program 0.6% worse than Q8_0)."""

    class Called(Exception):
        pass

    commands = []

    def fake_run(cmd, **kwargs):
        commands.append([str(c) for c in cmd])
        raise Called

    monkeypatch.setattr(bl, "run", fake_run)
    for chunks in (None, 40):
        with pytest.raises(Called):
            bl.llama_logprobs(tmp_path, tmp_path / "m.gguf", tmp_path / "t.txt", 256, chunks, 2, tmp_path)
    every, first40 = commands
    assert every[0].endswith("llama-perplexity") and "--chunks" not in every
    assert first40[first40.index("--chunks") + 1] == "40"


@pytest.mark.fast
def test_decode_at_depth_is_timed_after_that_many_cached_positions_on_both_sides(tmp_path, monkeypatch):
    """``--depth D``: llama-bench decodes with ``-d D`` and qharness after a D-token prompt, in a process of its own
    (its prefill stays the ``--prompt-len`` one); ``--repack 0`` goes to each figure whose repacking is off."""
    import subprocess

    import qharness.runtime.measure as qmeasure

    commands = []

    def fake_run(cmd, **kwargs):
        commands.append([str(c) for c in cmd])
        return subprocess.CompletedProcess(cmd, 0, stdout='[{"avg_ts": 100.0}]', stderr="")

    monkeypatch.setattr(bl, "run", fake_run)
    repack = {"decode_tok_s": False, "prefill_tok_s": True}
    assert bl.llama_speed(tmp_path, tmp_path / "m.gguf", 64, 32, 2, 256, repack) == {
        "decode_tok_s": 100.0,
        "prefill_tok_s": 100.0,
    }
    decode, prefill = commands
    assert decode[decode.index("-d") + 1] == "256" and decode[decode.index("--repack") + 1] == "0"
    assert "-d" not in prefill and prefill[prefill.index("-p") + 1] == "64" and "--repack" not in prefill
    commands.clear()
    bl.llama_speed(tmp_path, tmp_path / "m.gguf", 64, 32, 2, None, {"decode_tok_s": True, "prefill_tok_s": False})
    decode, prefill = commands
    assert "-d" not in decode and "--repack" not in decode  # llama-bench -n's own figure: an empty cache
    assert prefill[prefill.index("--repack") + 1] == "0"

    prompts = []

    def fake_measure(**kw):
        prompts.append(kw["prompt_len"])
        assert kw["vocab_size"] == 384  # the vocabulary main() read once, not re-read per measurement
        return fake_measurement(kw["prompt_len"])  # decode tok/s = the prompt it decoded after, to tell them apart

    monkeypatch.setattr(qmeasure, "measure_in_fresh_process", fake_measure)
    assert bl.pte_speed(tmp_path / "m.pte", 384, 64, 32, 2, depth=256) == {"decode_tok_s": 256, "prefill_tok_s": 128}
    assert prompts == [64, 256]
    prompts.clear()
    assert bl.pte_speed(tmp_path / "m.pte", 384, 64, 32, 2) == {"decode_tok_s": 64, "prefill_tok_s": 128}
    assert prompts == [64]


@pytest.mark.fast
def test_a_llama_bench_that_dies_is_one_line_naming_its_exit_code(tmp_path, monkeypatch):
    import subprocess

    def dies(cmd, **kwargs):
        raise subprocess.CalledProcessError(132, cmd)

    monkeypatch.setattr(bl, "run", dies)
    with pytest.raises(SystemExit, match=r"^llama-bench -p 0 -n 32 -d 128 failed with exit code 132$"):
        bl.llama_speed(tmp_path, tmp_path / "m.gguf", 64, 32, 2, 128, {"decode_tok_s": True, "prefill_tok_s": True})


@pytest.mark.fast
def test_llama_cpp_repacks_where_a_probe_survives_it_and_the_header_says_where_it_did_not(tmp_path, monkeypatch):
    """Each figure probed once with repacking on: the one that dies (here prefill, as on the AVX-512/AMX machine)
    is timed with ``--repack 0``, the other with repacking, and the table's header names both."""
    import argparse
    import subprocess

    probes = []

    def fake_subprocess_run(cmd, **kwargs):
        probes.append(cmd)
        return subprocess.CompletedProcess(cmd, 132 if cmd[cmd.index("-p") + 1] == "64" else 0)

    monkeypatch.setattr(bl.subprocess, "run", fake_subprocess_run)
    repack = bl.repack_survives(tmp_path, tmp_path / "m.gguf", 64, 256, 2)
    assert repack == {"decode_tok_s": True, "prefill_tok_s": False}
    assert all("--repack" not in cmd and cmd[cmd.index("-r") + 1] == "1" for cmd in probes)
    assert any(cmd[cmd.index("-d") + 1] == "256" for cmd in probes if "-d" in cmd)  # decode probed at its depth

    args = argparse.Namespace(depth=256, prompt_len=64, no_repack=False, repack=repack)
    assert bl.decode_depth(args) == "after 256 cached positions; llama.cpp with weight repacking"
    assert bl.repacking(args, "prefill_tok_s") == "llama.cpp without weight repacking (it died on this CPU)"
    args = argparse.Namespace(
        depth=None, prompt_len=64, no_repack=True, repack={"decode_tok_s": False, "prefill_tok_s": False}
    )
    assert bl.decode_depth(args).endswith("qharness after 64 prompt tokens; llama.cpp without weight repacking")


def test_a_depth_past_a_programs_cache_is_refused_before_llama_cpp_is_built(fitted, tmp_path, monkeypatch):
    from qharness.sources.models import load_model_and_tokenizer

    run, cfg, _ = fitted
    model_dir = yaml.safe_load(cfg.read_text())["model"]["checkpoint"]
    gguf = write_gguf(tmp_path / "tiny.gguf", *load_model_and_tokenizer(model_dir))
    built = []
    monkeypatch.setattr(bl, "llama_cpp", lambda *a: built.append(a))
    argv = ["bench_llamacpp.py", "--gguf", str(gguf), "--runs", str(tmp_path / "none"), "--work", str(tmp_path / "w")]
    monkeypatch.setattr("sys.argv", [*argv, "--pte", f"tiny={run / 'model.pte'}", "--depth", "100000"])
    with pytest.raises(SystemExit, match=r"model.pte: .* = 100032 exceeds the .pte's KV cache .*--depth"):
        bl.main()
    assert built == []
