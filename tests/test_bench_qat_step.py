"""scripts/bench_qat_step.py's ``--ops`` count (docs/benchmarks/real-model.md, the GPU section): the top-level ATen
calls of one training step, an op that another op calls left out. The timings themselves are the benchmark."""

import importlib.util
import json

import pytest
import torch
from conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_qat_step", ROOT / "scripts" / "bench_qat_step.py")
bqs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bqs)


@pytest.mark.fast
def test_ops_counts_the_calls_a_step_makes_and_not_the_ones_inside_them():
    a, b = torch.randn(4, 8), torch.randn(8, 8)
    assert bqs._aten_calls(lambda: (a + 1).sum()) == 2  # add, sum
    # linear is one call from the host, though it runs t and addmm inside
    assert bqs._aten_calls(lambda: torch.nn.functional.linear(a, b)) == 1
    assert bqs._aten_calls(lambda: [torch.nn.functional.linear(a, b) for _ in range(3)]) == 3


def test_the_script_counts_more_calls_per_step_for_qat_than_for_fp(tiny_llama, tmp_path):
    out = tmp_path / "steps.json"
    args = "--rounds 1 --steps 1 --warmup 0 --batch 1 --seq_len 16 --threads 1 --ops".split()
    bqs.main([*args, "--model", str(tiny_llama), "--json", str(out)])
    runs = json.loads(out.read_text())["runs"]
    fp, qat = runs["fp"][0]["aten_calls"], runs["qat:xnnpack_8da4w"][0]["aten_calls"]
    assert 0 < fp < qat  # the fake quantizers' calls come on top of the same model's
