"""The Python API attacked as a hostile or careless user would call it: wrong argument types, a bf16/fp16 model, frozen
parameters, hooks, a ``torch.compile``d or already-quantized model, ``prepare`` twice, ``export`` of a PTQ model before
``calibrate``, ``load_state_dict`` across recipes, a ``Pte`` whose file was deleted or replaced, calls from several
threads. Each ends as one ``UserError`` line naming the argument and the fix, before any long work, or as the right
result: never a traceback from torch's internals, never a silently wrong result."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qharness
from qharness.errors import UserError

FAST = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SHAPE = dict(batch_size=2, seq_len=16)


@pytest.fixture(scope="module")
def hf_dir(tiny_llama):
    return tiny_llama


@pytest.fixture
def hf(hf_dir):
    """A fresh tiny Llama (float32, random init) and its tokenizer, as a user would load them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(hf_dir)


def one_line(e: pytest.ExceptionInfo, *words: str) -> str:
    """The error's text: one line, a fix, each of ``words`` in it."""
    text = str(e.value)
    assert "\n" not in text and "fix: " in text, text
    for word in words:
        assert word in text, (word, text)
    return text


def fresh_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ.copy()
    )


# --- wrong argument types (property-based over each argument's bad values) ----------------------------------------
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
BAD = {
    "model": ANY,
    "recipe": ANY.filter(lambda v: not (isinstance(v, str) and v in qharness.list_recipes())),
    "mode": ANY.filter(lambda v: v not in ("qat", "ptq")),
    "batch_size": ANY.filter(lambda v: not (type(v) is int and v >= 1)),
    "seq_len": ANY.filter(lambda v: not (type(v) is int and 2 <= v <= 256)),
    "tokenizer": ANY.filter(lambda v: v is not None),
    "check_architecture": ANY.filter(lambda v: not isinstance(v, bool)),
}


@pytest.mark.fast
@pytest.mark.parametrize("name", list(BAD))
def test_prepare_refuses_any_bad_argument_in_one_line(hf, name):
    """Every argument of ``prepare``, given a value of a wrong type or range: one ``UserError`` naming it."""
    model, tok = hf

    @FAST
    @given(value=BAD[name])
    def check(value):
        args = dict(model=model, recipe="xnnpack_int8_dynamic", mode="ptq", tokenizer=tok, **SHAPE)
        args["check_architecture"] = False
        args[name] = value
        with pytest.raises(UserError) as e:
            qharness.prepare(args.pop("model"), args.pop("recipe"), **args)
        one_line(e, name)

    check()


@pytest.mark.fast
def test_export_refuses_bad_arguments_in_one_line(hf, tmp_path):
    model, tok = hf
    text = "def f(x):\n    return x + 1\n" * 200
    good = dict(
        recipe="xnnpack_int8_dynamic", tokenizer=tok, calibration=text, validation=text, seq_len=16, batch_size=2
    )
    cases = [
        (dict(out_dir=None), "out_dir"),
        (dict(out_dir=3), "out_dir"),
        (dict(seq_len="16"), "seq_len"),
        (dict(seq_len=16.0), "seq_len"),
        (dict(batch_size=None), "batch_size"),
        (dict(batch_size=True), "batch_size"),
        (dict(max_seq_len=-1), "max_seq_len"),
        (dict(parity=[1]), "parity"),
        (dict(validation=5), "validation"),
        (dict(calibration={"a": 1}), "calibration"),
        (dict(calibration=torch.full((3, 16), 10**6)), "calibration"),  # token ids outside the vocabulary
        (dict(validation=torch.full((300,), -3)), "validation"),
    ]
    for override, name in cases:
        args = {"out_dir": tmp_path / "out", **good, **override}
        with pytest.raises(UserError) as e:
            qharness.export(model, args.pop("out_dir"), **args)
        one_line(e, name)
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
def test_calibrate_and_forward_refuse_bad_batches(hf):
    model, tok = hf
    ptq = qharness.prepare(model, "xnnpack_int8_dynamic", mode="ptq", check_architecture=False, **SHAPE)
    for batches, word in (
        (5, "batches"),
        (None, "batches"),
        ("text", "batches"),
        ([torch.full((2, 16), 10**6)], "vocab"),
    ):
        with pytest.raises(UserError) as e:
            qharness.calibrate(ptq, batches)
        one_line(e, word)
    for x, word in (
        (torch.zeros(2, 16), "float32"),
        (torch.full((2, 16), len(tok) + 5), "vocab"),
        (torch.full((2, 16), -1), "vocab"),
        ([[0] * 16] * 2, "list"),
    ):
        with pytest.raises(UserError) as e:
            ptq(x)
        one_line(e, word)


