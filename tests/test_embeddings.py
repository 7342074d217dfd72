"""Quantized embedding tables (``recipes/embedding.py``) for PT2E and torchao recipes: settings checked at recipe load,
QAT through the deploy config's fake quantizer (gradients flow, also through ``torch.export``), the ``.pte`` looking
the table up with the runtime's quantized-embedding kernel, coverage and ``summary.json`` recording it, the tied
table's second copy, and the built-in 4-bit recipes quantizing embeddings by default."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, tiny_run_config

from qharness.errors import UserError


def _recipe(tmp_path, text: str):
    from qharness.recipes.registry import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text(text)
    return load_recipe(str(path))


@pytest.mark.fast
@pytest.mark.parametrize("base", ["xnnpack_int8_dynamic", "xnnpack_8da4w"])
@pytest.mark.parametrize(
    "setting, message",
    [
        ("embedding_bits: 2", r"embedding_bits=2 is not supported. fix: use null \(FP embeddings\), 4 or 8"),
        ("embedding_group_size: 48", "embedding_group_size=48 must be a power of two >= 2. fix: use 32"),
        ("embedding_bits: '4'", "embedding_bits='4' must be int or null"),
    ],
)
def test_embedding_settings_are_checked_at_recipe_load(tmp_path, base, setting, message):
    with pytest.raises(UserError, match=message) as e:
        _recipe(tmp_path, f"base: {base}\nquantizer:\n  {setting}\n")
    assert "\n" not in str(e.value)


@pytest.mark.fast
@pytest.mark.parametrize(
    "setting, message",
    [
        (
            "untied_embedding_bits: 2",
            r"untied_embedding_bits=2 is not supported. fix: use null \(FP embeddings\), 4 or 8",
        ),
        ("untied_embedding_group_size: 48", "untied_embedding_group_size=48 must be a power of two >= 2. fix: use 32"),
    ],
)
def test_untied_table_settings_are_checked_at_recipe_load_by_their_own_names(tmp_path, setting, message):
    with pytest.raises(UserError, match=message) as e:
        _recipe(tmp_path, f"base: xnnpack_8da4w_tied8\nquantizer:\n  {setting}\n")
    assert "\n" not in str(e.value)


@pytest.mark.fast
def test_builtin_4bit_recipes_quantize_embeddings_by_default_and_null_keeps_them_float(tmp_path):
    from qharness.recipes.embedding import EmbeddingQuant
    from qharness.recipes.registry import known_recipes, load_recipe

    four_bit = [n for n in known_recipes() if n.startswith(("xnnpack_8da", "xnnpack_int4w"))]
    assert len(four_bit) >= 14
    for name in four_bit:  # but the recipes whose table is the 8-bit head's (stored once: test_shared_table.py)
        want = (
            EmbeddingQuant(8, None, "symmetric_no_clipping_err")
            if name in ("xnnpack_8da4w_tied8", "xnnpack_8da4w_zp", "xnnpack_8da4w_zp_lsq")
            or name.startswith("xnnpack_8da4w_zp_split")
            else EmbeddingQuant(4, 32)
        )
        assert load_recipe(name).embedding == want, name
        # a table the 8-bit head does not share (an untied model's): 4-bit groups of 32, the head's scale rule
        untied = EmbeddingQuant(4, 32, want.mapping) if want.bits == 8 else want
        assert load_recipe(name).untied_embedding == untied, name
    for name in ("xnnpack_fp32", "xnnpack_int8_dynamic", "xnnpack_int8_static", "vulkan_int8w"):
        assert load_recipe(name).embedding is None, name
    assert _recipe(tmp_path, "base: xnnpack_8da4w\nquantizer: {embedding_bits: null}\n").embedding is None
    per_row = _recipe(
        tmp_path, "base: xnnpack_int4w_dynamic\nquantizer: {embedding_bits: 8, embedding_group_size: null}\n"
    )
    assert per_row.embedding == EmbeddingQuant(8, None) and per_row.embedding.scheme == "w8-pc"
    # the schemes summary.json's layers name, read back for a layers: rule's table (coverage)
    assert EmbeddingQuant.from_scheme("w4-g32") == EmbeddingQuant(4, 32)
    assert EmbeddingQuant.from_scheme("w8-pc") == EmbeddingQuant(8, None)
    assert EmbeddingQuant.from_scheme("8da4w-g32") is None and EmbeddingQuant.from_scheme("fp") is None


def test_the_recipe_table_shows_each_recipes_embedding():
    r = run_cli("recipes")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()}
    assert rows["recipe"][:4] == ["recipe", "backend", "modes", "embedding"]
    assert rows["xnnpack_8da4w"][3] == "w4-g32" and rows["xnnpack_int4w_dynamic"][3] == "w4-g32"
    assert rows["xnnpack_int8_dynamic"][3] == "fp32"
    assert rows["xnnpack_8da4w_tied8"][3:6] == ["w8-pc,", "untied", "w4-g32"]


@pytest.mark.fast
@pytest.mark.parametrize("tied, scheme", [(True, "w8-pc"), (False, "w4-g32")])
def test_tied8_keeps_the_heads_table_at_8_bits_and_an_untied_table_at_4(tied, scheme):
    """``xnnpack_8da4w_tied8`` (and the zero-point recipes on it): the table the 8-bit head shares at 8 bits per row
    (stored once: test_shared_table.py); an untied model's table, which nothing shares, at 4 bits in groups of 32, as
    llama.cpp's Q4_0 keeps ``token_embd``. The assignment names it and deployment stores those values."""
    import torch

    from qharness.recipes.embedding import EmbeddingQuant
    from qharness.recipes.registry import load_recipe

    recipe = load_recipe("xnnpack_8da4w_tied8")
    model = _tiny(tied=tied)
    table = model.get_input_embeddings().weight.detach().clone()
    layers = recipe.make_quantizer(is_qat=False).convert(model)
    assert layers["model.embed_tokens"] == scheme and layers["lm_head"] == "8da8w-pc"
    quant = EmbeddingQuant.from_scheme(scheme)
    expected = _deployed_table(table, EmbeddingQuant(quant.bits, quant.group_size, "symmetric_no_clipping_err"))
    assert torch.equal(model.get_input_embeddings().weight.dequantize(), expected)


