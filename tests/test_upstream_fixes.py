"""Fixes in qharness/upstream/fixes/, each with a test that fails once upstream no longer needs it."""

import pytest
import torch

from qharness.upstream.fixes import custom_sdpa, xnnpack_scalars, xnnpack_subbyte


def _graph_with_int_add(device="cpu"):
    class M(torch.nn.Module):
        def forward(self, x):
            idx = torch.arange(x.shape[1], device=x.device) + 0
            return x[:, idx] * 2.0

    return torch.export.export(M(), (torch.randn(2, 4, device=device),)).module()


def _lifted_dtypes(gm):
    return {
        n.target: getattr(gm, n.target).dtype
        for n in gm.graph.nodes
        if n.op == "get_attr" and n.target.startswith("_tensor_constant")
    }


@pytest.mark.fast
def test_upstream_xnnpack_still_lifts_int_scalars_as_float():
    """executorch#22062: when this fails, upstream fixed it; drop xnnpack_scalars._lift_scalars_keeping_dtype."""
    gm = xnnpack_scalars.upstream_xnnpack_scalar_lifting()(_graph_with_int_add())
    assert torch.float32 in _lifted_dtypes(gm).values()
    assert all(d == torch.float32 for d in _lifted_dtypes(gm).values())


@pytest.mark.fast
def test_our_lifting_keeps_the_node_dtype_and_runs():
    gm = xnnpack_scalars._lift_scalars_keeping_dtype(_graph_with_int_add())
    assert sorted(map(str, _lifted_dtypes(gm).values())) == ["torch.float32", "torch.int64"]
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), x * 2.0)


def _sdpa_inputs(start=5, n=3):
    torch.manual_seed(0)
    return torch.randn(1, n, 4, 16), torch.randn(1, 32, 2, 16), torch.randn(1, 32, 2, 16), start, None, 0.0, True, 0.25


@pytest.mark.fast
def test_our_lifting_puts_the_constants_on_the_graph_device():
    """A graph exported on a GPU gets its lifted constants there (else prepare_qat_pt2e: "got devices {cuda:0, cpu}");
    the meta device stands in for CUDA here."""
    gm = xnnpack_scalars._lift_scalars_keeping_dtype(_graph_with_int_add("meta"))
    assert {getattr(gm, n).device.type for n in _lifted_dtypes(gm)} == {"meta"}


@pytest.mark.fast
def test_upstream_eager_custom_sdpa_still_logs_on_every_call(capfd):
    """When this fails, ExecuTorch's eager custom_sdpa stopped logging: drop custom_sdpa._custom_sdpa_cpu."""
    custom_sdpa.llm_custom_ops()
    capfd.readouterr()
    custom_sdpa.upstream_custom_sdpa(*_sdpa_inputs())
    assert "No temp allocator provided" in capfd.readouterr().err


@pytest.mark.fast
@pytest.mark.parametrize("start, n", [(0, 1), (0, 9), (5, 3), (31, 1)])
def test_our_eager_custom_sdpa_is_quiet_and_equals_upstream(capfd, start, n):
    custom_sdpa.llm_custom_ops()
    args = _sdpa_inputs(start, n)
    expected = custom_sdpa.upstream_custom_sdpa(*args)
    capfd.readouterr()
    out = torch.ops.llama.custom_sdpa(*args)
    assert "No temp allocator" not in capfd.readouterr().err
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def _quantized_sdpa_inputs(start=5, n=3):
    """int8 query and caches with per-token scales / zero points, as the fast path's int8 KV cache passes them."""
    from qharness.upstream import imports

    imports.quantized_decomposed_ops()
    q, k, v, *_ = _sdpa_inputs(start, n)
    qd = torch.ops.quantized_decomposed

    def quant(x):
        s, z = qd.choose_qparams_per_token_asymmetric.default(x, torch.int8)
        return qd.quantize_per_token(x, s, z, -128, 127, torch.int8), z.to(torch.int8), s.to(torch.float32)

    (qq, qz, qs), (kq, kz, ks), (vq, vz, vs) = quant(q), quant(k), quant(v)
    return (qq, kq, vq, start, None, 0.0, True, 0.25, qz, qs, kz, ks, vz, vs)


