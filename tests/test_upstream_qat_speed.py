"""qharness/upstream/qat_speed.py: torchao's fake quantizers in fewer passes compute torchao's values and gradients
bit for bit (these tests compare against torchao's own modules, so they fail once torchao's numerics change)."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.fast


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN compares equal to itself, -0.0 differs from 0.0)."""
    return t.detach().contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _pair(config):
    """torchao's fake quantizer (with ``fixes/torchao_zero_groups``, as training has it) and the fast one."""
    from torchao.quantization.qat import IntxFakeQuantizer

    from qharness.upstream import qat_speed
    from qharness.upstream.fixes import torchao_zero_groups

    torchao_zero_groups.install()
    fast = IntxFakeQuantizer(config)
    fast.__class__ = qat_speed._fast_class(IntxFakeQuantizer)
    return IntxFakeQuantizer(config), fast


def _values_and_grads(fq, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = fq(x)
    (g,) = torch.autograd.grad(out, x, grad)
    return out, g


def _hard_weights(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random weights with the cases the rounding must agree on: an all-zero group, a group of -0.0, values on the
    .5 boundaries of the 4-bit grid, a constant group, tiny (subnormal) values."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.05
    w[0, :32] = 0.0
    w[1, :32] = -0.0
    w[2, :32] = torch.linspace(-7.5, 7.5, 32) * 0.01
    w[3, :32] = 0.3
    w[4, :32] = torch.randn(32, generator=gen) * 1e-39
    return w


@pytest.mark.parametrize(
    "dtype,group,scale_dtype",
    [
        (torch.int4, 32, torch.bfloat16),  # xnnpack_8da4w's linears
        (torch.int2, 32, torch.bfloat16),
        (torch.int3, 64, torch.bfloat16),
        (torch.int4, 32, None),  # the embedding table's config (float32 scales)
        (torch.int8, None, None),  # per channel
        (torch.int4, None, None),
    ],
)
def test_fast_group_wise_fake_quantization_is_torchaos_bit_for_bit(dtype, group, scale_dtype):
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.qat import IntxFakeQuantizeConfig

    granularity = PerAxis(0) if group is None else PerGroup(group)
    kwargs = {} if scale_dtype is None else {"scale_precision": scale_dtype}
    config = IntxFakeQuantizeConfig(dtype, granularity=granularity, is_symmetric=True, **kwargs)
    upstream, fast = _pair(config)
    w = _hard_weights(48, 192)
    grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
    (a, ga), (b, gb) = _values_and_grads(upstream, w, grad), _values_and_grads(fast, w, grad)
    assert _same(a, b) and _same(ga, gb)
    assert _same(upstream.scale, fast.scale) and torch.equal(upstream.zero_point, fast.zero_point)
    assert (ga == 0).any() and (ga != 0).any()  # the clamp's mask did zero some gradients (the +7.5 boundary)
    with torch.no_grad():  # validation: the same values without the autograd function
        assert _same(fast(w), a)


def test_fast_per_token_fake_quantization_is_torchaos_bit_for_bit():
    from torchao.quantization.qat import IntxFakeQuantizeConfig

    upstream, fast = _pair(IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 17, 96, generator=gen)
    x[0, 0] = 0.0  # an all-zero token (scale 1: fixes/torchao_zero_groups)
    x[0, 1] = 2.5  # a constant token
    x[1, 2, 5] = 80.0  # an outlier
    x[2, 3] = x[2, 3].abs()  # no negative value (zero point at the range's end)
    grad = torch.randn(x.shape, generator=gen)
    (a, ga), (b, gb) = _values_and_grads(upstream, x, grad), _values_and_grads(fast, x, grad)
    assert _same(a, b) and _same(ga, gb)
    assert _same(upstream.scale, fast.scale) and torch.equal(upstream.zero_point, fast.zero_point)


def test_fast_fake_quantization_keeps_torchaos_nan_handling():
    from torchao.quantization.qat import IntxFakeQuantizeConfig

    upstream, fast = _pair(IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=True))
    w = _hard_weights(8, 64)
    w[5, 3], w[6, 40] = float("nan"), float("inf")
    grad = torch.ones_like(w)
    (a, ga), (b, gb) = _values_and_grads(upstream, w, grad), _values_and_grads(fast, w, grad)
    assert _same(a, b) and _same(ga, gb)


def test_configs_the_fast_path_does_not_cover_run_torchaos_forward():
    from torchao.quantization.qat import IntxFakeQuantizeConfig

    from qharness.upstream import qat_speed

    x = torch.randn(4, 64)
    symmetric_token = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=True)
    asymmetric_group = IntxFakeQuantizeConfig(torch.int4, group_size=32, is_symmetric=False)
    learned = IntxFakeQuantizeConfig(
        torch.int4, group_size=32, is_symmetric=True, is_dynamic=False, range_learning=True
    )
    for config in (symmetric_token, asymmetric_group, learned):
        assert qat_speed._fast_kind(config, x) is None
    assert qat_speed._fast_kind(asymmetric_group, x.bfloat16()) is None
    assert qat_speed._fast_kind(IntxFakeQuantizeConfig(torch.int4, group_size=32), x.t()) is None  # not contiguous
    upstream, fast = _pair(asymmetric_group)
    assert _same(upstream(x), fast(x))


