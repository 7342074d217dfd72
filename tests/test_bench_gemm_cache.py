"""scripts/bench_gemm_cache.py (docs/benchmarks/real-model.md, the cache section): the bytes it says a step streams,
programs whose GEMMs all run in XNNPACK, and its table through ``main()``. The timings themselves are the benchmark."""

import importlib.util
import json

import pytest
import torch
from conftest import ROOT

from tests.test_whole_layers import _kernel_calls

spec = importlib.util.spec_from_file_location("bench_gemm_cache", ROOT / "scripts" / "bench_gemm_cache.py")
bgc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bgc)

SHAPE = (64, 32, 128)  # hidden, kv, mlp


@pytest.mark.fast
def test_weight_bytes_are_the_quantized_modules_codes_and_scales():
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    model = bgc.build(2, *SHAPE)
    quantize_(model, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)))
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(weights) == 2 * 7
    # 4-bit codes (stored one per int8 before packing) and one bf16 scale per group of 32, as XNNPACK keeps them
    stored = sum(w.qdata.numel() // 2 + w.scale.numel() * 2 for w in weights)
    assert bgc.weight_bytes(2, *SHAPE) == stored
    assert bgc.weight_bytes(30, 576, 192, 1536) / 1e6 == pytest.approx(59.7, abs=0.05)  # SmolLM2-135M's projections


def test_the_table_times_programs_whose_gemms_all_run_in_xnnpack(tmp_path):
    out = tmp_path / "gemms.json"
    args = ["--layers", "1,2", "--shape", ",".join(map(str, SHAPE)), "--rounds", "2", "--steps", "2"]
    result = bgc.main([*args, "--repeats", "1", "--threads", "1", "--cache", str(tmp_path), "--json", str(out)])
    assert json.loads(out.read_text()) == result
    rows = {r["layers"]: r for r in result["rows"]}
    assert sorted(rows) == [1, 2] and all(r["ms_per_step"] > 0 for r in rows.values())
    for n, r in rows.items():
        assert r["weights_mb"] == round(bgc.weight_bytes(n, *SHAPE) / 1e6, 2)
        assert r["gb_per_s_range"][0] <= r["gb_per_s"] <= r["gb_per_s_range"][1]
        ops, delegates = _kernel_calls((tmp_path / f"gemms_64_32_128_x{n}.pte").read_bytes())
        assert delegates >= 1 and not [op for op in ops if "linear" in op or "mm" in op], ops  # no GEMM outside


@pytest.mark.fast
@pytest.mark.parametrize(
    "argv, message",
    [(["--shape", "60,32,128"], "multiples of the group size"), (["--layers", "8,x"], "whole numbers")],
)
def test_bad_shapes_and_layer_counts_are_refused_before_any_lowering(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        bgc.main([*argv, "--cache", str(tmp_path)])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