@pytest.mark.fast
def test_upstream_eager_custom_quantized_sdpa_still_logs_on_every_call(capfd):
    """When this fails, ExecuTorch's eager custom_quantized_sdpa stopped logging: drop
    custom_sdpa._custom_quantized_sdpa_cpu."""
    custom_sdpa.llm_custom_ops()
    capfd.readouterr()
    custom_sdpa.upstream_custom_sdpa(*_quantized_sdpa_inputs(), op="custom_quantized_sdpa")
    assert "No temp allocator provided" in capfd.readouterr().err


@pytest.mark.fast
@pytest.mark.parametrize("start, n", [(0, 1), (0, 9), (5, 3), (31, 1)])
def test_our_eager_custom_quantized_sdpa_is_quiet_and_equals_upstream(capfd, start, n):
    custom_sdpa.llm_custom_ops()
    args = _quantized_sdpa_inputs(start, n)
    expected = custom_sdpa.upstream_custom_sdpa(*args, op="custom_quantized_sdpa")
    capfd.readouterr()
    out = torch.ops.llama.custom_quantized_sdpa(*args)
    assert "No temp allocator" not in capfd.readouterr().err
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.fast
def test_upstream_vulkan_quantizer_still_lifts_scalars():
    """The Vulkan quantizer shares XNNPACK's scalar lifting (executorch#22062); when this fails, drop
    fixes.vulkan.vulkan_quantizer_cls and use VulkanQuantizer as it is."""
    from executorch.backends.vulkan.quantizer.vulkan_quantizer import VulkanQuantizer

    from qharness.upstream.fixes import vulkan

    gm = VulkanQuantizer().transform_for_annotation(_graph_with_int_add())
    assert _lifted_dtypes(gm), "upstream no longer lifts add/mul scalars"
    assert not _lifted_dtypes(vulkan.vulkan_quantizer_cls()().transform_for_annotation(_graph_with_int_add()))


def _int3_linear(group):
    """A linear layer torchao quantizes to 3-bit weights with int8 dynamic activations (``xnnpack_8da3w``)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    granularity = PerAxis(0) if group is None else PerGroup(group)
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int3, weight_granularity=granularity)
    quantize_(model, config)
    return model


def _lower(model, x):
    from qharness.upstream import imports

    with torch.no_grad():
        ep = torch.export.export(model, (x,))
    parts = [imports.xnnpack_partitioner(dynamic_quant=True), imports.xnnpack_partitioner(dynamic_quant=False)]
    return imports.to_edge_transform_and_lower(ep, partitioner=parts).to_executorch().buffer


def test_upstream_xnnpack_still_lowers_no_3bit_groups():
    """When this fails, ExecuTorch's XNNPACK lowers 3-bit group-wise weights: retire xnnpack_subbyte (the .pte could
    then store them as they are)."""
    with pytest.raises(AssertionError, match="Only 4b group quantization is supported"):
        _lower(_int3_linear(32), torch.randn(2, 64))


@pytest.mark.parametrize("group", [32, None])
def test_3bit_weights_as_int4_are_the_same_weights_and_run_on_xnnpack(group):
    from executorch.runtime import Runtime

    model, x = _int3_linear(group), torch.randn(2, 64)
    weight = model[0].weight
    before, values = weight.dequantize(), weight.qdata.clone()
    assert int(values.min()) >= -4 and int(values.max()) <= 3
    assert xnnpack_subbyte.store_as_int4(model) == {"0": "int3"}
    assert weight.target_dtype == torch.int4
    assert torch.equal(weight.qdata, values) and torch.equal(weight.dequantize(), before)
    program = Runtime.get().load_program(_lower(model, x))
    got = program.load_method("forward").execute([x])[0]
    want = model(x)  # int8 per-token activations here and in XNNPACK, rounded a little differently
    assert ((got - want).norm() / want.norm()).item() < 0.01
    assert xnnpack_subbyte.store_as_int4(model) == {}  # nothing left below 4 bits


@pytest.mark.fast
def test_upstream_ruamel_still_makes_its_c_parser_an_extra():
    """pyproject.toml depends on ruamel.yaml.clib because ruamel.yaml 0.19 lists it only under an extra; once it is a
    default requirement again, drop ours."""
    from importlib.metadata import requires

    clib = [r for r in requires("ruamel.yaml") or [] if r.startswith("ruamel.yaml.clib;")]
    assert clib and all("extra ==" in r for r in clib), requires("ruamel.yaml")


@pytest.mark.fast
def test_executorch_parses_its_edge_dialect_yaml_with_the_c_parser():
    """ExecuTorch loads edge.yaml with ``YAML(typ="safe")`` at import (every run and benchmark process); with
    ruamel.yaml.clib installed that is the C parser, not the pure-Python one (~1.3 s more per process here)."""
    import inspect

    import ruamel.yaml.main
    from executorch.exir.dialects.edge import _ops
    from ruamel.yaml import YAML

    assert 'YAML(typ="safe")' in inspect.getsource(_ops._load_edge_dialect_info)
    assert ruamel.yaml.main.CParser is not None and YAML(typ="safe").Parser is ruamel.yaml.main.CParser


_ROUTER_EXPORT = """
import torch
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
from torchao.quantization.granularity import PerGroup