def _tables(padding_idx):
    from qharness.recipes import embedding
    from qharness.upstream import qat_speed

    table = torch.nn.Sequential(torch.nn.Embedding(300, 64, padding_idx=padding_idx))
    with torch.no_grad():
        table[0].weight.copy_(_hard_weights(300, 64, seed=3))
    upstream = copy.deepcopy(table)
    embedding.quantizer(embedding.EmbeddingQuant(4, 32)).prepare_qat(upstream)  # the recipes' 4-bit table
    fast = copy.deepcopy(upstream)
    assert qat_speed.install(fast) == 2  # the table and its fake quantizer
    return upstream, fast


@pytest.mark.parametrize("padding_idx", [None, 2, 299])
@pytest.mark.parametrize("tokens", [40, 1500])  # the lookup's backward sums rows serially below 1000 indices, else not
def test_rowwise_fake_quantized_embedding_is_torchaos_bit_for_bit(padding_idx, tokens):
    upstream, fast = _tables(padding_idx)
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, 40, (3, tokens // 3), generator=gen)  # many repeated rows
    x[0, :4] = 2  # the padding row (where there is one), looked up
    x[1, :2] = 0  # the all-zero row
    grad = torch.randn(*x.shape, 64, generator=gen)
    outs = []
    for model in (upstream, fast):
        model.zero_grad()
        out = model(x)
        out.backward(grad)
        outs.append((out, model[0].weight.grad))
    (a, ga), (b, gb) = outs
    assert _same(a, b) and _same(ga, gb)
    assert ga[40:].eq(0).all()  # rows not looked up: no gradient either way


def test_fake_quantized_model_trains_alike_with_and_without_the_fast_path(monkeypatch):
    """A tied tiny Llama through ``prepare_for_training`` (xnnpack_8da4w: linears, the 4-bit table, the tied head):
    logits and every gradient bit for bit; ``QHARNESS_UPSTREAM_QAT=1`` trains torchao's own modules."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qharness.recipes.registry import load_recipe
    from qharness.training.prepare import prepare_for_training
    from qharness.upstream import qat_speed

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[5].zero_()
    recipe = load_recipe("xnnpack_8da4w")
    monkeypatch.setenv("QHARNESS_UPSTREAM_QAT", "1")
    upstream = prepare_for_training(copy.deepcopy(model), recipe, 2, 48, is_qat=True)
    assert not any(type(m).__name__.startswith(("Fast", "Rowwise")) for m in upstream.modules())
    monkeypatch.delenv("QHARNESS_UPSTREAM_QAT")
    fast = prepare_for_training(copy.deepcopy(model), recipe, 2, 48, is_qat=True)
    assert sum(type(m).__name__.startswith(("Fast", "Rowwise")) for m in fast.modules()) == 32
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(5))
    x[0, :3] = 5
    results = []
    for graph in (upstream, fast):
        logits = graph(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        results.append((logits, {n: p.grad for n, p in graph.named_parameters()}))
    (a, grads_a), (b, grads_b) = results
    assert _same(a, b)
    assert grads_a.keys() == grads_b.keys() and all(_same(grads_a[n], grads_b[n]) for n in grads_a)
    assert qat_speed.upstream_qat() is False


@pytest.mark.parametrize("mapping", ["symmetric", "symmetric_no_clipping_err"])
def test_fast_fake_quantized_weights_are_the_deployed_weights_bit_for_bit(mapping):
    from torchao.quantization import quantize_

    from qharness.recipes.torchao import Torchao8da4wSettings, torchao_8da4w
    from qharness.upstream import qat_speed
    from qharness.upstream.fixes import xnnpack_bf16_scales

    (step,) = torchao_8da4w(Torchao8da4wSettings(weight_mapping=mapping), is_qat=False).configs
    fp = torch.nn.Sequential(torch.nn.Linear(128, 48, bias=False))
    with torch.no_grad():
        fp[0].weight.copy_(_hard_weights(48, 128, seed=6))
    deployed, trained = copy.deepcopy(fp), copy.deepcopy(fp)
    quantize_(deployed, step.config)
    quantize_(trained, xnnpack_bf16_scales.qat_config(step.config))
    assert qat_speed.install(trained) == 2  # the weight's and the activation's fake quantizers
    fake = trained[0].weight_fake_quantizer(trained[0].weight)
    assert _same(fake, deployed[0].weight.dequantize())


def test_no_clipping_scales_put_each_groups_extreme_on_a_code():
    """``weight_mapping: symmetric_no_clipping_err``: a group whose negative extreme dominates gets scale ``-min / 8``
    (the extreme is code -8, as llama.cpp's Q4_0 puts it), one whose positive extreme does ``max / 7``; nothing is
    clipped. ``symmetric`` clips the positive extreme (``max|w| / 7.5``)."""
    from torchao.quantization import quantize_

    from qharness.recipes.torchao import Torchao8da4wSettings, torchao_8da4w

    w = torch.zeros(2, 32)
    w[0, 0], w[0, 1] = -1.6, 0.5  # negative extreme
    w[1, 0], w[1, 1] = 1.4, -0.2  # positive extreme
    out = {}
    for mapping in ("symmetric", "symmetric_no_clipping_err"):
        (step,) = torchao_8da4w(Torchao8da4wSettings(weight_mapping=mapping), is_qat=False).configs
        m = torch.nn.Sequential(torch.nn.Linear(32, 2, bias=False))
        with torch.no_grad():
            m[0].weight.copy_(w)
        quantize_(m, step.config)
        out[mapping] = m[0].weight.dequantize()
    exact = out["symmetric_no_clipping_err"]
    assert exact[0, 0].item() == pytest.approx(-1.6, rel=1e-2) and exact[1, 0].item() == pytest.approx(1.4, rel=1e-2)
    assert out["symmetric"][1, 0].item() == pytest.approx(1.4 * 7 / 7.5, rel=1e-2)  # clipped to code 7


def test_no_clipping_is_refused_where_its_scales_would_not_hold():
    from qharness.errors import UserError
    from qharness.recipes.torchao import Torchao8da4wSettings

    for bad in ({"learn_scales": True}, {"choose_qparams": "hqq_scale_only"}):
        with pytest.raises(UserError, match="weight_mapping: symmetric"):
            Torchao8da4wSettings(weight_mapping="symmetric_no_clipping_err", **bad)
    with pytest.raises(UserError, match="weight_mapping 'sym' is unknown"):
        Torchao8da4wSettings(weight_mapping="sym")


def test_no_clipping_fake_quantization_never_falls_back_to_torchaos_forward():
    """torchao's own forward would compute a no-clipping config as asymmetric: torchao's module computes what the
    swapped one does (``route_no_clipping``), and a bf16 weight is refused."""
    from torchao.quantization.qat import IntxFakeQuantizer

    from qharness.recipes.torchao import Torchao8da4wSettings, torchao_8da4w
    from qharness.upstream import qat_speed
    from qharness.upstream.fixes import xnnpack_bf16_scales

    (step,) = torchao_8da4w(Torchao8da4wSettings(weight_mapping="symmetric_no_clipping_err"), is_qat=True).configs
    _, weight = xnnpack_bf16_scales.fake_quantize_configs(step.config)
    w, outs = torch.randn(4, 64), []
    for swapped in (False, True):  # torchao's own module, or swapped by qat_speed.install
        fq = IntxFakeQuantizer(weight)
        if swapped:
            fq.__class__ = qat_speed._fast_class(IntxFakeQuantizer)
        outs.append(fq(w))
        with pytest.raises(RuntimeError, match="asymmetric"):
            fq(torch.randn(4, 64, dtype=torch.bfloat16))
    assert _same(outs[0], outs[1])
    groups = w.view(4, 2, 32)
    scale = torch.maximum(groups.amin(-1).clamp(max=0) / -8, groups.amax(-1).clamp(min=0) / 7)
    assert ((outs[0].view(4, 2, 32) - groups).abs() <= scale[..., None] * 0.51).all()  # nothing clipped


def test_upstream_torchao_still_refuses_no_clipping_fake_quantization():
    """``route_no_clipping`` exists because torchao 0.18's fake-quantize config refuses ``SYMMETRIC_NO_CLIPPING_ERR``
    (and its forward would compute a config that had it as asymmetric). When this fails, torchao takes it: check
    that its forward computes ``choose_qparams_affine``'s no-clipping scales, then drop ``route_no_clipping`` and set
    the mapping in ``fake_quantize_configs`` directly."""
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.quant_primitives import MappingType

    with pytest.raises(ValueError, match="not supported"):
        IntxFakeQuantizeConfig(torch.int4, PerGroup(32), MappingType.SYMMETRIC_NO_CLIPPING_ERR)