@pytest.mark.fast
def test_other_entry_points_refuse_wrong_types():
    for path in (None, 3, b"model.pte", ["a.pte"]):
        with pytest.raises(UserError) as e:
            qharness.Pte.load(path)
        one_line(e, "path")
    with pytest.raises(UserError) as e:
        qharness.Pte.load(ROOT / "README.md", tokenizer=5)
    with pytest.raises(UserError) as e:
        qharness.load_recipe(["xnnpack_8da4w"])
    one_line(e, "recipe")


@pytest.mark.fast
def test_evaluate_takes_one_task_name_as_a_string(hf):
    """``tasks="nope"`` is the task ``nope`` (not the tasks ``n``, ``o``, ``p``, ``e``)."""
    model, tok = hf
    with pytest.raises(UserError) as e:
        qharness.evaluate(model, tok, tasks="nope", texts="abc")
    one_line(e, "'nope'")
    with pytest.raises(UserError) as e:
        qharness.evaluate(model, tok, tasks=[3], texts="abc")
    one_line(e, "tasks")


# --- dtypes x recipes ------------------------------------------------------------------------------------------------
@pytest.mark.fast
@FAST
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float64]),
    recipe=st.sampled_from(["xnnpack_8da4w", "xnnpack_int8_dynamic", "xnnpack_fp32_finetune", "xnnpack_int4w_lsq"]),
    mode=st.sampled_from(["qat", "ptq"]),
    part=st.sampled_from(["all", "one layer", "lm_head"]),
)
def test_non_float32_models_are_refused_for_every_recipe(hf, dtype, recipe, mode, part):
    model, tok = hf
    model = copy.deepcopy(model)
    if part == "all":
        model.to(dtype)
    elif part == "one layer":
        model.model.layers[0].to(dtype)
    else:
        model.lm_head.to(dtype)
    if mode not in qharness.load_recipe(recipe).modes:
        return
    with pytest.raises(UserError) as e:
        qharness.prepare(model, recipe, mode=mode, tokenizer=tok, **SHAPE)
    one_line(e, str(dtype), "float32")
    with pytest.raises(UserError) as e:
        qharness.export(model, "unused", recipe=recipe, tokenizer=tok, calibration="x " * 100, validation="x " * 100)
    one_line(e, str(dtype))


# --- frozen parameters -------------------------------------------------------------------------------------------
@pytest.mark.fast
def test_frozen_parameters_stay_frozen_and_all_frozen_qat_is_refused(hf):
    model, tok = hf
    model.model.embed_tokens.weight.requires_grad_(False)
    frozen = model.model.embed_tokens.weight.detach().clone()
    qm = qharness.prepare(copy.deepcopy(model), "xnnpack_8da4w", tokenizer=tok, check_architecture=False, **SHAPE)
    opt = torch.optim.SGD([p for p in qm.parameters() if p.requires_grad], lr=1.0)
    x = torch.randint(0, len(tok), (2, 16))
    qm(x, labels=x).loss.backward()
    opt.step()
    embed = next(t for k, t in qm.state_dict().items() if k.endswith("embed_tokens.weight"))
    assert torch.equal(embed, frozen)  # the user's frozen table did not train

    model.requires_grad_(False)
    with pytest.raises(UserError) as e:
        qharness.prepare(model, "xnnpack_8da4w", tokenizer=tok, **SHAPE)
    one_line(e, "requires_grad", "mode='ptq'")
    qm = qharness.prepare(model, "xnnpack_8da4w", mode="ptq", tokenizer=tok, check_architecture=False, **SHAPE)
    assert qm.mode == "ptq"  # PTQ trains nothing: frozen is fine


