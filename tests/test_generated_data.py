"""``data.source: generated``: the FP model's own samples as training data (LLM-QAT text, or answers to chat-templated
prompts), their count and length, the greedy start of LLM-QAT's text, the cache (same seed, same tokens; a cache hit
runs no model), the datamodule's split and targets, PTQ calibration blocks, bad settings as one line, and ``qharness
fit`` with distillation on them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from qharness.data.datamodule import TextDataModule
from qharness.errors import UserError
from qharness.schema import RunConfig
from qharness.schema.data import DataConfig
from qharness.sources import generated_cache
from qharness.sources.chat import generation_prompt
from qharness.sources.chat_demo import TEMPLATE
from qharness.sources.example_cache import IGNORE
from qharness.sources.generated import GREEDY_TOKENS, PROMPTS, GenerateSpec
from qharness.sources.generated_cache import generated_samples, generated_stream


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of this test's own, and the number of models loaded to sample (a cache hit loads none)."""
    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    loads = {"n": 0}
    load = generated_cache.load_model

    def counted(*args, **kwargs):
        loads["n"] += 1
        return load(*args, **kwargs)

    monkeypatch.setattr(generated_cache, "load_model", counted)
    return loads


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.fast
def test_text_samples_have_the_count_and_length_asked_for_and_a_greedy_start(tiny_llama, cache):
    """LLM-QAT text: as many samples as asked (two batches here), each ``length`` tokens unless the model ended it
    with EOS; a first token from the ordinary vocabulary, then the model's top-1 choices."""
    tok = _tokenizer(tiny_llama)
    spec = GenerateSpec(samples=generated_cache.BATCH + 4, length=17, seed=3)
    s = generated_samples(str(tiny_llama), tok, spec, chat=False)
    assert len(s.tokens) == spec.samples and s.prompt_lengths == [1] * spec.samples and not s.chat
    for sample in s.tokens:
        assert len(sample) == spec.length or (len(sample) < spec.length and sample[-1] == tok.eos_token_id)
        assert sample[0] not in tok.all_special_ids
    assert s.ended == sum(len(t) < spec.length or t[-1] == tok.eos_token_id for t in s.tokens)
    assert len({t[0] for t in s.tokens}) > spec.samples // 2  # the first tokens are drawn apart
    model = generated_cache.load_model(str(tiny_llama), False)
    sample = s.tokens[0]
    with torch.no_grad():
        logits = model(torch.tensor([[tok.bos_token_id, *sample]])).logits[0]
    for k in range(1, min(1 + GREEDY_TOKENS, len(sample))):  # logits[k] predicts sample[k] (BOS read first)
        assert logits[k, sample[k]] >= logits[k].max() - 1e-4, k


@pytest.mark.fast
def test_one_seed_gives_the_same_tokens_and_a_cache_hit_loads_no_model(tiny_llama, cache):
    tok = _tokenizer(tiny_llama)
    spec = GenerateSpec(samples=6, length=12, seed=7)
    first = generated_samples(str(tiny_llama), tok, spec, chat=False)
    assert cache["n"] == 1
    again = generated_samples(str(tiny_llama), tok, spec, chat=False)
    assert cache["n"] == 1 and again == first  # read back from the cache: no model loaded
    files = list((generated_cache.cache_dir() / "generated").glob("*.npz"))
    assert len(files) == 1
    files[0].unlink()
    assert generated_samples(str(tiny_llama), tok, spec, chat=False) == first and cache["n"] == 2  # sampled again
    other = generated_samples(str(tiny_llama), tok, GenerateSpec(samples=6, length=12, seed=8), chat=False)
    assert cache["n"] == 3 and other.tokens != first.tokens


@pytest.mark.fast
def test_chat_samples_start_with_the_templated_prompt_which_is_not_trained(tiny_llama, cache):
    tok = _tokenizer(tiny_llama)
    prompts = [generation_prompt(tok, [{"role": "user", "content": p}], TEMPLATE) for p in PROMPTS]
    spec = GenerateSpec(samples=len(PROMPTS) + 2, length=96, seed=1)
    s = generated_samples(str(tiny_llama), tok, spec, chat=True, template=TEMPLATE)
    assert s.chat and len(s.tokens) == spec.samples
    header = tok("### Question:\n", add_special_tokens=False)["input_ids"]
    used = []
    for sample, n in zip(s.tokens, s.prompt_lengths):
        assert sample[: len(header)] == header and sample[:n] in prompts and len(sample) <= spec.length
        used.append(prompts.index(sample[:n]))
    assert sorted(used[: len(PROMPTS)]) == list(range(len(PROMPTS)))  # every prompt once before any twice
    tokens, targets, counts = generated_stream(str(tiny_llama), tok, spec, chat=True, template=TEMPLATE)
    assert cache["n"] == 1 and counts["samples"] == spec.samples and counts["chat"]
    n = s.prompt_lengths[0]
    assert (targets[:n] == IGNORE).all() and torch.equal(targets[n : len(s.tokens[0])], tokens[n : len(s.tokens[0])])
    assert counts["trained_tokens"] == sum(len(t) - p for t, p in zip(s.tokens, s.prompt_lengths))
    short = GenerateSpec(samples=2, length=8, seed=1)
    with pytest.raises(UserError, match=r"data.source generated: the chat template's prompts take up to \d+ tokens"):
        generated_samples(str(tiny_llama), tok, short, chat=True, template=TEMPLATE)
    dm = TextDataModule(
        source="generated",
        tokenizer=str(tiny_llama),
        chat_template="embedded",
        seq_len=128,
        batch_size=1,
        val_fraction=0.25,
        generated_samples=8,
    )
    dm.setup()
    assert dm.end_of_turn_ids() == [tok.eos_token_id]  # the .pte stops where the answers end
    text = TextDataModule(
        source="generated", tokenizer=str(tiny_llama), chat_template="embedded", format="text", generated_samples=4
    )
    tokens, _ = text.generated()  # data.format: text: LLM-QAT text despite the template
    assert text.sampled_chat is None and tokens[: len(header)].tolist() != header


