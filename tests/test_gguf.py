"""``model.checkpoint`` as a ``.gguf`` file (``qharness/sources/gguf.py``): the header check before torch, the
conversion into a cached float32 directory (logits equal the model written into the GGUF; the cache reused), the
summary's ``gguf`` record, and a ``qharness calibrate`` run on a GGUF. The GGUFs are tiny Llamas the tests write
with gguf-py as llama.cpp's ``convert_hf_to_gguf.py`` would (``conftest.write_gguf``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import llama_cpp_permute, run_cli, tiny_run_config, tiny_spec, write_gguf

from qharness.errors import UserError
from qharness.run.summary import RunSummary
from qharness.sources import gguf as gguf_source_module
from qharness.sources.gguf import GgufSource, gguf_source
from qharness.sources.models import check_local_checkpoint, load_model_and_tokenizer, resolve_checkpoint

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def tiny_llama_and_tokenizer(text: str, tie: bool = True, seed: int = 0):
    """A random-init tiny Llama (``conftest.tiny_spec``: hidden 64, 2 layers, 4 heads, 2 KV heads) and a 300-token
    byte-level BPE trained on ``text``."""
    from qharness.sources.embedded import new_llama
    from qharness.sources.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer([text], 300)
    torch.manual_seed(seed)
    model = new_llama(tiny_spec(), len(tokenizer)).eval()
    if not tie:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.02)
    return model, tokenizer


@pytest.fixture(scope="module")
def text(corpus) -> str:
    return corpus.read_text()[:100_000]


@pytest.fixture(scope="module")
def tiny(text):
    return tiny_llama_and_tokenizer(text)


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "model.checkpoint" in message and ". fix: " in message, message
    return message


@pytest.mark.fast
@pytest.mark.parametrize("tie", [True, False])
def test_a_float32_gguf_converts_to_the_model_written_into_it(tmp_path, text, tie):
    model, tokenizer = tiny_llama_and_tokenizer(text, tie=tie)
    q = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    assert not (llama_cpp_permute(q, 4) == q).all()  # the file's q/k rows are in llama.cpp's order, not HF's
    path = write_gguf(tmp_path / "tiny.F32.gguf", model, tokenizer, chat_template=TEMPLATE)

    model_dir = Path(resolve_checkpoint(str(path)))
    converted, fp_tokenizer = load_model_and_tokenizer(str(model_dir))

    tokens = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(input_ids=tokens).logits, converted(input_ids=tokens).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
    head, table = converted.get_output_embeddings().weight, converted.get_input_embeddings().weight
    assert (head is table) == tie == converted.config.tie_word_embeddings
    assert fp_tokenizer.chat_template == TEMPLATE
    text_ids = tokenizer("def main():\n    return 1", add_special_tokens=False).input_ids
    assert fp_tokenizer("def main():\n    return 1", add_special_tokens=False).input_ids == text_ids
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is tie
    assert json.loads((model_dir / "qharness_gguf.json").read_text())["type"] == "F32"


@pytest.mark.fast
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_quantized_gguf_converts_to_its_dequantized_weights(tmp_path, tiny, qtype):
    import gguf

    model, tokenizer = tiny
    path = write_gguf(tmp_path / f"tiny.{qtype}.gguf", model, tokenizer, qtype=qtype)

    source = gguf_source(str(path))
    converted, _ = load_model_and_tokenizer(resolve_checkpoint(str(path)))

    assert source.type == qtype
    table = model.get_input_embeddings().weight.detach().numpy()
    kind = gguf.GGMLQuantizationType[qtype]
    on_grid = gguf.quants.dequantize(gguf.quants.quantize(table, kind), kind)
    assert torch.equal(converted.get_input_embeddings().weight, torch.from_numpy(on_grid))  # the file's grid
    assert not torch.equal(converted.get_input_embeddings().weight, model.get_input_embeddings().weight)
    tokens = torch.randint(0, len(tokenizer), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(input_ids=tokens).logits, converted(input_ids=tokens).logits
    assert 0 < (got - want).abs().max() < 0.2 * want.abs().max()  # near the float model, not equal to it


@pytest.mark.fast
def test_the_conversion_is_cached_by_the_files_sha256(tmp_path, text, monkeypatch):
    model, tokenizer = tiny_llama_and_tokenizer(text, seed=1)
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer)
    conversions = []
    convert = gguf_source_module.convert
    monkeypatch.setattr(gguf_source_module, "convert", lambda *a: conversions.append(a) or convert(*a))

    first = resolve_checkpoint(str(path))
    again = resolve_checkpoint(str(path))
    assert again == first and len(conversions) == 1
    assert first.endswith(hashlib.sha256(path.read_bytes()).hexdigest()[:16])

    model2, _ = tiny_llama_and_tokenizer(text, seed=2)
    write_gguf(path, model2, tokenizer)  # the same name, other weights
    changed = resolve_checkpoint(str(path))
    assert changed != first and len(conversions) == 2


@pytest.mark.fast
def test_the_summary_records_the_gguf_and_a_plain_summary_stays_as_it_was(tmp_path, tiny):
    model, tokenizer = tiny
    path = write_gguf(tmp_path / "m.gguf", model, tokenizer)
    converted = resolve_checkpoint(str(path))

    source = gguf_source(str(path))
    assert source == GgufSource(str(path.resolve()), hashlib.sha256(path.read_bytes()).hexdigest(), "F32", converted)
    assert gguf_source(str(tmp_path)) is None and gguf_source("embedded") is None

    base = dict(
        run_dir="runs/x", model=str(path), recipe="fp32", backend="xnnpack", mode="ptq", quantized=False, seq_len=16
    )
    summary = RunSummary(**base, eval_blocks=4, gguf=source)
    data = summary.to_dict()
    assert data["gguf"] == {"file": source.file, "sha256": source.sha256, "type": "F32", "converted": converted}
    assert RunSummary.from_dict(json.loads(json.dumps(data))).gguf == source
    assert "gguf" not in RunSummary(**base, eval_blocks=4).to_dict()


@pytest.mark.fast
def test_a_file_that_is_not_a_whole_gguf_is_refused_before_torch_in_one_line(tmp_path, tiny):
    model, tokenizer = tiny
    whole = write_gguf(tmp_path / "whole.gguf", model, tokenizer).read_bytes()
    assert check_local_checkpoint(str(tmp_path / "whole.gguf")) == str(tmp_path / "whole.gguf")
    cases = {
        "not_gguf.gguf": (b"PK\x03\x04 a zip, say" * 10, "is not a GGUF file"),
        "empty.gguf": (b"", "is not a GGUF file"),
        "cut_in_header.gguf": (whole[:200], "is truncated"),
        "cut_in_tensors.gguf": (whole[: len(whole) // 2], "is truncated"),
        "version1.gguf": (whole[:4] + (1).to_bytes(4, "little") + whole[8:], "GGUF version 1"),
        "2**60_entries.gguf": (whole[:16] + (2**60).to_bytes(8, "little") + whole[24:], "is truncated"),
    }
    for name, (data, expected) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError) as e:
            check_local_checkpoint(str(tmp_path / name))
        assert expected in one_line_error(e), name
    with pytest.raises(UserError, match=r"model.checkpoint no_such.gguf does not exist\. fix: give an existing"):
        check_local_checkpoint("no_such.gguf")  # a file name, not a hub id
    (tmp_path / "weights.bin").write_bytes(whole)
    with pytest.raises(UserError, match=r"is a file\. fix: .*\.gguf"):
        check_local_checkpoint(str(tmp_path / "weights.bin"))


@pytest.mark.fast
def test_an_architecture_transformers_does_not_read_is_one_line(tmp_path, tiny):
    model, tokenizer = tiny
    path = write_gguf(tmp_path / "foo.gguf", model, tokenizer, arch="foo")
    with pytest.raises(UserError) as e:
        resolve_checkpoint(str(path))
    assert "architecture foo is not supported" in one_line_error(e)


def test_calibrate_on_a_gguf(tmp_path, tiny, corpus):
    """``qharness calibrate`` with ``model.checkpoint`` a ``.gguf`` file: the run ends well and records the file."""
    model, tokenizer = tiny
    path = write_gguf(tmp_path / "tiny.Q8_0.gguf", model, tokenizer, qtype="Q8_0")
    cfg = tiny_run_config(tmp_path, path, corpus, model={"mode": "ptq", "recipe": "xnnpack_int8_dynamic"})
    r = run_cli("calibrate", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == str(path) and summary["parity"]["passed"]
    assert summary["gguf"]["file"] == str(path.resolve()) and summary["gguf"]["type"] == "Q8_0"
    assert summary["gguf"]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (Path(summary["gguf"]["converted"]) / "qharness_gguf.json").is_file()