# --- hooks -------------------------------------------------------------------------------------------------------
@pytest.mark.fast
@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward", "on model"])
def test_hooks_are_refused(hf, kind):
    """A hook would be traced into the graph once (its side effects never run again) or dropped: refused, naming it."""
    model, tok = hf
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # transformers adds none
    mlp = model.model.layers[0].mlp
    if kind == "forward":
        mlp.register_forward_hook(lambda m, i, o: o * 0)
    elif kind == "forward_pre":
        mlp.register_forward_pre_hook(lambda m, a: None)
    elif kind == "full_backward":
        mlp.register_full_backward_hook(lambda m, gi, go: None)
    else:
        model.register_forward_hook(lambda m, i, o: o)
    where = "model" if kind == "on model" else "model.layers.0.mlp"
    with pytest.raises(UserError) as e:
        qharness.prepare(model, "xnnpack_int8_dynamic", tokenizer=tok, **SHAPE)
    one_line(e, "hook", where)
    with pytest.raises(UserError) as e:
        qharness.export(model, "unused", recipe="xnnpack_int8_dynamic", tokenizer=tok, calibration="x", validation="x")
    one_line(e, "hook")


# --- torch.compile, already quantized, prepare twice -----------------------------------------------------------------
@pytest.mark.fast
def test_a_compiled_model_is_prepared_as_its_module(hf):
    model, tok = hf
    reference = qharness.prepare(
        copy.deepcopy(model), "xnnpack_8da4w", tokenizer=tok, check_architecture=False, **SHAPE
    )
    qm = qharness.prepare(torch.compile(model), "xnnpack_8da4w", tokenizer=tok, check_architecture=False, **SHAPE)
    assert type(qm.fp_model).__name__ == "LlamaForCausalLM"
    x = torch.randint(0, len(tok), (2, 16))
    qm.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(qm(x).logits, reference(x).logits, rtol=0, atol=0)


@pytest.mark.fast
def test_already_quantized_models_are_refused(hf):
    model, tok = hf
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, Int8WeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import QATConfig

    qm = qharness.prepare(
        copy.deepcopy(model), "xnnpack_int8_dynamic", tokenizer=tok, check_architecture=False, **SHAPE
    )
    with pytest.raises(UserError) as e:
        qharness.prepare(qm, "xnnpack_int8_dynamic", tokenizer=tok, **SHAPE)
    one_line(e, "QuantizedModel", "already")
    with pytest.raises(UserError) as e:
        qharness.export(qm.graph, "unused", recipe="xnnpack_int8_dynamic", tokenizer=tok)
    one_line(e, "not a transformers causal LM")

    weight_only = copy.deepcopy(model)
    quantize_(weight_only, Int8WeightOnlyConfig())
    fake_quant = copy.deepcopy(model)
    quantize_(
        fake_quant,
        QATConfig(Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))),
    )
    for quantized, what in ((weight_only, "Int8Tensor"), (fake_quant, "FakeQuantizedLinear")):
        for mode in ("qat", "ptq"):
            with pytest.raises(UserError) as e:
                qharness.prepare(quantized, "xnnpack_int8_dynamic", mode=mode, tokenizer=tok, **SHAPE)
            one_line(e, what, "quantized")


