"""Every QAT recipe trains: a backward pass through the prepared model reaches every weight."""

import pytest
import torch
import torch.nn.functional as F


@pytest.mark.parametrize("recipe", ["xnnpack_int8_dynamic", "xnnpack_int4w_dynamic", "xnnpack_8da4w"])
def test_qat_prepared_model_passes_gradients_to_every_weight(recipe, tiny_llama):
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import load_model_and_tokenizer
    from qharness.training.prepare import prepare_for_training

    model, _ = load_model_and_tokenizer(str(tiny_llama))
    prepared = prepare_for_training(model, load_recipe(recipe), 2, 16, is_qat=True)
    x = torch.randint(0, 300, (2, 16))
    F.cross_entropy(prepared(x).flatten(0, 1), x.roll(-1, 1).flatten()).backward()
    dead = [
        n for n, p in prepared.named_parameters() if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0)
    ]
    assert not dead, f"no gradient reaches {dead[:5]} (fake quantization without a straight-through estimator?)"