class Router(torch.nn.Module):  # DeepSeek-V3's router: F.linear(x.float(), weight.type(torch.float32))
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 8, bias=False)

    def forward(self, x):
        return torch.nn.functional.linear(x.type(torch.float32), self.proj.weight.type(torch.float32))


def exported_router(register):
    torch.manual_seed(0)
    m = Router()
    quantize_(m, Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32)))
    if register:
        from qharness.upstream.fixes import torchao_metadata

        torchao_metadata.register()
    x = torch.randn(3, 64)
    with torch.no_grad():
        ep = torch.export.export(m, (x,), strict=True)
        return ep.module()(x), m(x)
"""


def test_upstream_intx_tensor_still_lacks_assert_metadata():
    """torchao's ``IntxUnpackedToInt8Tensor`` cannot export ``weight.type(torch.float32)`` (a fresh process: the fix
    is registered process-wide); when this fails, retire ``torchao_metadata``."""
    import subprocess
    import sys

    code = _ROUTER_EXPORT + "\ntry:\n    exported_router(False)\nexcept NotImplementedError as e:\n    print(e)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "_assert_tensor_metadata" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.fast
def test_our_assert_metadata_exports_a_quantized_router_with_its_values():
    scope: dict = {}
    exec(_ROUTER_EXPORT, scope)
    got, ref = scope["exported_router"](True)
    torch.testing.assert_close(got, ref)


def _converted_copy_into_from_buffer():
    """A linear over a buffer whose output is ``copy_``-ed into a new tensor (MLA's ``kv_b_proj`` over its cached
    latent), prepared with XNNPACK's int8 dynamic quantizer and converted."""
    from qharness.recipes.registry import load_recipe
    from qharness.upstream import imports

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 24, bias=False)
            self.register_buffer("cache", torch.randn(1, 8, 16))

        def forward(self, x):
            y = self.proj(self.cache)  # no input among the producers of the copy_'s destination
            out = y.new_empty(1, 8, 24)
            out[..., :24].copy_(y)
            return out + x.sum()

    torch.manual_seed(0)
    x = torch.randn(1, 16)
    graph = torch.export.export(M(), (x,), strict=True).module()
    pt2e = imports.pt2e()
    prepared = pt2e.prepare_pt2e(graph, load_recipe("xnnpack_int8_dynamic").make_quantizer(is_qat=False))
    prepared(x)
    return pt2e.convert_pt2e(prepared), x


def _weight_quantizes(graph):
    return [n for n in graph.graph.nodes if getattr(n.target, "_opname", "") == "quantize_per_channel"]


@pytest.mark.fast
def test_upstream_convert_pt2e_still_leaves_a_weight_quantize():
    """torchao's constant folding still skips the weight's ``quantize_per_channel``; when this fails, retire
    ``torchao_fold``."""
    graph, _ = _converted_copy_into_from_buffer()
    assert len(_weight_quantizes(graph)) == 1


@pytest.mark.fast
def test_our_fold_leaves_an_int8_weight_and_the_same_values():
    from qharness.upstream.fixes import torchao_fold

    graph, x = _converted_copy_into_from_buffer()
    with torch.no_grad():
        before = graph(x)
    assert torchao_fold.fold_weight_quantization(graph) == 1
    assert _weight_quantizes(graph) == [] and "proj.weight" not in dict(graph.named_parameters())
    assert any(b.dtype == torch.int8 for b in graph.buffers())
    with torch.no_grad():
        torch.testing.assert_close(graph(x), before)


