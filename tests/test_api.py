"""The Python API in-process (``qharness.prepare`` / ``calibrate`` / ``export`` / ``Pte``): bad input as one
``UserError`` line before any long work, the ``QuantizedModel`` contract (static shape, HF-style loss, state dict round
trip), the package facade (``import qharness`` torch-free, ``help(qharness)`` lists the API) and a plain PTQ export."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

import qharness
from qharness.errors import UserError


@pytest.fixture
def hf(tiny_llama):
    """A fresh tiny Llama (float32, random init) and its tokenizer, as a user would load them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), AutoTokenizer.from_pretrained(
        tiny_llama
    )


def fresh_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy()
    )


@pytest.mark.fast
def test_import_qharness_loads_no_torch():
    r = fresh_python("import sys, qharness; print(sorted(qharness.__all__)); print('torch' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "False", r.stdout
    for name in ("prepare", "calibrate", "export", "Pte", "evaluate", "list_recipes", "load_recipe", "ship"):
        assert f"'{name}'" in r.stdout


def test_help_lists_the_api():
    r = fresh_python("import qharness; help(qharness)")
    assert r.returncode == 0, r.stderr[-2000:]
    for shown in (
        "prepare(model",
        "calibrate(prepared",
        "export(model",
        "evaluate(model",
        "list_recipes()",
        "load_recipe(name_or_path",
        "class Pte",
        "class QuantizedModel",
        "class ExportResult",
        "qharness.prepare(hf_model",  # the module docstring's example
    ):
        assert shown in r.stdout, f"{shown!r} missing from help(qharness)"


@pytest.mark.fast
def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qharness.nope  # noqa: B018


@pytest.mark.fast
def test_recipes():
    assert "xnnpack_8da4w" in qharness.list_recipes()
    r = qharness.load_recipe("xnnpack_8da4w")
    assert r.backend == "xnnpack" and r.quantized and qharness.load_recipe(r) is r
    with pytest.raises(UserError, match="unknown recipe 'nope'.*fix: use one of: .*xnnpack_8da4w"):
        qharness.load_recipe("nope")


@pytest.mark.fast
def test_prepare_refuses_bad_input_in_one_line(hf):
    model, tok = hf
    cases = [
        (dict(model={"not": "a model"}), "is a dict, not a transformers causal LM"),
        (dict(recipe="nope"), "unknown recipe 'nope'"),
        (dict(mode="fp"), "mode must be one of qat, ptq"),
        (dict(seq_len=1000), "seq_len=1000 exceeds the model's context \\(256\\)"),
        (dict(batch_size=0), "batch_size must be a whole number >= 1"),
        (dict(recipe="xnnpack_8da3w_lsq", mode="ptq"), "does not support mode .ptq.; it supports qat"),
        (dict(recipe="xnnpack_8da4w_zp_lsq"), "starts QAT from the program its PTQ chooses on calibration blocks"),
        (dict(model=copy.deepcopy(model).to(torch.bfloat16)), "torch.bfloat16 floating-point parameters"),
        (dict(tokenizer="tok.json"), "tokenizer is a str"),
    ]
    for override, message in cases:
        args = dict(model=model, recipe="xnnpack_int8_dynamic", mode="qat", batch_size=2, seq_len=16, tokenizer=tok)
        args.update(override)
        with pytest.raises(UserError, match=message) as e:
            qharness.prepare(args.pop("model"), args.pop("recipe"), **args)
        assert "\n" not in str(e.value) and "fix: " in str(e.value)


def test_quantized_model_contract(hf, tmp_path):
    """Static shape as one line; the loss is transformers' (shifted, -100 ignored); train()/eval() switch the graph;
    the state dict round-trips into a model prepared alike (and refuses another one)."""
    model, tok = hf
    reference = type(model)(model.config)
    reference.load_state_dict(model.state_dict())
    qm = qharness.prepare(model, "xnnpack_fp32_finetune", batch_size=2, seq_len=16, tokenizer=tok)
    assert qm.training and qm.mode == "qat" and qm.recipe.name == "xnnpack_fp32_finetune" and qm.tokenizer is tok
    x = torch.randint(0, len(tok), (2, 16))
    labels = x.clone()
    labels[:, :5] = -100
    out = qm(x, labels=labels, attention_mask=torch.ones_like(x))
    with torch.no_grad():
        want = reference(input_ids=x, labels=labels)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-4, atol=1e-4)
    with pytest.raises(UserError, match=r"a batch of shape \(3, 16\): this model was prepared for .*\[2, 16\]"):
        qm(torch.zeros(3, 16, dtype=torch.long))

    opt = torch.optim.AdamW(qm.parameters(), lr=1e-2)
    for _ in range(2):
        qm(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    assert int(qm.trained_batches) == 3  # training forwards with gradients: the first one above and two steps
    assert not any(p is q for p in qm.parameters() for q in qm.fp_model.parameters())  # the FP copy never trains
    torch.save(qm.state_dict(), tmp_path / "qat.pt")

    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_config(model.config)
    qm2 = qharness.prepare(again, "xnnpack_fp32_finetune", batch_size=2, seq_len=16, tokenizer=tok)
    qm2.load_state_dict(torch.load(tmp_path / "qat.pt", weights_only=True))
    qm.eval(), qm2.eval()
    assert not qm.training
    with torch.no_grad():
        torch.testing.assert_close(qm2(x).logits, qm(x).logits, rtol=0, atol=0)
    assert int(qm2.trained_batches) == 3
    other = qharness.prepare(
        AutoModelForCausalLM.from_config(model.config), "xnnpack_fp32_finetune", batch_size=2, seq_len=8, tokenizer=tok
    )
    from qharness.sources.text import embedded_corpus

    r = qharness.evaluate(qm, tasks=["qharness_ppl"], texts="\n\n".join(embedded_corpus(20_000)), limit=2)
    assert r["models"] == ["fake_quant"] and r["tasks"]["qharness_ppl"]["fake_quant"]["byte_perplexity"] > 1
    state = torch.load(tmp_path / "qat.pt", weights_only=True)
    state["graph.extra"] = torch.zeros(1)
    with pytest.raises(UserError, match="does not fit this QuantizedModel"):
        other.load_state_dict(state)


def test_qat_observers_follow_train_and_eval(hf):
    """train()/eval() switch the PT2E graph as the CLI's validation does (``QuantLM.to_train/to_eval``): static
    observers (the weights') record in training and are frozen in evaluation."""
    model, tok = hf
    qm = qharness.prepare(model, "xnnpack_int8_dynamic", batch_size=2, seq_len=16, tokenizer=tok)
    from qharness.upstream import imports

    static = [
        m
        for m in qm.graph.modules()
        if isinstance(m, imports.pt2e().FakeQuantizeBase) and not getattr(m, "is_dynamic", False)
    ]
    assert static
    qm(torch.randint(0, len(tok), (2, 16)))  # observed once: the scales exist
    assert all(int(m.observer_enabled[0]) == 1 for m in static)
    qm.eval()
    assert not qm.training and all(int(m.observer_enabled[0]) == 0 for m in static)
    qm.train()
    assert qm.training and all(int(m.observer_enabled[0]) == 1 for m in static)

    # a graph trained on a GPU is prepared again on CPU for export: the same numerics once the state is loaded
    opt = torch.optim.AdamW(qm.parameters(), lr=1e-2)
    x = torch.randint(0, len(tok), (2, 16))
    qm(x, labels=x).loss.backward()
    opt.step()
    qm.eval()
    with torch.no_grad():
        torch.testing.assert_close(qm.rebuilt_on_cpu()(x), qm(x).logits, rtol=0, atol=0)


def test_export_refuses_bad_input_before_work(hf, tmp_path):
    model, tok = hf
    text = "def f(x):\n    return x + 1\n" * 400
    qm = qharness.prepare(model, "xnnpack_int8_dynamic", batch_size=2, seq_len=16)
    out = tmp_path / "out"
    cases = [
        (dict(validation=text, calibration=text), "needs the model's transformers tokenizer"),
        (dict(tokenizer=tok, calibration=text), "needs validation data"),
        (dict(tokenizer=tok, validation=torch.zeros(4, 16, dtype=torch.long)), r"shape \(4, 16\); they need .* 17"),
        (dict(tokenizer=tok, validation=torch.arange(30)), "holds 1 block.s. of 16 tokens, fewer than one batch of 2"),
        (dict(tokenizer=tok, validation=text), "needs calibration data"),
        (dict(tokenizer=tok, validation=text, calibration=text, recipe="xnnpack_8da4w"), "prepared with"),
        (dict(tokenizer=tok, validation=text, calibration=text, max_seq_len=16), "max_seq_len=16 must exceed"),
        (dict(tokenizer=tok, validation=text, calibration=text, parity={"nope": 1}), "parity: .*nope"),
        (dict(tokenizer=tok, validation=text, calibration=text), "trained 0 steps"),
    ]
    for kwargs, message in cases:
        with pytest.raises(UserError, match=message):
            qharness.export(qm, out, **kwargs)
    assert not out.exists()  # nothing was written: refused before any export
    with pytest.raises(UserError, match="without a recipe"):
        qharness.export(model, out, tokenizer=tok, validation=text, calibration=text)
    with pytest.raises(UserError, match="calibrate takes a model prepared with mode='ptq'"):
        qharness.calibrate(qm, [torch.zeros(2, 16, dtype=torch.long)])
    ptq = qharness.prepare(type(model)(model.config), "xnnpack_int8_dynamic", mode="ptq", batch_size=2, seq_len=16)
    with pytest.raises(UserError, match=r"calibration batch 1 is torch.int64 \(2, 8\)"):
        qharness.calibrate(ptq, [torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)])
    with pytest.raises(UserError, match="got no batches"):
        qharness.calibrate(ptq, [])