@pytest.mark.fast
@pytest.mark.parametrize("recipe", ["xnnpack_int8_dynamic", "xnnpack_8da4w", "xnnpack_8da4w_rot"])
def test_prepare_twice_on_one_model(hf, recipe):
    """QAT changes the model in place (it becomes the graph's weights): a second prepare of it is refused, naming the
    first; PTQ leaves it an FP model, so it can be prepared (and exported) again."""
    model, tok = hf
    first = qharness.prepare(model, recipe, tokenizer=tok, check_architecture=False, **SHAPE)
    for mode in ("qat", "ptq"):
        with pytest.raises(UserError) as e:
            qharness.prepare(model, recipe, mode=mode, tokenizer=tok, check_architecture=False, **SHAPE)
        one_line(e, "already prepared", recipe)
    assert first.recipe.name == recipe

    again = copy.deepcopy(first.fp_model)  # the FP copy the first prepare kept: any number of PTQ preparations
    x = torch.randint(0, len(tok), (2, 16))
    a = qharness.prepare(again, "xnnpack_int8_dynamic", mode="ptq", tokenizer=tok, check_architecture=False, **SHAPE)
    b = qharness.prepare(again, "xnnpack_8da4w", mode="ptq", tokenizer=tok, check_architecture=False, **SHAPE)
    with torch.no_grad():
        torch.testing.assert_close(a(x).logits, b(x).logits, rtol=0, atol=0)


@pytest.mark.fast
def test_export_of_a_ptq_model_before_calibrate(hf, tmp_path):
    model, tok = hf
    ptq = qharness.prepare(model, "xnnpack_int8_dynamic", mode="ptq", tokenizer=tok, check_architecture=False, **SHAPE)
    with pytest.raises(UserError) as e:
        qharness.export(ptq, tmp_path / "out", validation="def f(x):\n    return x\n" * 100)
    one_line(e, "calibrat")
    assert not (tmp_path / "out").exists()


# --- load_state_dict across recipes --------------------------------------------------------------------------------
@pytest.mark.fast
def test_load_state_dict_across_recipes_is_refused(hf, tmp_path):
    """8da4w and 8da3w graphs have the same keys and shapes: the state of one loaded silently into the other."""
    model, tok = hf
    prepared = {
        r: qharness.prepare(copy.deepcopy(model), r, tokenizer=tok, check_architecture=False, **SHAPE)
        for r in ("xnnpack_8da4w", "xnnpack_8da3w", "xnnpack_int8_dynamic")
    }
    for source, target in (("xnnpack_8da4w", "xnnpack_8da3w"), ("xnnpack_8da3w", "xnnpack_8da4w")):
        with pytest.raises(UserError) as e:
            prepared[target].load_state_dict(prepared[source].state_dict())
        one_line(e, source, target)
    with pytest.raises(UserError) as e:
        prepared["xnnpack_int8_dynamic"].load_state_dict(prepared["xnnpack_8da4w"].state_dict())
    one_line(e, "xnnpack_8da4w", "xnnpack_int8_dynamic")
    # a state of the same recipe, saved and loaded back (also one without the recipe record: older files)
    torch.save(prepared["xnnpack_8da4w"].state_dict(), tmp_path / "s.pt")
    other = qharness.prepare(copy.deepcopy(model), "xnnpack_8da4w", tokenizer=tok, check_architecture=False, **SHAPE)
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    older = {k: v for k, v in prepared["xnnpack_8da4w"].state_dict().items() if "qharness_recipe" not in k}
    other.load_state_dict(older)


# --- threads -------------------------------------------------------------------------------------------------------
@pytest.mark.fast
def test_prepare_in_several_threads(hf):
    model, tok = hf
    recipes = ["xnnpack_8da4w", "xnnpack_int8_dynamic", "xnnpack_8da4w"]
    models = [copy.deepcopy(model) for _ in recipes]
    serial = [
        qharness.prepare(copy.deepcopy(m), r, tokenizer=tok, check_architecture=False, **SHAPE)
        for m, r in zip(models, recipes)
    ]
    out, errors = {}, []

    def work(i):
        try:
            out[i] = qharness.prepare(models[i], recipes[i], tokenizer=tok, check_architecture=False, **SHAPE)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(recipes))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    x = torch.randint(0, len(tok), (2, 16))
    for i, want in enumerate(serial):
        out[i].eval(), want.eval()
        with torch.no_grad():
            torch.testing.assert_close(out[i](x).logits, want(x).logits, rtol=0, atol=0)