def _zero_group_fake_quant(config_kwargs: dict, shape: tuple):
    """torchao's ``IntxFakeQuantizer`` on a tensor whose first row is zeros: its output and, for gradients ``g`` and
    ``g / 2`` (a loss halved, as gradient accumulation does), the input's gradients (the second doubled back)."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig, IntxFakeQuantizer

    torch.manual_seed(0)
    w = torch.randn(*shape)
    w[0] = 0  # a zeroed padding row of an embedding table (tied lm_head) / an all-zero token
    g = torch.randn(*shape) * 1e-3
    fq = IntxFakeQuantizer(IntxFakeQuantizeConfig(**config_kwargs))
    grads = []
    for factor in (1.0, 0.5):
        x = w.clone().requires_grad_(True)
        y = fq(x)
        y.backward(g * factor)
        grads.append(x.grad / factor)
    return y.detach(), grads, g


_FAKE_QUANTS = {  # 8da4w's weights (and the 4-bit tables), its int8 per-token activations
    "weight_int4_g32": (dict(dtype=torch.int4, group_size=32, is_symmetric=True), (4, 64)),
    "activation_int8_per_token": (dict(dtype=torch.int8, granularity="per_token", is_symmetric=False), (4, 64)),
}


def _as_released(mp: pytest.MonkeyPatch) -> None:
    """torchao's fake quantizers as released, whether or not ``torchao_zero_groups`` was installed in this process."""
    from torchao.quantization.qat import fake_quantizer, utils

    mp.setattr(fake_quantizer, "_fake_quantize_per_channel_group", utils._fake_quantize_per_channel_group)
    mp.setattr(fake_quantizer, "_fake_quantize_per_token", utils._fake_quantize_per_token)


@pytest.mark.fast
def test_upstream_fake_quant_still_rounds_zero_group_gradients(monkeypatch):
    """torchao's 4-bit weight fake quantizer gives a zero row the scale 1.2e-38 and its straight-through gradient
    passes through subnormal floats: not ``g``, and not the same under a halved loss. When this fails, retire
    ``torchao_zero_groups``."""
    _as_released(monkeypatch)
    _, (grad, halved), g = _zero_group_fake_quant(*_FAKE_QUANTS["weight_int4_g32"])
    assert not torch.equal(grad[0], g[0]) and (grad[0] - g[0]).abs().max() > 1e-8
    assert not torch.equal(grad[0], halved[0])


@pytest.mark.fast
@pytest.mark.parametrize("which", sorted(_FAKE_QUANTS))
def test_our_zero_groups_keep_the_values_and_pass_the_gradient_exactly(which):
    from torchao.quantization.qat import fake_quantizer

    from qharness.upstream.fixes import torchao_zero_groups

    torchao_zero_groups.install()
    torchao_zero_groups.install()  # once: a second call changes nothing
    assert fake_quantizer._fake_quantize_per_channel_group is torchao_zero_groups._per_channel_group
    y, (grad, halved), g = _zero_group_fake_quant(*_FAKE_QUANTS[which])
    with pytest.MonkeyPatch.context() as mp:
        _as_released(mp)
        y_up, (grad_up, _), _ = _zero_group_fake_quant(*_FAKE_QUANTS[which])
    assert torch.equal(y, y_up) and not y[0].any()  # the same forward values, bit for bit
    assert torch.equal(grad[0], g[0])  # the zero row: the gradient itself
    assert torch.equal(grad[1:], grad_up[1:])  # the other rows as upstream
    assert torch.equal(grad, halved)  # the same under a halved loss (FSDP's average vs accumulation's)


# ------------------------------------------------------------ XNNPACK's dynamic activations and group scales
def _run_pte(buffer, x):
    from qharness.upstream import imports

    program = imports.executorch_runtime().load_program(buffer)  # kept: a method outlived by its program segfaults
    return program.load_method("forward").execute([x])[0]


def _per_tensor_dynamic_int8_linear(x):
    """A linear converted by PT2E with XNNPACK's dynamic int8 config (``xnnpack_int8_dynamic``): one activation scale
    per call in the converted graph."""
    from qharness.upstream import imports

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).eval()
    config = imports.xnnpack_symmetric_config(
        is_per_channel=True, is_dynamic=True, is_qat=False, weight_qmin=-127, weight_qmax=127
    )
    pt2e = imports.pt2e()
    prepared = pt2e.prepare_pt2e(
        torch.export.export(model, (x,)).module(), xnnpack_scalars.xnnpack_quantizer_cls()().set_global(config)
    )
    prepared(x)
    return pt2e.convert_pt2e(prepared)