def test_plain_ptq_export_and_pte(hf, tmp_path):
    """An FP model + recipe: prepared, calibrated and exported as ``qharness calibrate`` does; the ``.pte`` passed
    the gate, its summary is typed, and the ``Pte`` object generates, scores and gives logits."""
    model, tok = hf
    from qharness.sources.text import embedded_corpus

    text = "\n\n".join(embedded_corpus(120_000))
    result = qharness.export(
        model,
        tmp_path / "ptq",
        recipe="xnnpack_int8_dynamic",
        tokenizer=tok,
        calibration=text[:60_000],
        validation=text[60_000:],
        seq_len=32,
        batch_size=2,
        parity={"eval_blocks": 4, "prompts": 2, "prompt_len": 16, "decode_steps": 4},
        max_seq_len=64,
    )
    assert result.parity.passed is True and result.pte_path == tmp_path / "ptq" / "model.pte"
    assert result.size_bytes == result.pte_path.stat().st_size and result.coverage == 1.0
    assert result.summary.mode == "ptq" and result.summary.recipe == "xnnpack_int8_dynamic"
    assert result.summary.pte.max_seq_len == 64 and result.summary.eval_blocks == 4
    assert (tmp_path / "ptq" / "tokenizer" / "tokenizer.json").is_file()

    pte = qharness.Pte.load(result.pte_path)
    pieces = []
    text_out = pte.generate("def main():", max_new_tokens=8, on_token=pieces.append)
    assert "".join(pieces) == text_out and pte.last["new_tokens"]
    ids = torch.tensor(tok("def main():\n    return 0\n")["input_ids"][:12])
    logits = pte.logits(ids)
    assert logits.shape == (len(ids), len(tok))
    ppl = pte.perplexity(ids[None])
    assert ppl > 1 and abs(ppl - float(torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).exp())) < 1e-3 * ppl
    with pytest.raises(UserError, match="do not fit the .pte's KV cache of 64"):
        pte.perplexity(torch.zeros(1, 100, dtype=torch.long))
    with pytest.raises(UserError, match="does not exist"):
        qharness.Pte.load(tmp_path / "none.pte")

    # lm-eval of the .pte and of the FP model (the plain PTQ path left it FP), as qharness evaluate runs it
    for subject, kind in ((pte, "pte"), (model, "fp")):
        r = qharness.evaluate(subject, tok, tasks=["qharness_ppl"], texts=text[60_000:], limit=2)
        assert r["models"] == [kind] and r["tasks"]["qharness_ppl"][kind]["byte_perplexity"] > 1
    with pytest.raises(UserError, match="qharness_ppl need texts"):
        qharness.evaluate(pte, tasks=["qharness_ppl"])


