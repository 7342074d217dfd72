"""torchtune model builders as ``model.checkpoint: torchtune:<builder>(...)`` (the ``torchtune`` extra).

Tests that need torchtune skip with a reason when it is not installed; ``pip install -e ".[dev]"`` installs it.
The CLI ``fit`` of a builder (QAT -> .pte -> parity) is marked slow; the conversion it rests on is checked here.
"""

import json

import pytest
import torch
from conftest import run_cli, write_config

from qharness.errors import UserError
from qharness.sources.torchtune import parse_spec
from qharness.upstream import torchtune as torchtune_compat

needs_torchtune = pytest.mark.skipif(
    not torchtune_compat.torchtune_installed(), reason="torchtune is not installed (pip install -e '.[torchtune]')"
)

TINY = "torchtune:llama3_2.llama3_2(vocab_size=384, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=256, intermediate_dim=128{})"


@pytest.mark.fast
def test_spec_syntax():
    assert parse_spec("torchtune:llama3_2.llama3_2_1b") == ("torchtune.models.llama3_2.llama3_2_1b", {})
    assert parse_spec("torchtune:torchtune.models.llama3_2.llama3_2(num_layers=2, norm_eps=1e-6, tokenizer='d')") == (
        "torchtune.models.llama3_2.llama3_2",
        {"num_layers": 2, "norm_eps": 1e-6, "tokenizer": "d"},
    )
    for bad, message in [
        ("torchtune:llama3_2.llama3_2(2)", "by keyword"),
        ("torchtune:llama3_2.llama3_2(n=__import__('os'))", "must be literals"),
        ("torchtune:llama3_2.llama3_2(**{'a': 1})", "not allowed"),
        ("torchtune:torchtune.modules.foo", "under torchtune.models"),
        ("torchtune:llama3_2.", "not a builder call"),
    ]:
        with pytest.raises(UserError, match=message):
            parse_spec(bad)


@pytest.mark.fast
@needs_torchtune
def test_the_nf4_shim_is_still_needed():
    """When this fails, torchao ships ``torchao.dtypes.nf4tensor`` again or torchtune stopped importing it:
    delete qharness/upstream/torchtune.py's alias and import torchtune directly."""
    import importlib.util
    from pathlib import Path

    assert not torchtune_compat.torchao_has_old_nf4_path()
    root = Path(importlib.util.find_spec("torchtune").origin).parent
    importers = [p for p in root.rglob("*.py") if "from torchao.dtypes.nf4tensor import" in p.read_text()]
    assert any(p.name == "common_utils.py" for p in importers)  # imported by torchtune.modules at import time


@pytest.mark.fast
@needs_torchtune
def test_builder_becomes_an_hf_llama_with_the_same_logits(tmp_path, monkeypatch):
    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path))
    from transformers import AutoModelForCausalLM

    from qharness.sources.models import resolve_checkpoint
    from qharness.sources.torchtune import resolve_builder

    spec = TINY.format(", seed=3")
    path = resolve_checkpoint(spec)
    assert resolve_checkpoint(spec) == path  # cached
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert (
        type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings and hf.config.num_key_value_heads == 2
    )
    torch.manual_seed(3)
    tt = resolve_builder(parse_spec(spec)[0])(**{k: v for k, v in parse_spec(spec)[1].items() if k != "seed"}).eval()
    x = torch.randint(0, 384, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, tt(x), atol=1e-4, rtol=1e-4)
    meta = json.loads((__import__("pathlib").Path(path) / "qharness_torchtune.json").read_text())
    assert meta["builder"] == "torchtune.models.llama3_2.llama3_2" and meta["seed"] == 3


@pytest.mark.fast
@needs_torchtune
def test_non_llama_builder_is_refused(tmp_path, monkeypatch):
    from qharness.sources.models import resolve_checkpoint

    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path))
    with pytest.raises(UserError, match="does not map onto HF Llama"):
        resolve_checkpoint(
            "torchtune:qwen2.qwen2(vocab_size=384, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=256, intermediate_dim=128)"
        )
    with pytest.raises(UserError, match="torchtune has no model builder"):
        resolve_checkpoint("torchtune:llama3_2.no_such_builder")


@pytest.mark.fast
@needs_torchtune
@pytest.mark.parametrize(
    "spec",
    [
        "llama3._model_builders._get_prompt_template(prompt_template='os.getcwd')",  # imports and calls its argument
        "llama3.llama3_tokenizer(path='/nonexistent')",  # a tokenizer, not a model
        "qwen2.qwen2_tune_to_hf(state_dict={})",  # a weight converter
        "llama3.base_llama_tp_plan",  # returns a dict
        "code_llama2.qlora_code_llama2_7b",  # a partial, not a listed function
        "llama3_2._component_builders.llama3_2(vocab_size=1)",  # private module
    ],
)
def test_only_model_builders_are_called(tmp_path, monkeypatch, spec):
    """The allow-list is checked before any call: a callable under torchtune.models that does not build a
    TransformerDecoder is refused, never called (the CLI test below: one that would abort the process)."""
    from qharness.sources import torchtune as tt_source

    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path))
    called = []
    monkeypatch.setattr(tt_source, "to_hf_llama", lambda tt: called.append(tt))
    with pytest.raises(UserError, match="not a torchtune model builder"):
        tt_source.torchtune_dir("torchtune:" + spec)
    assert not called and not list(tmp_path.iterdir())


@needs_torchtune
def test_a_callable_that_would_abort_is_refused_through_the_cli(tmp_path, tiny_llama, corpus):
    spec = "torchtune:llama3._model_builders._get_prompt_template(prompt_template='os.abort')"
    cfg = write_config(tmp_path / "t.yaml", spec, corpus, tmp_path / "run", bench={"enabled": False})
    r = run_cli("fit", cfg)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not a torchtune model builder" in errors[0] and "Traceback" not in r.stderr


@needs_torchtune
@pytest.mark.slow
def test_torchtune_builder_fits_through_the_cli_to_a_pte_that_passes_parity(tmp_path, tiny_llama, corpus):
    """The builder spec is ``model.checkpoint`` (with the tiny Llama's tokenizer): QAT, checkpoint, .pte, parity."""
    spec = TINY.format(f", tokenizer='{tiny_llama}'")
    cfg = write_config(tmp_path / "t.yaml", spec, corpus, tmp_path / "run", bench={"enabled": False})
    r = run_cli("fit", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6 and ckpt["hyper_parameters"]["checkpoint"] == spec
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parity"]["passed"] and summary["model"] == spec