def _outlier_rows():
    x = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(1))
    x[0, 0] *= 100  # one token 100x the others (an attention sink's activations): per tensor, it sets every scale
    return x


def test_upstream_xnnpack_still_quantizes_per_tensor_dynamic_activations_per_token():
    """When this fails, XNNPACK computes one dynamic scale per tensor as the graph says: retire xnnpack_per_token."""
    import copy

    from qharness.upstream.fixes import xnnpack_per_token

    x = _outlier_rows()
    converted = _per_tensor_dynamic_int8_linear(x)
    per_tensor = converted(x)
    got = _run_pte(_lower(converted, x), x)  # lowered as the graph is: per tensor
    rewritten = copy.deepcopy(converted)
    assert xnnpack_per_token.per_token(rewritten) == 1
    per_token = rewritten(x)
    assert (got - per_tensor).abs().max() > 100 * (got - per_token).abs().max()  # the kernels compute per token
    assert torch.allclose(got, per_token, rtol=1e-5, atol=1e-5 * per_token.abs().max().item())


@pytest.mark.fast
def test_per_token_fake_quantization_is_the_rewritten_graphs_and_passes_gradients_straight_through():
    from qharness.upstream.fixes import xnnpack_per_token

    x = _outlier_rows()
    converted = _per_tensor_dynamic_int8_linear(x)
    xnnpack_per_token.per_token(converted)
    (chain,) = [n for n in converted.graph.nodes if "dequantize_per_token" in str(n.target)]
    converted.graph.output(chain)  # the graph's quantized activation as its output
    converted.graph.erase_node(next(n for n in converted.graph.nodes if n.op == "output"))
    converted.recompile()
    fake = xnnpack_per_token.fake_quantize_per_token(x)
    assert torch.equal(
        fake, converted(x).reshape(fake.shape)
    )  # QAT's activations are the deployed graph's, bit for bit
    y = x.clone().requires_grad_()
    xnnpack_per_token.fake_quantize_per_token(y).sum().backward()
    assert torch.equal(y.grad, torch.ones_like(y))


