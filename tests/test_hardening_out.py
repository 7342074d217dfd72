"""Inputs a hostile or careless user gives the commands after training (generate, its stdin, its seed and tokenizer):
each one line (``UserError``, exit 2), before any work."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from qharness.errors import UserError


@pytest.mark.fast
@pytest.mark.parametrize("seed", [2**64, -1, 10**5000], ids=["2**64", "-1", "10**5000"])
def test_a_seed_beyond_64_bits_is_one_line_before_the_pte_loads(tmp_path, seed):
    from qharness.cli.commands import generate

    with pytest.raises(UserError, match=r"--seed must be a whole number from 0 to 2\*\*64 - 1") as e:
        generate(str(tmp_path / "missing.pte"), prompt="hi", seed=seed)  # refused before the missing file is named
    assert len(str(e.value)) < 200


@pytest.mark.fast
@pytest.mark.parametrize("option", ["prompt", "system"])
def test_a_prompt_of_bytes_that_are_not_utf8_is_one_line(tmp_path, option):
    from qharness.cli.commands import generate

    text = b"caf\xe9 \xff".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    args = {"prompt": "hi", "chat": option == "system", option: text}
    with pytest.raises(UserError, match=f"--{option} holds bytes that are not UTF-8 text"):
        generate(str(tmp_path / "missing.pte"), **args)


@pytest.mark.fast
@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_binary_garbage_on_chat_stdin_is_one_line(monkeypatch, errors):
    from qharness.cli import commands

    garbage = b"\x00\xff\xfe\x80garbage\xc3\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(garbage), encoding="utf-8", errors=errors))
    with pytest.raises(UserError, match="stdin.* bytes that are not UTF-8 text"):
        commands._read_turn()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"x" * 2_000_000), encoding="utf-8"))
    with pytest.raises(UserError, match="longer than 1,000,000 characters"):
        commands._read_turn()
    monkeypatch.setattr(sys, "stdin", io.StringIO("caf\u00e9\n"))
    assert commands._read_turn() == "caf\u00e9\n"


class FakePte:
    path = "model.pte"

    def __init__(self, vocab: int):
        self.vocab = vocab

    def metadata(self):
        return {"get_max_context_len": 64, "get_vocab_size": self.vocab, "get_eos_ids": [0]}

    def __call__(self, tokens, start):
        import torch

        return torch.zeros(1, tokens.shape[1], self.vocab)


class FakeTokenizer:
    def __init__(self, size: int):
        self.size = size

    def get_vocab_size(self, with_added_tokens=True):
        return self.size

    def decode(self, ids):
        return "x" * len(ids)


@pytest.mark.fast
def test_another_models_tokenizer_is_refused_against_the_pte_vocabulary():
    from qharness.runtime.generate import generate_ids

    with pytest.raises(
        UserError,
        match=r"the tokenizer \(--tokenizer\) has 50257 tokens, the .pte's vocabulary 384: it is another model's",
    ):
        generate_ids(FakePte(384), FakeTokenizer(50257), [1, 2], max_new_tokens=2, temperature=0)
    with pytest.raises(UserError, match=r"--tokenizer\) encodes the prompt with id 999"):
        generate_ids(FakePte(384), FakeTokenizer(300), [1, 999], max_new_tokens=2, temperature=0)
    with pytest.raises(UserError, match=r"--tokenizer\) has 32000 tokens, the .pte's vocabulary 49152"):
        generate_ids(FakePte(49152), FakeTokenizer(32000), [1, 2], max_new_tokens=2, temperature=0)
    for vocab, size in ((384, 384), (151936, 151665), (262144, 262145)):  # padded embeddings, an added token
        generate_ids(FakePte(vocab), FakeTokenizer(size), [1, 2], max_new_tokens=2, temperature=0)
    out = generate_ids(FakePte(384), FakeTokenizer(384), [1, 2], max_new_tokens=2, temperature=0)
    assert out["new_tokens"] == []  # token 0 is the EOS: it stops at once


def test_the_cli_says_a_non_utf8_prompt_and_a_huge_seed_in_one_line(tmp_path):
    for extra, said in (
        (["--prompt", b"\xff\xfe"], "--prompt holds bytes that are not UTF-8"),
        (["--prompt", "hi", "--seed", str(2**70)], "--seed must be a whole number"),
    ):
        argv = [sys.executable, "-m", "qharness", "generate", str(tmp_path / "none.pte"), *extra]
        r = subprocess.run(argv, capture_output=True, timeout=300)
        err = r.stderr.decode("utf-8", "replace")
        assert r.returncode == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
        assert said in err  # said before the (missing) program is looked for