# --- a Pte ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pte_dir(tmp_path_factory, hf_dir):
    """A tiny XNNPACK FP32 ``.pte`` (the fastest export) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qharness.sources.text import embedded_corpus

    text = "\n\n".join(embedded_corpus(40_000))
    out = tmp_path_factory.mktemp("pte")
    qharness.export(
        AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32),
        out,
        recipe="xnnpack_fp32",
        tokenizer=AutoTokenizer.from_pretrained(hf_dir),
        calibration=text[:20_000],
        validation=text[20_000:],
        seq_len=16,
        batch_size=1,
        parity={"eval_blocks": 2, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
        max_seq_len=32,
    )
    return out


def copy_of(pte_dir, tmp_path):
    shutil.copy(pte_dir / "model.pte", tmp_path / "model.pte")
    shutil.copytree(pte_dir / "tokenizer", tmp_path / "tokenizer")
    return tmp_path / "model.pte"


IDS = [3, 17, 42, 99, 7, 250, 11, 5]


def test_pte_of_a_deleted_or_replaced_file(pte_dir, tmp_path):
    """Deleted after load: it still runs the program it loaded (the right result); what reads the file again
    (``bench``, ``evaluate``) says the file is gone or replaced since ``Pte.load`` instead of using another program."""
    path = copy_of(pte_dir, tmp_path)
    pte = qharness.Pte.load(path)
    want = pte.logits(IDS)
    path.unlink()
    torch.testing.assert_close(pte.logits(IDS), want, rtol=0, atol=0)
    assert pte.generate("def", max_new_tokens=2) is not None
    with pytest.raises(UserError) as e:
        pte.bench(prompt_len=4, decode_tokens=2, reps=1)
    one_line(e, str(path), "deleted", "Pte.load")
    with pytest.raises(UserError) as e:
        qharness.evaluate(pte, tasks=["qharness_ppl"], texts="def f(x):\n    return x\n" * 50, limit=1)
    one_line(e, "deleted")

    shutil.copy(pte_dir / "model.pte", tmp_path / "other.pte")  # another file moved over the name
    os.replace(tmp_path / "other.pte", path)
    torch.testing.assert_close(pte.logits(IDS), want, rtol=0, atol=0)
    with pytest.raises(UserError) as e:
        qharness.evaluate(pte, tasks=["qharness_ppl"], texts="def f(x):\n    return x\n" * 50, limit=1)
    one_line(e, "replaced", "Pte.load")


def test_pte_of_a_file_overwritten_in_place(pte_dir, tmp_path):
    """The runtime reads the program from the file as it runs: bytes overwritten in place crashed the process
    (SIGSEGV). In a fresh process, so a crash fails the test instead of the suite."""
    path = copy_of(pte_dir, tmp_path)
    code = f"""
import qharness, torch
pte = qharness.Pte.load({str(path)!r})
want = pte.logits({IDS})
with open({str(path)!r}, "r+b") as f:
    f.seek(2000)
    f.write(b"\\0" * 4000)
try:
    pte.logits({IDS})
except qharness.UserError as e:
    print("REFUSED", e)
"""
    r = fresh_python(code)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("REFUSED") and "changed" in line and "Pte.load" in line, line


def test_pte_from_several_threads(pte_dir, tmp_path):
    """Two threads running one ``Pte`` at once: each call runs alone on the program (one method, one KV cache),
    so every result is the one a single thread gets."""
    pte = qharness.Pte.load(copy_of(pte_dir, tmp_path))
    want_logits = pte.logits(IDS)
    want_text = pte.generate("def main():", max_new_tokens=6)
    results, errors = [], []

    def work(i):
        try:
            for _ in range(15):
                if i % 2:
                    results.append(("logits", float((pte.logits(IDS) - want_logits).abs().max())))
                else:
                    results.append(("text", pte.generate("def main():", max_new_tokens=6) == want_text))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    assert all(v == 0.0 for k, v in results if k == "logits"), results
    assert all(v for k, v in results if k == "text"), results