def _group_linear(scale_dtype, granularity=None, weight_dtype=torch.int4):
    """A 4-bit group-wise linear (``xnnpack_8da4w``'s layers; or ``granularity``, e.g. per channel) quantized with
    ``scale_dtype`` scales (None: float32), its weights spread over 4 decades so that most scales are not bf16
    numbers."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    with torch.no_grad():
        model[0].weight *= torch.logspace(-2, 2, 32)[:, None]
    config = Int8DynamicActivationIntxWeightConfig(
        weight_dtype=weight_dtype, weight_granularity=granularity or PerGroup(32), weight_scale_dtype=scale_dtype
    )
    quantize_(model, config)
    return model


def test_upstream_xnnpack_still_computes_group_scales_in_bf16():
    """When this fails, XNNPACK computes group-wise weights with float32 scales: retire xnnpack_bf16_scales."""
    model, x = _group_linear(None), torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    as_float32, as_bf16 = _lowered_against_its_scales(model, x)
    assert as_float32 > 10 * as_bf16


def _lowered_against_its_scales(model, x):
    """``(|.pte - model with its float32 scales|, |.pte - the same codes with the scales as bf16|)``, largest."""
    weight = model[0].weight
    assert weight.scale.dtype == torch.float32 and not torch.equal(weight.scale, weight.scale.bfloat16().float())
    got = _run_pte(_lower(model, x), x)
    as_float32 = model(x)
    weight.scale = weight.scale.bfloat16().float()  # the same codes with bf16 scales
    return (got - as_float32).abs().max(), (got - model(x)).abs().max()


@pytest.mark.parametrize("bits", [3, 4])
def test_upstream_xnnpack_still_computes_torchao_per_channel_4bit_scales_in_bf16(bits):
    """When this fails, ExecuTorch lowers a torchao per-channel 4-bit weight as ``qc4w`` with float32 scales (its
    QuantParams "need more fixes to map qb4w to qc4w"): narrow xnnpack_bf16_scales.scale_dtype to groups."""
    from torchao.quantization.granularity import PerAxis

    from qharness.upstream.fixes.xnnpack_subbyte import store_as_int4

    model = _group_linear(None, PerAxis(0), getattr(torch, f"int{bits}"))
    store_as_int4(model)  # 3-bit ships as 4-bit
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    as_float32, as_bf16 = _lowered_against_its_scales(model, x)
    assert as_float32 > 10 * as_bf16


def test_torchao_per_channel_8bit_weights_compute_with_float32_scales():
    """The other side of ``scale_dtype``: 8-bit per channel lowers as ``qc8w``, float32 scales kept."""
    from torchao.quantization.granularity import PerAxis

    from qharness.upstream.fixes import xnnpack_bf16_scales

    assert xnnpack_bf16_scales.scale_dtype(PerAxis(0), torch.int8) is None
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    as_float32, as_bf16 = _lowered_against_its_scales(_group_linear(None, PerAxis(0), torch.int8), x)
    assert as_bf16 > 10 * as_float32


@pytest.mark.fast
def test_per_channel_4bit_recipes_quantize_with_bf16_scales():
    from torchao.quantization import quantize_

    from qharness.recipes.registry import load_recipe

    (step, _) = load_recipe("xnnpack_8da3w_pc").make_quantizer(is_qat=False).configs
    assert step.config.weight_scale_dtype == torch.bfloat16
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    quantize_(model, step.config)
    assert model[0].weight.scale.dtype == torch.bfloat16


@pytest.mark.fast
def test_group_wise_fake_quantization_computes_the_deployed_bf16_weights_bit_for_bit():
    import copy

    from torchao.quantization import quantize_

    from qharness.recipes.registry import load_recipe
    from qharness.upstream.fixes import xnnpack_bf16_scales

    (step, _) = load_recipe("xnnpack_8da4w").make_quantizer(is_qat=False).configs  # the recipe's linears, its table
    assert step.config.weight_scale_dtype == torch.bfloat16
    fp = _group_linear(None)  # its float weights (quantized below, two ways)
    fp[0].weight = torch.nn.Parameter(fp[0].weight.dequantize())
    deployed, trained = copy.deepcopy(fp), copy.deepcopy(fp)
    quantize_(deployed, step.config)
    quantize_(trained, xnnpack_bf16_scales.qat_config(step.config))
    assert deployed[0].weight.scale.dtype == torch.bfloat16
    fake = trained[0].weight_fake_quantizer(trained[0].weight)
    assert torch.equal(fake, deployed[0].weight.dequantize())  # QAT trains the weights the .pte computes with


class _TanhGelu(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.gelu(3 * x, approximate="tanh")


def test_upstream_xnnpack_still_computes_tanh_gelu_as_erf():
    """executorch PR #22851 (after 1.5.1): when this fails, XNNPACK computes the tanh form: retire xnnpack_gelu_tanh."""
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    got = _run_pte(_lower(_TanhGelu(), x), x)
    erf = torch.nn.functional.gelu(3 * x)
    assert (got - erf).abs().max() < 1e-5 < (got - _TanhGelu()(x)).abs().max()


def test_tanh_gelu_as_its_formula_computes_the_tanh_form_on_xnnpack():
    from qharness.upstream.fixes import xnnpack_gelu_tanh

    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    graph = torch.export.export(_TanhGelu(), (x,)).module()
    assert xnnpack_gelu_tanh.decompose_tanh_gelu(graph) == 1
    want = _TanhGelu()(x)
    assert (graph(x) - want).abs().max() < 1e-5  # the formula is the tanh form, in PyTorch
    got = _run_pte(_lower(graph, x), x)
    assert (got - want).abs().max() < 1e-5  # and on XNNPACK