@pytest.mark.fast
def test_a_table_untied_by_a_step_that_chose_the_heads_weights_is_still_the_tied_one():
    """GPTQ, weighted scales and zero points give a group-wise head weights of its own (``put_weights`` unties it):
    the table stays the model's tied one, so it keeps the tied settings (``xnnpack_8da4w_tied8``: 8 bits per row, a
    copy apart when the head is at 4 bits) and the summary's ``tied_to``; it took the untied 4-bit settings and was
    reported as untied."""

    from qharness.deploy.coverage import inventory
    from qharness.recipes.registry import load_recipe
    from qharness.sources.models import put_weights, tied_tables

    model = _tiny(tied=True)
    put_weights(model, {"lm_head.weight": model.lm_head.weight * 1.01})  # what rounding.py does to a rounded head
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    assert tied_tables(model) == {"model.embed_tokens"} and inventory(model).tied == {"model.embed_tokens": "lm_head"}
    layers = load_recipe("xnnpack_8da4w_tied8").make_quantizer(is_qat=False).convert(model)
    assert layers["model.embed_tokens"] == "w8-pc"


def _tiny(tied: bool = True):
    import torch

    from qharness.sources.embedded import EmbeddedSpec, new_llama

    torch.manual_seed(0)
    spec = EmbeddedSpec(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    model = new_llama(spec, 128).eval()
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def _deployed_table(weight, quant):
    """The table deployment stores, dequantized: ``quantize_`` with the recipe's torchao config on a copy."""
    import torch
    from torchao.quantization import quantize_

    emb = torch.nn.Embedding(*weight.shape)
    with torch.no_grad():
        emb.weight.copy_(weight)
    quantize_(emb, quant.torchao_config(), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Embedding))
    return emb.weight.dequantize()


@pytest.mark.parametrize(  # PT2E (exported), torchao (eager), torchao's untied table (4-bit, no-clipping scales)
    "recipe_name", ["xnnpack_int4w_dynamic", "xnnpack_8da4w", "xnnpack_8da4w_tied8"]
)
def test_qat_trains_the_deployed_table_fake_quantized_and_gradients_reach_it(recipe_name):
    """The QAT-prepared model's embedding lookup equals the lookup of the table deployment stores (the same torchao
    config), and the loss's gradient reaches the FP table (the straight-through estimator survives torch.export)."""
    import torch

    from qharness.recipes.registry import load_recipe
    from qharness.training.prepare import prepare_for_training, set_fake_quant

    recipe = load_recipe(recipe_name)
    model = _tiny(tied=False)  # the table's gradient then comes from its lookups alone
    table = model.get_input_embeddings().weight
    expected_table = _deployed_table(table.detach(), recipe.table_quant(tied=False))
    assert not torch.equal(expected_table, table.detach())  # the fake quantization changes the table
    prepared = prepare_for_training(model, recipe, batch_size=2, seq_len=8, is_qat=True)
    x = torch.randint(0, 128, (2, 8))
    looked_up = {}
    if recipe.kind == "pt2e":  # the exported graph: record its aten.embedding node's output

        class Recorder(torch.fx.Interpreter):
            def run_node(self, n):
                out = super().run_node(n)
                if n.op == "call_function" and n.target is torch.ops.aten.embedding.default:
                    looked_up["out"] = out
                return out

        logits = Recorder(prepared).run(x)
        params = dict(prepared.named_parameters(remove_duplicate=False))
        trained = next(p for n, p in params.items() if n.endswith("embed_tokens.weight"))
    else:
        hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: looked_up.update(out=o))
        logits = prepared(x)
        hook.remove()
        trained = model.get_input_embeddings().weight
    assert torch.equal(looked_up["out"], torch.nn.functional.embedding(x, expected_table))
    if recipe.kind == "pt2e":  # fake quantization off (fake_quant_after_n_steps): the FP table's lookup
        set_fake_quant(prepared, False)
        with torch.no_grad():
            Recorder(prepared).run(x)
        assert torch.equal(looked_up["out"], torch.nn.functional.embedding(x, table.detach()))
        set_fake_quant(prepared, True)
    assert trained.grad is None
    logits.float().logsumexp(-1).mean().backward()
    grad = trained.grad
    assert grad is not None and bool(torch.isfinite(grad).all())
    rows = grad.abs().sum(1) > 0
    assert bool(rows[x.unique()].all())  # every looked-up row gets a gradient through the fake quantizer
    assert int(rows.sum()) == len(x.unique())  # and no other row


