"""A program's structure digest (``deploy/structure.py``): programs that differ only in weight values (what a PTQ, a
GPTQ and a QAT program of one recipe differ in) share it; another recipe's program does not."""

import hashlib

import pytest


def _deployed(recipe_name: str, seed: int, calibration_seed: int = 0):
    """(recipe, converted deploy graph) of a random-init 1-layer Llama (weights from ``seed``) quantized with
    ``recipe_name``, calibrated on tokens from ``calibration_seed``; a ``rounding: gptq`` recipe deploys GPTQ's
    weights and scales, as ``run/trained.with_rounding`` hands them over."""
    import torch

    from qharness.deploy.lower import quantize_for_deploy
    from qharness.recipes.gptq import gptq_round
    from qharness.recipes.registry import load_recipe
    from qharness.sources.embedded import EmbeddedSpec, new_llama
    from qharness.sources.models import put_weights

    torch.manual_seed(seed)
    spec = EmbeddedSpec(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = new_llama(spec, 128).eval()
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(calibration_seed))
    recipe = load_recipe(recipe_name)
    qparams = None
    if recipe.rounds_with_gptq:
        weights, qparams = gptq_round(model, recipe.make_quantizer(is_qat=False), tokens)
        put_weights(model, weights)
    return recipe, quantize_for_deploy(model, recipe, 32, lambda g: g(tokens[:1], torch.tensor([0])), qparams)


def _program(recipe_name: str, seed: int, calibration_seed: int = 0) -> tuple[str, str]:
    """(structure digest, sha256 of the .pte bytes) of ``_deployed``'s graph lowered."""
    from qharness.deploy.lower import lower_program, runner_metadata

    recipe, graph = _deployed(recipe_name, seed, calibration_seed)
    program = lower_program(graph, recipe, 32, runner_metadata(32, 128, 0, [0], True))
    return program.structure, hashlib.sha256(program.pte).hexdigest()


def test_graph_lines_leave_out_weights_scales_and_zero_points():
    """The rule on converted graphs (seconds, no lowering): int8 static activations calibrated on other tokens, with
    other weights, move the literal scales and zero points of the (de)quantize ops and every weight: one structure;
    dynamic activations (choose_qparams ops in place of literals) another."""
    from qharness.deploy.structure import graph_lines

    a = graph_lines(_deployed("xnnpack_int8_static", seed=0, calibration_seed=0)[1])
    b = graph_lines(_deployed("xnnpack_int8_static", seed=1, calibration_seed=1)[1])
    c = graph_lines(_deployed("xnnpack_int8_dynamic", seed=0)[1])
    assert any("quantized_decomposed" in line for line in a)
    assert a == b
    assert a != c


@pytest.fixture(scope="module")
def programs():
    return {
        "8da3w": _program("xnnpack_8da3w", seed=0),
        "8da3w other weights": _program("xnnpack_8da3w", seed=1),
        "8da3w GPTQ": _program("xnnpack_8da3w_gptq", seed=0),
        "8da4w": _program("xnnpack_8da4w", seed=0),
        "int8_static": _program("xnnpack_int8_static", seed=0, calibration_seed=0),
        "int8_static other weights and calibration": _program("xnnpack_int8_static", seed=1, calibration_seed=1),
        "int8_dynamic": _program("xnnpack_int8_dynamic", seed=0),
    }


@pytest.mark.slow
def test_programs_that_differ_only_in_weight_values_share_one_structure(programs):
    """Other weights (what QAT or GPTQ changes) give other bytes but one structure (GPTQ's scales and zero points
    too: its zero points were float, which made another structure); with static activations the
    calibration moves the literal scales and zero points of the (de)quantize ops, which are values, not kernels."""
    pairs = [("8da3w", "8da3w other weights"), ("8da3w", "8da3w GPTQ")]
    for a, b in pairs + [("int8_static", "int8_static other weights and calibration")]:
        assert programs[a][1] != programs[b][1], "the weights should differ"
        assert programs[a][0] == programs[b][0], f"{a} vs {b}"


@pytest.mark.slow
def test_another_recipe_gives_another_structure(programs):
    """Group-wise 4-bit weights vs per-channel int8, static vs dynamic activations: three structures. XNNPACK stores
    8da3w's 3-bit weights as int4 over 8da4w's range and runs 8da4w's kernels on them: one structure (one latency
    class), though the bytes differ."""
    digests = {programs[k][0] for k in ("8da4w", "int8_static", "int8_dynamic")}
    assert len(digests) == 3
    assert programs["8da3w"][0] == programs["8da4w"][0] and programs["8da3w"][1] != programs["8da4w"][1]