class _NormThenLinear(torch.nn.Module):
    """An RMSNorm (eps 1e-6) then a 4-bit linear 1024 inputs wide: the path an embedding row takes to a gated MLP's
    down projection."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _wide_group_linear():
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(1024, 64, bias=False))
    quantize_(
        linear, Int8DynamicActivationIntxWeightConfig(torch.int4, PerGroup(32), weight_scale_dtype=torch.bfloat16)
    )
    return _NormThenLinear(linear)


def _cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``), empty where there is none."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


def test_upstream_xnnpack_still_computes_a_wide_all_zero_row_as_nonzero():
    """When this fails, XNNPACK computes an all-zero activation row of a 4-bit matmul as 0: retire xnnpack_zero_rows.

    Which kernel runs depends on the CPU: the AVX-512 ones (Intel Xeon with AVX-512 VNNI and AMX, and the machines
    before it) give ~3e-5; the AVX2 one (AMD EPYC Zen 2, no AVX-512) already gives 0, where the workaround is
    harmless. A CPU of either kind that does otherwise fails here, naming itself."""
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(1))
    x[1] = 0
    model = _wide_group_linear()
    got = _run_pte(_lower(model, x), x)
    assert torch.equal(model(x)[1], torch.zeros(64))  # the converted model's zeros
    avx512 = "avx512f" in _cpu_flags()
    where = f"this CPU ({'with' if avx512 else 'without'} AVX-512)"
    if avx512:
        assert got[1].abs().max() > 1e-6, f"XNNPACK computed the zero row as 0 on {where}: retire xnnpack_zero_rows"
    else:
        assert got[1].abs().max() == 0, f"XNNPACK's kernel on {where} computed the zero row as {got[1].abs().max()}"


def test_a_nudged_zero_row_computes_as_the_converted_model_does():
    """``nudge_zero_rows``: an all-zero embedding row (only it, ties included) holds +-2**-40, and through a norm and
    a wide 4-bit matmul on XNNPACK comes out as the converted model computes it (~1e-10), not ~3e-5."""
    from qharness.upstream.fixes.xnnpack_zero_rows import TINY, nudge_zero_rows

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(6, 1024)
    model.head = torch.nn.Linear(1024, 6, bias=False)
    model.head.weight = model.embed.weight  # tied: one table, nudged once
    with torch.no_grad():
        model.embed.weight[[0, 4]] = 0
    before = model.embed.weight.detach().clone()
    assert nudge_zero_rows(model) == {"embed": [0, 4]} and nudge_zero_rows(model) == {}
    after = model.embed.weight.detach()
    assert torch.equal(after[[1, 2, 3, 5]], before[[1, 2, 3, 5]])
    assert torch.equal(after[0].abs(), torch.full((1024,), TINY)) and after[0, 0] == -after[0, 1]
    x = torch.cat([torch.randn(1, 1024, generator=torch.Generator().manual_seed(1)), after[:1]])
    norm_linear = _wide_group_linear()
    got, want = _run_pte(_lower(norm_linear, x), x), norm_linear(x)
    assert (got[1] - want[1]).abs().max() < 1e-12 and want[1].abs().max() < 1e-6


_SDPA_GEMM_THREADS = """
import sys, torch
from qharness.runtime.pte import PteModel, set_runtime_threads
set_runtime_threads(2)
model = PteModel(sys.argv[1])
print("RUN", flush=True)
model(torch.randint(0, 100, (1, 8)), 0)
"""


def _sdpa_gemm_threads(pte, env: dict) -> set[str]:
    """The MKL thread counts (``NThr:k``) of the ``sgemm`` calls a ``.pte``'s prefill makes in a fresh process."""
    import os
    import re
    import subprocess
    import sys

    env = dict(os.environ, MKL_VERBOSE="1", MKL_DYNAMIC="FALSE", **env)
    r = subprocess.run([sys.executable, "-c", _SDPA_GEMM_THREADS, str(pte)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    run = r.stdout.split("RUN", 1)[1]
    return set(re.findall(r"SGEMM\(.*NThr:(\d+)", run))


def test_upstream_custom_sdpa_still_nests_mkl_threads(fitted):
    """When this fails, ExecuTorch's custom_sdpa in the Python runtime stopped calling MKL with a thread team of its
    own from inside its threadpool (pytorch/executorch#20267): drop process.pte_process_env."""
    assert _sdpa_gemm_threads(fitted[0] / "model.pte", {"MKL_NUM_THREADS": "2"}) == {"2"}


def test_a_pte_process_runs_the_attentions_gemms_single_threaded(fitted):
    from qharness.upstream import process

    assert _sdpa_gemm_threads(fitted[0] / "model.pte", process.pte_process_env()) == {"1"}


@pytest.mark.fast
def test_a_pte_benchmark_process_gets_that_environment_and_an_eager_one_does_not(monkeypatch):
    import subprocess

    from qharness.runtime import measure

    envs = []

    def fake_run(cmd, **kwargs):
        envs.append(kwargs["env"])
        return subprocess.CompletedProcess(cmd, 0, stdout="{}\n", stderr="")

    monkeypatch.setattr(measure.subprocess, "run", fake_run)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    measure.measure_in_fresh_process(kind="pte", path="m.pte")
    measure.measure_in_fresh_process(kind="eager", path="m")
    assert envs[0]["MKL_NUM_THREADS"] == "1" and "MKL_NUM_THREADS" not in envs[1]
