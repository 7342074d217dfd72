"""A ``config.json`` whose sizes cannot be (zero attention heads divided by zero inside transformers): one line naming
the field, before any work (``sources.models.check_config_sizes``, run by the pre-check and at model resolution)."""

import json
import shutil

import pytest
from conftest import run_cli, write_config

from qharness.errors import UserError
from qharness.sources.models import check_local_checkpoint


def _with(tmp_path, tiny_llama, **fields):
    d = tmp_path / "model"
    shutil.copytree(tiny_llama, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **fields}))
    return d


def test_zero_attention_heads_is_one_line_naming_the_field(tmp_path, tiny_llama, corpus):
    model = _with(tmp_path, tiny_llama, num_attention_heads=0)
    r = run_cli("fit", write_config(tmp_path / "c.yaml", model, corpus, tmp_path / "run"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "ZeroDivisionError" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: model.checkpoint {model / 'config.json'}: num_attention_heads must be a whole number >= 1 (got 0). "
        "fix: set num_attention_heads in config.json to the model's real size (as save_pretrained wrote it)"
    )


@pytest.mark.fast
@pytest.mark.parametrize(
    "fields, named",
    [
        ({"num_key_value_heads": -2}, "num_key_value_heads"),
        ({"hidden_size": 64.5}, "hidden_size"),
        ({"hidden_size": "sixty-four"}, "hidden_size"),  # was a TypeError traceback from transformers' config
        ({"text_config": {"num_hidden_layers": 0}}, "text_config.num_hidden_layers"),
    ],
)
def test_other_impossible_sizes_are_refused(tmp_path, tiny_llama, fields, named):
    with pytest.raises(UserError, match=rf": {named} must be a whole number >= 1"):
        check_local_checkpoint(str(_with(tmp_path, tiny_llama, **fields)))


@pytest.mark.fast
def test_unset_sizes_and_per_layer_lists_pass(tmp_path, tiny_llama):
    model = _with(tmp_path, tiny_llama, head_dim=None, intermediate_size=[128, 128])
    assert check_local_checkpoint(str(model)) == str(model)


@pytest.mark.fast
@pytest.mark.parametrize(
    "fields, named",
    [
        ({"rope_theta": 0}, "rope_theta"),
        ({"rope_theta": -10000.0}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_theta": float("nan")}}},
            "rope_parameters.sliding_attention.rope_theta",
        ),
        ({"text_config": {"rope_local_base_freq": "ten thousand"}}, "text_config.rope_local_base_freq"),
    ],
)
def test_an_impossible_rotary_base_names_the_config_field_not_the_weights(tmp_path, tiny_llama, fields, named):
    """``rope_theta: 0`` was caught only once loaded, as NaN/inf weights, with a fix about the weights."""
    with pytest.raises(UserError, match=rf": {named} must be a finite number > 0 .*fix: set {named} in config.json"):
        check_local_checkpoint(str(_with(tmp_path, tiny_llama, **fields)))
