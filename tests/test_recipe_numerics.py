"""Every recipe x mode on the tiny model: fake-quant vs converted vs .pte numerics (the parity gate).

QAT runs train a few steps, then deploy through the same stages as ``qharness fit``. The fast subset
runs by default; the rest are marked slow (``pytest -m slow``)."""

import pytest
import torch

from qharness.config import CalibrationConfig, ExportConfig, ParityConfig
from qharness.data.datamodule import TextDataModule
from qharness.recipes.registry import known_recipes, load_recipe
from qharness.run.from_lightning import held_out, trained
from qharness.run.pipeline import deploy_and_check
from qharness.training.module import QuantLM

# the default suite's subset (the slow tier has every pair): 8da3w is 8da4w's path at another bit width
FAST = {("xnnpack_int4w_dynamic", "qat"), ("xnnpack_8da4w", "qat")}
CASES = [(r, m) for r in known_recipes() for m in load_recipe(r).modes]


def run_recipe(recipe, mode, model_dir, data, run_dir, steps=4):
    dm = TextDataModule(source=str(data), tokenizer=str(model_dir), seq_len=32, batch_size=4)
    dm.setup()
    module = QuantLM(checkpoint=str(model_dir), recipe=recipe, mode=mode, lr=1e-3)
    if mode == "qat":
        module.build(dm.batch_size, dm.seq_len)
        module.to_train()
        opt = torch.optim.AdamW(module.graph.parameters(), lr=1e-3)
        for batch, _ in zip(dm.train_dataloader(), range(steps)):
            loss = module.loss(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
    parity = ParityConfig(eval_blocks=8, prompts=2, prompt_len=16, decode_steps=4)
    # the stages take plain inputs: the trained module and the data as models and tensors
    return deploy_and_check(
        trained(module),
        held_out(dm, parity, CalibrationConfig(blocks=8)),
        run_dir,
        ExportConfig(max_seq_len=64),
        parity,
    )


@pytest.mark.parametrize(
    "recipe,mode",
    [pytest.param(r, m, marks=() if (r, m) in FAST else pytest.mark.slow, id=f"{r}-{m}") for r, m in CASES],
)
def test_recipe_numerics(recipe, mode, tiny_llama, corpus, tmp_path):
    summary = run_recipe(recipe, mode, tiny_llama, corpus, tmp_path)
    assert (tmp_path / "model.pte").is_file()
    m = summary.metrics
    if not load_recipe(recipe).runs_here:
        assert summary.parity.passed is None and "pte" not in m
        return
    assert summary.parity.passed, summary.parity
    assert abs(m["pte"].ppl - m["converted"].ppl) / m["converted"].ppl < 0.02
    if mode == "qat":  # what was trained is what ships: fake-quant vs .pte perplexity within 1%
        assert abs(m["fake_quant"].ppl - m["pte"].ppl) / m["pte"].ppl < 0.01


@pytest.mark.fast
def test_the_fast_subset_names_recipes_and_modes_that_exist():
    """A renamed recipe or a dropped mode would otherwise leave the default suite with no numerics test."""
    assert FAST <= set(CASES), sorted(FAST - set(CASES))


@pytest.mark.slow  # ~40 s; the default suite lowers and runs 4-bit embeddings in tests/test_runner_snippet.py (emb4_run)
def test_8da4w_with_4bit_embeddings_qat(tiny_llama, corpus, tmp_path):
    """Embedding quantization (the 4-bit recipes' default): QAT fake-quantizes the table, the .pte packs it as 4-bit,
    smaller than the same recipe with its tables kept FP32."""
    float_tables = tmp_path / "fp_emb.yaml"
    float_tables.write_text(
        "base: xnnpack_8da4w\ndescription: 8da4w, FP32 embeddings\nquantizer:\n  embedding_bits: null\n"
    )
    summary = run_recipe("xnnpack_8da4w", "qat", tiny_llama, corpus, tmp_path / "emb4")
    plain = run_recipe(str(float_tables), "ptq", tiny_llama, corpus, tmp_path / "plain")
    m = summary.metrics
    assert summary.parity.passed, summary.parity
    assert abs(m["fake_quant"].ppl - m["pte"].ppl) / m["pte"].ppl < 0.01
    assert [t.bits for t in summary.coverage.embeddings.values()] == [4]
    assert summary.pte.size_bytes < 0.8 * plain.pte.size_bytes