def test_a_pt2e_recipe_deploys_the_table_with_the_runtimes_quantized_embedding_kernel(tmp_path):
    """PT2E 4-bit recipe: the table is quantized at source level, the .pte looks it up with
    quantized_decomposed::embedding_4bit, runs in the pip runtime like the converted graph, and the coverage record
    counts it at 4 bits in groups of 32. Tied: no shared-table kernel in the pip runtime, so the record says the
    table is a second copy and what it costs (this fails once the runtime has torchao's shared-embedding op)."""
    import torch

    from qharness.deploy.deployed import graph_coverage
    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.runtime.pte import PteModel, embedding_bytes, operators
    from qharness.upstream import imports

    recipe = load_recipe("xnnpack_int4w_dynamic")
    tokens = torch.tensor([[5, 17, 99, 3]])
    graph = quantize_for_deploy(_tiny(), recipe, 32, lambda g: g(tokens, torch.tensor([0])))
    table = graph_coverage(graph).embeddings["model.embed_tokens"]
    assert (table.bits, table.group_size, table.bytes) == (4, 32, 128 * 64 * 4)
    assert table.stored_bytes == 128 * (64 // 2 + 4 * 2)  # packed 4-bit rows + one fp32 scale per group
    assert table.tied_to == "lm_head" and not table.shared
    assert "torchao::_shared_embedding_4bit" in table.note and f"costs {table.stored_bytes} bytes" in table.note
    pte = tmp_path / "model.pte"
    pte.write_bytes(lower_to_pte(graph, recipe, 32, runner_metadata(32, 128, 0, [0], True)))
    assert "quantized_decomposed::embedding_4bit.out" in operators(pte)["operators"]
    assert embedding_bytes(pte) == table.stored_bytes
    program = PteModel(pte)
    with torch.no_grad():
        want = graph(tokens, torch.tensor([0]))
    got = program(tokens, 0)
    got = got.reshape(want.shape)  # int8 dynamic activations: XNNPACK's rounding differs from the reference's a little
    assert (got - want).abs().max() < 0.02 and torch.equal(got.argmax(-1), want.argmax(-1))
    ops = imports.runtime_operator_names()
    assert "quantized_decomposed::embedding_4bit.out" in ops
    assert not any(op.startswith("torchao::") for op in ops)  # the shared table's kernel: absent from pip 1.5.1


def test_calibrate_records_the_quantized_table_and_passes_parity(tmp_path, tiny_llama, corpus):
    """Through the CLI: a PT2E int8 recipe with 8-bit per-row embeddings; the gate passes and summary.json's coverage
    shows the table at 8 bits."""
    recipe = tmp_path / "emb8.yaml"
    recipe.write_text(
        "base: xnnpack_int8_dynamic\ndescription: int8 + 8-bit embeddings\n"
        "quantizer: {embedding_bits: 8, embedding_group_size: null}\n"
    )
    cfg = tiny_run_config(tmp_path, tiny_llama, corpus, {"recipe": str(recipe), "mode": "ptq"})
    r = run_cli("calibrate", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parity"]["passed"] is True
    tables = summary["coverage"]["embeddings"]
    assert list(tables) == ["model.embed_tokens"]
    assert (tables["model.embed_tokens"]["bits"], tables["model.embed_tokens"]["group_size"]) == (8, None)


def test_tied8_calibrates_an_untied_model_with_its_table_at_4_bits(tmp_path, corpus):
    """Through the CLI, an untied model (its lm_head a weight of its own) with ``xnnpack_8da4w_tied8``: the table at
    4 bits in groups of 32 in the program (coverage, the summary's layers), the head at 8, the gate passed, one
    self-contained ``.pte`` (nothing shared, no data file)."""
    from conftest import make_tiny_hf

    model = make_tiny_hf(tmp_path / "untied", "llama", corpus.read_text()[:200_000], tie=False)
    cfg = tiny_run_config(tmp_path, model, corpus, {"recipe": "xnnpack_8da4w_tied8", "mode": "ptq"})
    r = run_cli("calibrate", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity"]["passed"] is True
    table = summary["coverage"]["embeddings"]["model.embed_tokens"]
    assert (table["bits"], table["group_size"], table["tied_to"], table["shared"]) == (4, 32, None, False)
    schemes = summary["layers"]["schemes"]
    assert schemes["model.embed_tokens"] == "w4-g32" and schemes["lm_head"] == "8da8w-pc"
    assert not (run / "model.ptd").exists()


@pytest.mark.fast
@pytest.mark.parametrize("recipe_name", ["xnnpack_int4w_dynamic", "xnnpack_8da4w"])
def test_a_table_the_group_cannot_split_is_refused_before_any_work(recipe_name):
    """A 48-wide table with the default groups of 32: one line naming the table and the fix, before export (a table
    the recipe means to quantize must not stay float unnoticed)."""
    from qharness.recipes.registry import load_recipe
    from qharness.sources.embedded import EmbeddedSpec, new_llama
    from qharness.training.prepare import prepare_for_training

    spec = EmbeddedSpec(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(
        UserError,
        match="embedding_group_size=32 does not divide the 48-wide rows of the embedding "
        "table model.embed_tokens. fix: set the recipe's embedding_group_size",
    ):
        prepare_for_training(new_llama(spec, 128), load_recipe(recipe_name), 2, 8, is_qat=False)


@pytest.mark.fast
def test_an_untied_table_the_group_cannot_split_is_refused_by_its_own_setting_and_a_tied_one_is_not_checked_by_it():
    """``xnnpack_8da4w_tied8`` on 48-wide tables: a tied one (8 bits per row) is taken; an untied one (groups of 32)
    is refused before any work, the message naming ``untied_embedding_group_size``."""
    import torch

    from qharness.recipes.registry import load_recipe
    from qharness.sources.embedded import EmbeddedSpec, new_llama
    from qharness.training.prepare import prepare_for_training

    spec = EmbeddedSpec(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    recipe = load_recipe("xnnpack_8da4w_tied8")
    prepare_for_training(new_llama(spec, 128), recipe, 2, 8, is_qat=False)  # tied: the per-row table fits
    untied = new_llama(spec, 128)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    with pytest.raises(
        UserError,
        match="untied_embedding_group_size=32 does not divide the 48-wide rows of the embedding table "
        "model.embed_tokens. fix: set the recipe's untied_embedding_group_size",
    ):
        prepare_for_training(untied, recipe, 2, 8, is_qat=False)


@pytest.mark.fast
def test_the_summary_keeps_the_tables_and_the_run_table_names_the_quantized_ones():
    from qharness.deploy.coverage import format_coverage
    from qharness.deploy.coverage_record import Coverage, EmbeddingTable
    from qharness.run.summary import RunSummary

    table = EmbeddingTable(
        bits=4, group_size=32, bytes=32768, stored_bytes=5120, tied_to="lm_head", note="stored twice"
    )
    cov = Coverage(
        weights=8, bytes=1, quantized=8, quantized_bytes=1, fraction=1.0, embeddings={"model.embed_tokens": table}
    )
    line = format_coverage(cov)
    assert line.endswith("; embeddings: model.embed_tokens 4-bit (groups of 32), a copy apart from the tied lm_head")
    fp = EmbeddingTable(bits=None, group_size=None, bytes=32768, stored_bytes=32768)
    assert "embeddings" not in format_coverage(Coverage(8, 1, 8, 1, 1.0, embeddings={"model.embed_tokens": fp}))
    ids = dict(
        run_dir="r", model="m", recipe="x", backend="xnnpack", mode="ptq", quantized=True, seq_len=8, eval_blocks=1
    )
    data = RunSummary(**ids, coverage=cov).to_dict()
    assert data["coverage"]["embeddings"]["model.embed_tokens"]["group_size"] == 32
    assert RunSummary.from_dict(data).coverage == cov
    fp_cov = Coverage(8, 1, 8, 1, 1.0, embeddings={"e": fp})  # null bits and group size survive the round trip
    assert RunSummary.from_dict(RunSummary(**ids, coverage=fp_cov).to_dict()).coverage.embeddings["e"] == fp
