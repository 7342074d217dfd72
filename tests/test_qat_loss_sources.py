"""scripts/qat_loss_sources.py (docs/benchmarks/real-model.md): a trained QAT graph's fake quantizers sorted by what
they round, and each row's switches turning exactly those off; the script driven end to end on a checkpoint written
as a QAT run writes one. Scoring SmolLM2 is the benchmark."""

import importlib.util
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

spec = importlib.util.spec_from_file_location("qat_loss_sources", ROOT / "scripts" / "qat_loss_sources.py")
qls = importlib.util.module_from_spec(spec)
spec.loader.exec_module(qls)


def _trained(tiny_llama):
    """A ``xnnpack_8da4w_zp_lsq`` QAT module on the tiny Llama, started from its PTQ program, one weight moved."""
    from qharness.training.module import QuantLM

    blocks = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(0))
    m = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w_zp_lsq", mode="qat", scale_lr_ratio=0)
    m.build(2, 16, warm_start=blocks)
    with torch.no_grad():  # as training moves weights off the grid
        w = m.graph.model.model.layers[0].mlp.gate_proj.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)) * 0.01)
    m.to_eval()
    return m


@pytest.mark.fast
def test_every_fake_quantizer_is_sorted_by_what_it_rounds_and_each_row_turns_off_its_own(tiny_llama):
    m = _trained(tiny_llama)
    fqs = qls.fake_quants(m.graph)
    by_kind = {k: {layer for kind, layer, _ in fqs if kind == k} for k in (qls.ACT, qls.W4, qls.W8, qls.TABLE)}
    learned = {n.rpartition(".")[0] for n in m.learned_qparams()}  # the 4-bit weights, as deployment reads them
    assert by_kind[qls.W4] == {f"model.{n}" for n in learned}
    offsets = {layer for layer in by_kind[qls.W8] if layer.endswith(".offsets")}
    assert by_kind[qls.W8] == offsets | {"model.lm_head"} and len(offsets) == 8  # 2 layers x k/v/up/down
    assert by_kind[qls.TABLE] == {"model.model.embed_tokens"}
    assert by_kind[qls.ACT] == by_kind[qls.W4] | by_kind[qls.W8]  # every linear's input, the head's included
    assert all(qls.part(layer) != "?" for _, layer, _ in fqs)

    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        program = m.graph(x)
        assert qls.set_row(fqs, qls.ROWS["  only the lm_head's input in float"]) == 1
        head_float = m.graph(x)
        everything = qls.ROWS["every rounding off (the trained weights, float)"]
        assert qls.set_row(fqs, everything) == len(fqs)
        float_graph = m.graph(x)
        fresh, _ = m.load_fp()
        m.load_into(fresh)  # the trained weights in a float model (its zero-point layers attached)
        reference = fresh(x).logits
        assert qls.set_row(fqs, []) == 0
        again = m.graph(x)
    torch.testing.assert_close(float_graph, reference, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(program, reference, atol=1e-3)  # the rounding is on by default and matters
    assert not torch.equal(head_float, program) and torch.equal(again, program)


def test_the_script_scores_a_qat_checkpoint_row_by_row(tiny_llama, corpus, tmp_path):
    """A checkpoint as ``qharness fit`` writes it (``state_dict``, the model's hyperparameters, the data layout),
    scored on a few windows: every row printed with its interval, the program's own row first."""
    m = _trained(tiny_llama)
    ckpt = tmp_path / "last.ckpt"
    torch.save(
        {
            "state_dict": m.state_dict(),
            "hyper_parameters": dict(m.hparams),
            "datamodule_hyper_parameters": {"batch_size": 2, "seq_len": 16},
            "global_step": 7,
        },
        ckpt,
    )
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "qat_loss_sources.py"), str(ckpt), "--text", str(corpus)]
        + ["--windows", "6", "--rows", "0", "1", "9"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    table = out.stdout.split("| row |")[1].splitlines()
    rows = [line for line in table if line.startswith("| ") and not line.startswith("|---")]
    assert [r.split(" | ")[0] for r in rows] == [
        "| the QAT program (every rounding, as trained)",
        "| int8 activations off (every linear's input in float)",
        "| every rounding off (the trained weights, float)",
    ]
    assert "(step 7)" in out.stdout and "on 6 windows of 16" in out.stdout
    assert rows[0].endswith("| - |") and all(
        re.fullmatch(r"\d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \|", r.split(" | ")[-1]) for r in rows[1:]
    )


def test_a_missing_checkpoint_is_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "qat_loss_sources.py"), str(tmp_path / "none.ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1].startswith(f"checkpoint {tmp_path}")
