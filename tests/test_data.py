import json

import pytest
import torch

from qharness.data.datamodule import TextDataModule, pack
from qharness.errors import UserError
from qharness.sources.text import tokenize_stream


@pytest.mark.fast
def test_pack_blocks_and_next_token_targets():
    x, y = pack(torch.arange(23), seq_len=5)
    assert x.shape == y.shape == (4, 5)
    assert torch.equal(x[1], torch.tensor([5, 6, 7, 8, 9]))
    assert torch.equal(y[1], torch.tensor([6, 7, 8, 9, 10]))


@pytest.mark.fast
def test_datamodule_split_is_deterministic_and_disjoint(tiny_llama, corpus):
    a = TextDataModule(source=str(corpus), tokenizer=str(tiny_llama), seq_len=32, batch_size=4)
    b = TextDataModule(source=str(corpus), tokenizer=str(tiny_llama), seq_len=32, batch_size=4)
    a.setup(), b.setup()
    assert torch.equal(a.val_x, b.val_x) and torch.equal(a.train_x, b.train_x)
    stream = tokenize_stream([corpus.read_text()], a.tokenizer)
    n_val = int(len(stream) * 0.1)
    assert torch.equal(a.val_x[0], stream[len(stream) - n_val :][:32])
    first_a = next(iter(a.train_dataloader()))[0]
    first_b = next(iter(b.train_dataloader()))[0]
    assert torch.equal(first_a, first_b)


@pytest.mark.fast
def test_too_small_dataset_is_a_clear_error(tiny_llama, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("to be or not to be " * 10)
    dm = TextDataModule(source=str(small), tokenizer=str(tiny_llama), seq_len=64, batch_size=4)
    with pytest.raises(UserError, match="fewer than one batch"):
        dm.setup()


@pytest.mark.fast
def test_missing_and_empty_files(tiny_llama, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        TextDataModule(source=str(tmp_path / "nope.txt"), tokenizer=str(tiny_llama)).setup()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="is empty"):
        TextDataModule(source=str(tmp_path / "empty.txt"), tokenizer=str(tiny_llama)).setup()


@pytest.mark.fast
def test_jsonl_source_with_text_field(tiny_llama, tmp_path, corpus):
    import json

    lines = corpus.read_text()[:60_000].split("\n\n")
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"body": t}) for t in lines))
    with pytest.raises(UserError, match="text_field 'text' is not a column"):
        TextDataModule(source=str(path), tokenizer=str(tiny_llama), seq_len=16, batch_size=2).setup()
    dm = TextDataModule(source=str(path), text_field="body", tokenizer=str(tiny_llama), seq_len=16, batch_size=2)
    dm.setup()
    assert dm.train_x.shape[1] == 16 and len(dm.val_x) >= 2


@pytest.mark.fast
def test_embedded_architecture_pretrains_on_a_given_source_once(corpus, tmp_path, monkeypatch):
    from qharness.sources.embedded import EmbeddedSpec, embedded_dir

    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    spec = EmbeddedSpec(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        batch_size=4,
        seq_len=32,
        steps=40,
    )
    out = embedded_dir(spec, str(corpus))
    info = json.loads((out / "qharness_pretrain.json").read_text())
    assert out.name.startswith(corpus.stem + "-llama-") and (out / "config.json").is_file()
    assert [s for s, _ in info["val_loss"]] == list(range(4, 41, 4))  # held-out loss every tenth of the steps
    assert info["val_loss"][-1][1] < info["val_loss"][0][1]
    stamp = (out / "config.json").stat().st_mtime_ns
    assert embedded_dir(spec, str(corpus)) == out and (out / "config.json").stat().st_mtime_ns == stamp  # cached