@pytest.mark.slow
def test_api_and_cli_write_the_same_program(tiny_llama, corpus, tmp_path):
    """``qharness calibrate`` and ``qharness.export`` (plain PTQ) of one model, recipe and data: the same ``.pte``
    bytes (the API builds the CLI's ``Trained``/``HeldOut`` and runs its ``deploy_and_check``)."""
    from conftest import run_cli, write_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qharness.data.datamodule import TextDataModule
    from qharness.run.summary import RunSummary

    parity = {"eval_blocks": 8, "prompts": 2, "prompt_len": 16, "decode_steps": 4}
    cfg = write_config(
        tmp_path / "ptq.yaml",
        tiny_llama,
        corpus,
        tmp_path / "cli",
        model={"mode": "ptq", "recipe": "xnnpack_int8_static"},
    )  # static activation ranges: the program depends on the calibration blocks
    r = run_cli("calibrate", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    dm = TextDataModule(source=str(corpus), tokenizer=str(tiny_llama), seq_len=32, batch_size=4)
    dm.setup("fit")
    result = qharness.export(
        AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
        tmp_path / "api",
        recipe="xnnpack_int8_static",
        tokenizer=AutoTokenizer.from_pretrained(tiny_llama),
        calibration=dm.train_x[:4],  # the config's calibration.blocks: 4, from the training split
        validation=torch.cat([dm.val_x, dm.val_y[:, -1:]], 1),
        seq_len=32,
        batch_size=4,
        max_seq_len=64,
        parity=parity,
    )
    cli = RunSummary.read(tmp_path / "cli" / "summary.json")
    assert result.summary.pte.sha256 == cli.pte.sha256
    assert (tmp_path / "api" / "model.pte").read_bytes() == (tmp_path / "cli" / "model.pte").read_bytes()
    assert result.summary.metrics["pte"].ppl == pytest.approx(cli.metrics["pte"].ppl, rel=1e-6)
