"""Rotations folded into the weights (a recipe's ``rotation: hadamard``, ``recipes/rotation.py``): the same logits,
rotated weights, a tied head untied; models whose layers do not fold are refused with one clear error."""

import pytest
import torch
from conftest import make_tiny_hf

from qharness.errors import UserError
from qharness.recipes.registry import load_recipe
from qharness.recipes.rotation import random_orthogonal, rotate
from qharness.training.module import QuantLM


@pytest.mark.fast
@pytest.mark.parametrize("n", [64, 96])
def test_the_rotation_is_orthogonal_and_hadamard_for_powers_of_two(n):
    q = random_orthogonal(n, seed=0)
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    if n == 64:  # every entry +-1/sqrt(n): no channel keeps its weight, all are spread evenly
        assert torch.allclose(q.abs(), torch.full_like(q, n**-0.5))


def _random_norms(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if "norm" in type(m).__name__.lower() and getattr(m, "weight", None) is not None:
            m.weight.data = 0.5 + torch.rand(m.weight.shape, generator=g)


@pytest.mark.fast
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_rotated_model_computes_the_same_logits(tmp_path, corpus, model_type):
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf(tmp_path / model_type, model_type, corpus.read_text()[:50_000], layers=2, tie=True)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    _random_norms(model)  # norms that are not all 1: their folding is exercised
    x = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=x).logits
    emb = model.model.embed_tokens.weight.detach().clone()
    rotate(model)
    assert torch.allclose(model(input_ids=x).logits, before, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(model.model.embed_tokens.weight, emb, atol=1e-3)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert all((m.weight == 1).all() for n, m in model.named_modules() if n.endswith("layernorm") or n == "model.norm")


@pytest.mark.fast
@pytest.mark.parametrize("model_type", ["gemma", "gemma2"])
def test_models_whose_layers_do_not_fold_are_refused(tmp_path, corpus, model_type):
    """Gemma's norms scale by 1 + weight (the numeric check catches it); Gemma2 has norms after attention and MLP
    too (the layout check does)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf(tmp_path / model_type, model_type, corpus.read_text()[:50_000], layers=1)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    _random_norms(model)
    with pytest.raises(UserError, match="rotation: .*(do not fold exactly|not a pre-norm decoder)"):
        rotate(model)


@pytest.mark.fast
def test_every_load_of_a_rotating_recipe_is_rotated_alike(tiny_llama):
    """QAT trains the rotated weights; deployment loads the FP model again: the same rotation (seeded), so the
    trained weights load into it name by name."""
    assert load_recipe("xnnpack_8da4w_rot").rotation == "hadamard"
    m = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w_rot", mode="qat")
    (a, _), (b, _) = m.load_fp(), m.load_fp()
    assert all(torch.equal(p, b.get_parameter(n)) for n, p in a.named_parameters())
    plain, _ = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w", mode="qat").load_fp()
    assert not torch.equal(a.model.embed_tokens.weight, plain.model.embed_tokens.weight)


@pytest.mark.fast
def test_a_bad_rotation_fails_when_the_recipe_is_read(tmp_path):
    (tmp_path / "r.yaml").write_text("base: xnnpack_8da4w\nrotation: spin\n")
    with pytest.raises(UserError, match="rotation must be null or one of hadamard"):
        load_recipe(str(tmp_path / "r.yaml"))
