"""A tied table stored once (``deploy/shared_table.py``, recipe ``xnnpack_8da4w_tied8``): the lookup table and the
8-bit ``lm_head`` quantized alike hold the same int8 values, and the program keeps them once, in ``model.ptd`` beside
``model.pte``; the runtime loads both, every command finds the data file by the ``.pte``'s name, and a ``.pte`` whose
data file is missing is one line naming it. Recipes whose two copies differ still write one self-contained ``.pte``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import make_tiny_hf, run_cli, tiny_run_config
from test_runner_snippet import readme_runner_snippet

WIDTH = 64


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, corpus):
    return make_tiny_hf(tmp_path_factory.mktemp("tied"), "llama", corpus.read_text(), layers=1, tie=True)


def test_a_tied_table_quantized_alike_is_stored_once_and_every_command_loads_it(tmp_path, tied_model, corpus):
    from qharness.errors import UserError
    from qharness.runtime.pte import PteModel
    from qharness.upstream import imports

    cfg = tiny_run_config(tmp_path, tied_model, corpus, {"recipe": "xnnpack_8da4w_tied8", "mode": "qat"})
    r = run_cli("fit", cfg)  # QAT: the tied weight trains through both fake quantizers, then is stored once
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"
    pte, data = run / "model.pte", run / "model.ptd"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity"]["passed"] is True and summary["parity"]["fake_quant"]["passed"] is True
    assert summary["pte"]["data_file"] == "model.ptd"
    assert summary["pte"]["size_bytes"] == pte.stat().st_size + data.stat().st_size
    table = summary["coverage"]["embeddings"]["model.embed_tokens"]
    assert (table["bits"], table["group_size"], table["tied_to"], table["shared"]) == (8, None, "lm_head", True)
    assert "stored once" in table["note"] and "model.ptd" in table["note"]
    vocab = json.loads((tied_model / "config.json").read_text())["vocab_size"]
    table_bytes = vocab * WIDTH  # one int8 copy of the table
    assert table_bytes <= data.stat().st_size < 2 * table_bytes  # in the data file once, not twice
    assert len(imports.pte_external_constants(pte)) == 1  # the lookup reads the data file's copy
    g = run_cli("generate", "--pte", pte, "--prompt", "To be", "--max_new_tokens", "4", "--temperature", "0")
    assert g.returncode == 0, g.stderr[-2000:]
    p = run_cli("profile", "--pte", pte, "--prompt_len", "4", "--decode_tokens", "2", "--reps", "1")
    assert p.returncode == 0 and "embedding" in p.stdout, p.stderr[-2000:]  # the lookup of the data file's table
    code = readme_runner_snippet().replace(  # ExecuTorch's runner, the data file its third argument (deploying.md)
        '"runs/qat_xnnpack/model.pte", "runs/qat_xnnpack/tokenizer"', f'"{pte}", "{run / "tokenizer"}", "{data}"'
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, env=env, timeout=600)
    assert r.returncode == 0 and b"PyTorchObserver" in r.stdout, r.stderr[-2000:]
    data.rename(run / "elsewhere.ptd")  # the .pte alone: one line that names the missing file (every loader's error)
    with pytest.raises(UserError, match=r"keeps 1 constant\(s\) in its data file .*model\.ptd, which is missing"):
        PteModel(pte)


def _exported(recipe_name: str, tied: bool = True):
    """The lowering's exported program of a tiny model quantized by ``recipe_name`` (what ``lower_program`` tags)."""
    import torch

    from qharness.deploy.lower import _dynamic_shapes, _example, quantize_for_deploy
    from qharness.recipes.registry import load_recipe
    from qharness.sources.embedded import EmbeddedSpec, new_llama
    from qharness.upstream import lowering

    torch.manual_seed(0)
    model = new_llama(
        EmbeddedSpec(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2), 128
    )
    if not tied:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.02)  # its own values
    recipe = load_recipe(recipe_name)
    graph = quantize_for_deploy(model.eval(), recipe, 32, lambda g: None)
    with lowering.fast_lowering():
        ep = lowering.export_for_lowering(graph, _example(32), _dynamic_shapes(32))
        return lowering.decompose_for_lowering(ep, recipe.make_partitioners())


@pytest.mark.fast
@pytest.mark.parametrize(
    "recipe_name, tied, shared",
    [
        ("xnnpack_8da4w_tied8", True, 1),  # 8-bit per-row table, 8-bit head, one scale rule: equal int8 values
        ("xnnpack_8da4w_tied8", False, 0),  # untied: two weights of different values
        ("xnnpack_8da4w_head8", True, 0),  # a 4-bit lookup table beside the 8-bit head
        ("xnnpack_8da4w", True, 0),  # 4-bit both, but groups of the table's own scales: not the head's values
    ],
)
def test_only_a_table_whose_int8_values_equal_the_heads_is_shared(recipe_name, tied, shared):
    from qharness.deploy import shared_table

    pairs = shared_table.shared_tables(_exported(recipe_name, tied))
    assert len(pairs) == shared
    for table, head in pairs:
        assert "embed_tokens" in table.name and "lm_head" in head.args[0].name


@pytest.mark.fast
def test_move_program_moves_the_data_file_with_the_pte_and_drops_a_stale_one(tmp_path):
    from qharness.runtime.pte import data_file, move_program, program_bytes

    (tmp_path / "model.pending.pte").write_bytes(b"p" * 10)
    (tmp_path / "model.pending.ptd").write_bytes(b"d" * 5)
    moved = move_program(tmp_path / "model.pending.pte", tmp_path / "model.pte")
    assert moved == tmp_path / "model.pte" and data_file(moved) == tmp_path / "model.ptd"
    assert data_file(moved).read_bytes() == b"d" * 5 and not (tmp_path / "model.pending.ptd").exists()
    assert program_bytes(moved) == 15
    (tmp_path / "model.pending.pte").write_bytes(b"q" * 7)  # a later export without a data file
    move_program(tmp_path / "model.pending.pte", tmp_path / "model.pte")
    assert not (tmp_path / "model.ptd").exists() and program_bytes(tmp_path / "model.pte") == 7