@pytest.mark.fast
def test_the_datamodule_packs_and_splits_them_and_ptq_calibrates_on_them(tiny_llama, cache):
    from qharness.config import CalibrationConfig
    from qharness.training.calibration import calibration_blocks

    dm = TextDataModule(source="generated", tokenizer=str(tiny_llama), seq_len=16, batch_size=2, generated_samples=24)
    dm.setup()
    tokens, targets, counts = generated_stream(str(tiny_llama), dm.tokenizer, GenerateSpec(24, 17, seed=dm.seed), False)
    assert cache["n"] == 1 and counts["samples"] == 24
    n = len(dm.train_x) + len(dm.val_x)
    assert dm.train_x.shape[1] == 16 and n >= (len(tokens) - 1) // 16 - 1 and len(dm.val_x) >= 2
    assert torch.equal(dm.train_x.flatten(), tokens[: dm.train_x.numel()])
    assert torch.equal(dm.train_y.flatten(), targets[1 : dm.train_x.numel() + 1])
    assert (dm.train_y == IGNORE).any() and (dm.train_y != IGNORE).any()
    assert dm.format is None and dm.end_of_turn_ids() == []
    blocks = calibration_blocks(CalibrationConfig(blocks=3), dm)
    assert torch.equal(blocks, dm.train_x[:3])
    own = calibration_blocks(CalibrationConfig(source="generated", blocks=3), dm)  # a calibration source of its own
    assert own.shape == (3, 16) and cache["n"] == 1


@pytest.mark.fast
def test_bad_settings_are_one_line_naming_the_field(tiny_llama, cache):
    for field, value, message in (
        ("generated_samples", 0, "data.generated_samples must be at least 1 (got 0)"),
        ("generated_samples", "many", "data.generated_samples"),
        ("generated_top_p", 0.0, "data.generated_top_p must lie in (0, 1] (got 0.0)"),
        ("generated_top_p", 1.5, "data.generated_top_p must lie in (0, 1] (got 1.5)"),
        ("generated_top_p", math.nan, "data.generated_top_p must lie in (0, 1]"),
    ):
        with pytest.raises(UserError) as e:
            RunConfig.from_dict({"data": {"source": "generated", field: value}})
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert DataConfig(source="generated", generated_samples=1, generated_top_p=1.0).generated_samples == 1
    with pytest.raises(UserError) as e:
        RunConfig.from_dict({"data": {"source": "generated"}}).validate("fit")  # QAT without model.distill
    assert "data.source generated trains QAT on the FP model's own samples, which needs model.distill" in str(e.value)
    assert "fix: add model: {distill: {hard_loss: false}}" in str(e.value) and "\n" not in str(e.value)
    RunConfig.from_dict({"data": {"source": "generated"}, "model": {"distill": {"hard_loss": False}}}).validate("fit")
    RunConfig.from_dict({"data": {"source": "generated"}, "model": {"mode": "ptq"}}).validate("calibrate")
    dm = TextDataModule(source="generated", tokenizer=str(tiny_llama), format="chat")  # the tokenizer has no template
    with pytest.raises(UserError, match="no chat template to render data.source generated's prompts with"):
        dm.setup()
    assert cache["n"] == 0


def test_fit_with_distillation_on_generated_data(tmp_path, tiny_llama):
    """``qharness fit`` on the tiny Llama's own samples, distilled, deployed: the data line, the steps, the summary;
    without ``model.distill`` the same config is one line before anything loads."""
    from conftest import run_cli, write_config

    run = tmp_path / "run"
    sections = dict(
        data={"seq_len": 16, "batch_size": 2, "generated_samples": 48},
        trainer={"max_steps": 4, "val_check_interval": 2, "log_every_n_steps": 1},
        checkpoint={"every_n_train_steps": 2},
        deploy={"max_seq_len": 32},
        parity={"eval_blocks": 2, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
        calibration={"blocks": 2},
    )
    plain = write_config(tmp_path / "plain.yaml", tiny_llama, "generated", run, **sections)
    refused = run_cli("fit", plain)
    assert refused.returncode == 2 and "needs model.distill" in refused.stderr and "Traceback" not in refused.stderr
    cfg = write_config(
        tmp_path / "gen.yaml", tiny_llama, "generated", run, model={"distill": {"hard_loss": False}}, **sections
    )
    done = run_cli("fit", cfg)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "data: 48 samples of the FP model's own text from a random first token (LLM-QAT)" in done.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity"]["passed"] and (run / "model.pte").is_file()
    assert summary["distill"] == {"kl_weight": 1.0, "temperature": 1.0, "hard_loss": False, "teacher": None}
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
