"""The embedded chat model (``model.checkpoint: embedded-chat``): accepted by the pre-check (a misspelt built-in name
refused with the known names), built by the real build function (tiny sizes here), its tokenizer carrying the chat
template, fine-tuned without the held-out conversations the runs answer."""

import json

import pytest

from qharness.errors import UserError


@pytest.mark.fast
def test_the_precheck_accepts_embedded_chat_and_refuses_a_misspelt_builtin_with_the_known_names(tmp_path):
    from qharness.api.precheck import precheck

    config = tmp_path / "run.yaml"
    config.write_text("model: {checkpoint: embedded-chat, recipe: xnnpack_8da4w, mode: ptq}\n")
    assert precheck(["fit", "--config", str(config)]).model.checkpoint == "embedded-chat"
    for typo in ("embeded-chat", "embedded_chat", "Embedded-Chat"):
        config.write_text(f"model: {{checkpoint: {typo}, recipe: xnnpack_8da4w, mode: ptq}}\n")
        with pytest.raises(UserError) as e:
            precheck(["fit", "--config", str(config)])
        assert f"model.checkpoint {typo!r} is not a built-in model" in e.value.what
        assert "embedded, embedded-chat" in e.value.fix
    # on its own data, another split would hold out records it was fine-tuned on
    config.write_text("model: {checkpoint: embedded-chat}\ndata: {source: embedded-chat, val_fraction: 0.2}\n")
    with pytest.raises(UserError, match="data.val_fraction=0.2 would hold out records it was trained on"):
        precheck(["fit", "--config", str(config)])
    config.write_text("model: {checkpoint: embedded-chat}\ndata: {source: embedded-chat, val_fraction: 0.05}\n")
    assert precheck(["fit", "--config", str(config)]).data.val_fraction == 0.05  # a part of the held-out tail


def test_embedded_chat_is_built_once_with_the_chat_template_and_never_saw_the_held_out_conversations(
    tmp_path, monkeypatch, tiny_llama
):
    from functools import partial

    from transformers import AutoTokenizer

    import qharness.sources.embedded_chat as ec
    from qharness.data.datamodule import TextDataModule
    from qharness.sources.chat import prompt_and_reference
    from qharness.sources.chat_demo import TEMPLATE, embedded_instructions
    from qharness.sources.models import resolve_checkpoint

    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ec, "embedded_dir", lambda: tiny_llama)  # the tiny base, not the 1000-step embedded default
    monkeypatch.setattr(ec, "ChatTuneSpec", partial(ec.ChatTuneSpec, steps=2, batch_size=2))
    model_dir = resolve_checkpoint("embedded-chat")  # what model.checkpoint: embedded-chat runs
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.chat_template == TEMPLATE
    info = json.loads((ec.Path(model_dir) / "qharness_pretrain.json").read_text())
    assert info["chat_spec"]["steps"] == 2

    monkeypatch.setattr(ec, "tune_embedded_chat", lambda *a: pytest.fail("built twice"))
    assert resolve_checkpoint("embedded-chat") == model_dir  # cached: the second use builds nothing

    # the held-out conversations a run with the demo's data settings answers (data.tokenizer: the linked checkpoint)
    dm = TextDataModule(
        source="embedded-chat", tokenizer=model_dir, format="instruction", chat_template="embedded", seq_len=128
    )
    dm.setup()
    held = dm.conversations(None, 10**6)
    assert len(held) >= 10
    tokens, _, cut = ec.chat_split(tok, ec.ChatTuneSpec())
    assert cut == info["train_tokens"] and len(dm.train_x) == (cut - 1) // 128  # the runs' training split
    assert (dm.train_x.flatten() == tokens[: len(dm.train_x) * 128]).all()
    trained_text = tok.decode(tokens[:cut].tolist())
    for where, messages in held:
        prompt, answer = prompt_and_reference(tok, messages, TEMPLATE, where)
        assert prompt + answer not in trained_text, where
    held_prompts = {m[0]["content"] for _, m in held}
    first = next(r for r in embedded_instructions() if r["prompt"] not in held_prompts)
    assert f"### Question:\n{first['prompt']}\n\n### Answer:\n{first['completion']}" in trained_text
