"""HF architectures beyond Llama: tiny random configs saved with save_pretrained, loaded like real checkpoints.

Default suite: the architecture check, one train step + deploy quantization of Gemma2 (no lowering), and Gemma2 and
OLMo2 lowered on the fast path with xnnpack_8da4w through the parity gate (tests/test_fastpath.py checks every family
of ``FAST_FAMILIES`` takes the fast path with the model's own logits, without lowering).
``-m slow``: every other family of ``FAST_FAMILIES`` lowered and gated (xnnpack_fp32 and xnnpack_8da4w), the stage
test for Qwen2 (tied) and Phi-3, and CLI ``fit``/``calibrate`` of Qwen2, Gemma2, Phi-3, Mistral, Qwen3 and Gemma
with lowering and the runtime parity gate.
"""

import copy
import json

import pytest
import test_fastpath
import torch
from conftest import make_tiny_hf, run_cli, write_config

from qharness.deploy.architectures import check_architecture, probe_config
from qharness.errors import UserError
from qharness.sources.models import load_model_and_tokenizer
from qharness.training.module import QuantLM

# (model_type, tie_word_embeddings or None for the family's default, extra config)
FAMILIES = {
    "qwen2-tied": ("qwen2", True, {}),
    "gemma2": ("gemma2", None, {"sliding_window": 8}),  # tied; alternating sliding/full attention, logit soft-capping
    "phi3": ("phi3", False, {}),  # fused qkv and gate_up projections
    "mistral": ("mistral", False, {}),
    "qwen3": ("qwen3", False, {}),  # q/k norms
    "lfm2": ("lfm2", None, {"head_dim": None, "layer_types": ["conv", "full_attention"]}),  # a convolution state
    "qwen3_5": ("qwen3_5_text", None, test_fastpath.DELTANET),  # gated DeltaNet: a convolution and a recurrent state
    "falcon_h1": ("falcon_h1", None, test_fastpath.FAMILIES["falcon_h1"]),  # Mamba2 beside attention in each layer
    "granitemoehybrid": ("granitemoehybrid", None, test_fastpath.FAMILIES["granitemoehybrid"]),  # Mamba2, then MoE
}


@pytest.fixture(scope="session")
def text(corpus):
    return corpus.read_text()[:200_000]


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory, text):
    made = {}

    def get(name, layers=1):
        if (name, layers) not in made:
            model_type, tie, extra = FAMILIES[name] if name in FAMILIES else (name, None, {})
            made[name, layers] = make_tiny_hf(
                tmp_path_factory.mktemp(name), model_type, text, layers=layers, tie=tie, **extra
            )
        return made[name, layers]

    return get


@pytest.mark.fast
def test_probe_config_keeps_one_layer_of_each_type():
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "gemma2", num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    assert config.layer_types == ["sliding_attention", "full_attention"] * 3
    probe = probe_config(config)
    assert probe.num_hidden_layers == 2 and probe.layer_types == ["sliding_attention", "full_attention"]
    assert probe.hidden_size == 64 and config.num_hidden_layers == 6  # widths kept, original untouched
    llama = probe_config(AutoConfig.for_model("llama", num_hidden_layers=5))
    assert llama.num_hidden_layers == 1


def _save_config_only(path, model_type, **kwargs):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type, **kwargs).save_pretrained(path)
    return str(path)


@pytest.mark.fast
@pytest.mark.parametrize(
    "model_type, kwargs, reason",
    [
        ("t5", dict(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2), "it is an encoder-decoder"),
        (
            "mamba",
            dict(vocab_size=64, hidden_size=16, num_hidden_layers=1),
            "keeps a recurrent .SSM. state",
        ),
        ("distilbert", dict(vocab_size=64, dim=16, n_layers=1, n_heads=2, hidden_dim=32), "has no causal-LM class"),
    ],
)
def test_unsupported_architecture_is_refused_with_the_reason(tmp_path, model_type, kwargs, reason):
    source = _save_config_only(tmp_path / model_type, model_type, **kwargs)
    with pytest.raises(UserError, match=reason) as e:
        check_architecture(source)
    assert f"model_type '{model_type}'" in str(e.value)


HYBRID = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


@pytest.mark.fast
@pytest.mark.parametrize(
    "model_type, kwargs, kinds",
    [
        ("jamba", {}, "linear_attention"),  # layers_block_type: a property derived from other settings
        ("falcon_mamba", {}, "linear_attention"),
        ("recurrent_gemma", {}, "linear_attention"),
        ("minimax", {}, "linear_attention"),  # lightning attention: a cache of its own, the model not marked stateful
        ("kimi_linear", dict(pad_token_id=0), "linear_attention"),  # (its default pad id is past this vocabulary)
        ("bailing_hybrid", dict(pad_token_id=0), "linear_attention"),
    ],
)
def test_recurrent_states_no_route_carries_are_refused_in_one_line_naming_what_is_missing(
    tmp_path, model_type, kwargs, kinds
):
    """Models whose layers keep a recurrence the fast path does not carry (Mamba1's per-channel selective scan,
    RecurrentGemma's): refused before any work, in one line naming the layers and the missing piece, with a fix
    that can help (the hybrids it carries, Mamba2's among them); never a traceback from the one-layer-per-type
    probe."""
    source = _save_config_only(tmp_path / model_type, model_type, **HYBRID, **kwargs)
    with pytest.raises(UserError, match=f"in its .*{kinds}.* layers; .*not yet this layer's recurrence") as e:
        check_architecture(source)
    assert "Falcon-H1" in e.value.fix and "Qwen3.5" in e.value.fix and "\n" not in str(e.value)


@pytest.mark.fast
@pytest.mark.parametrize(
    "model_type, kwargs",
    [
        ("lfm3", dict(pad_token_id=0)),
        ("lfm2", dict(layer_types=["conv", "conv"])),
        ("granitemoehybrid", dict(layer_types=["mamba"] * 2)),
    ],
)
def test_a_hybrid_config_without_an_attention_layer_is_refused_in_one_line(tmp_path, model_type, kwargs):
    """A tiny LFM3 (two layers: its default layer_types are both conv) or any hybrid of recurrent layers only:
    transformers' own cache refuses it, so it is refused before any work with the fix that helps, not as a recipe
    that cannot deploy it."""
    source = _save_config_only(tmp_path / model_type, model_type, **HYBRID, **kwargs)
    with pytest.raises(UserError, match=r"its layer_types \(.*\) hold no attention layer") as e:
        check_architecture(source)
    assert "full_attention" in e.value.fix and "\n" not in str(e.value)


@pytest.mark.fast
def test_probe_cuts_the_configs_own_per_layer_fields_only():
    from transformers import AutoConfig

    falcon = AutoConfig.for_model("falcon_h1", **HYBRID)  # time_step_limit has 2 entries: not per layer
    probe = probe_config(falcon)
    assert probe.time_step_limit == falcon.time_step_limit and probe.num_hidden_layers == 1
    lfm2 = AutoConfig.for_model("lfm2", **HYBRID, layer_types=["conv", "full_attention"])
    assert probe_config(lfm2).layer_types == ["conv", "full_attention"]
    three = AutoConfig.for_model(
        "lfm2", **dict(HYBRID, num_hidden_layers=3), layer_types=["conv", "full_attention", "conv"]
    )
    assert probe_config(three).layer_types == ["conv", "full_attention"]


@pytest.mark.fast
def test_a_config_the_probe_cannot_build_is_refused_in_one_line(tmp_path, monkeypatch):
    import qharness.deploy.architectures as arch

    source = _save_config_only(tmp_path / "lfm2", "lfm2", **HYBRID, layer_types=["conv", "full_attention"])
    monkeypatch.setattr(arch, "probe_config", lambda config: (_ for _ in ()).throw(AttributeError("no setter")))
    with pytest.raises(
        UserError, match="cannot build a copy of it with one layer of each type .AttributeError: no setter."
    ):
        check_architecture(source)


@pytest.mark.fast
def test_a_failing_trace_is_refused_and_a_success_is_remembered(tmp_path, family_dir, monkeypatch):
    import qharness.deploy.architectures as arch

    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    source = str(family_dir("mistral"))

    def broken(model):
        raise RuntimeError("Dynamo failed to run FX node")

    monkeypatch.setattr(arch, "_trace", broken)
    with pytest.raises(
        UserError, match="MistralForCausalLM cannot be exported with torch.export .RuntimeError: Dynamo failed"
    ):
        check_architecture(source)
    monkeypatch.undo()
    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    check_architecture(source)
    assert len(list((tmp_path / "cache" / "architectures").iterdir())) == 1
    monkeypatch.setattr(arch, "_trace", broken)
    check_architecture(source)  # remembered: not traced again


@pytest.mark.fast
def test_models_that_differ_only_in_what_the_probe_drops_share_one_deploy_check(tmp_path, monkeypatch):
    """The deploy probe's success is keyed by the one-layer, small-vocabulary copy it deploys, the recipe and the
    cache length: a deeper model with a larger vocabulary in another folder is not probed again (each tiny model of
    the test suite was probed anew for its folder), while another width, recipe or cache length is."""
    import qharness.deploy.architectures as arch
    from qharness.recipes.registry import load_recipe

    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "cache"))
    deployed = []
    monkeypatch.setattr(arch, "_deploy", lambda model, recipe, msl: deployed.append((model.config.hidden_size, msl)))
    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    small = _save_config_only(tmp_path / "a", "llama", num_hidden_layers=2, vocab_size=384, **shape)
    large = _save_config_only(tmp_path / "b", "llama", num_hidden_layers=6, vocab_size=1024, **shape)
    wider = _save_config_only(
        tmp_path / "c", "llama", num_hidden_layers=2, vocab_size=384, **{**shape, "hidden_size": 128}
    )
    int8, fp32 = load_recipe("xnnpack_int8_dynamic"), load_recipe("xnnpack_fp32")
    check_architecture(small, recipe=int8, max_seq_len=64)
    check_architecture(large, recipe=int8, max_seq_len=64)
    assert deployed == [(64, 64)]
    check_architecture(wider, recipe=int8, max_seq_len=64)
    check_architecture(small, recipe=fp32, max_seq_len=64)
    check_architecture(small, recipe=int8, max_seq_len=32)
    assert deployed == [(64, 64), (128, 64), (64, 64), (64, 32)]


@pytest.mark.parametrize(
    "name", ["gemma2", pytest.param("qwen2-tied", marks=pytest.mark.slow), pytest.param("phi3", marks=pytest.mark.slow)]
)
def test_family_trains_and_quantizes_for_deploy(name, family_dir):
    """export_for_training + prepare_qat_pt2e + a train step, weights back into HF, static-cache deploy graph
    (convert_pt2e) close to the trained fake-quant graph."""
    from qharness.deploy.fastpath.twin import all_logits_twin
    from qharness.deploy.lower import quantize_for_deploy

    source = str(family_dir(name))
    fp, _ = load_model_and_tokenizer(source)
    assert fp.config.num_key_value_heads < fp.config.num_attention_heads  # grouped-query attention
    assert fp.config.tie_word_embeddings == (fp.lm_head.weight is fp.get_input_embeddings().weight)
    m = QuantLM(checkpoint=source, recipe="xnnpack_int8_dynamic", mode="qat", lr=1e-3)
    m.build(2, 16)
    m.to_train()
    x = torch.randint(0, fp.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(m.graph.parameters(), lr=1e-2)
    loss = m.loss((x[:, :-1], x[:, 1:]))
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in m.graph.parameters())
    opt.step()
    m.to_eval()
    trained = copy.deepcopy(fp)
    m.load_into(trained)
    assert not torch.equal(trained.get_input_embeddings().weight, fp.get_input_embeddings().weight)
    deployed = quantize_for_deploy(trained, m.recipe, 32, lambda g: g(x[:1, :16], torch.tensor([0])))
    with torch.no_grad():
        fq = m.graph(x[:, :16])[:1]
        dep = all_logits_twin(deployed)(x[:1, :16], torch.tensor([0]))  # fast path: every position, not the last
        assert dep.shape == fq.shape
        before, after = fp(input_ids=x[:1, :16]).logits, trained(input_ids=x[:1, :16]).logits
    noise = (fq - after).abs().max()  # what fake quantization itself changes in the trained model's logits
    top2 = fq[0].topk(2, -1).values
    decided = (top2[:, 0] - top2[:, 1]) >= 0.01  # near ties (a random tiny model has some) may go either way
    assert decided.sum() >= 12
    assert (fq.argmax(-1) == dep.argmax(-1))[0][decided].float().mean() >= 0.9
    assert (fq - dep).abs().max() < 3 * noise < (after - before).abs().max()


@pytest.mark.slow  # ~100 s; the default suite keeps the Gemma2 stage test (export, QAT step, deploy graph)
def test_qwen2_fits_through_the_cli_to_a_pte_that_passes_parity(tmp_path, family_dir, corpus):
    """Qwen2 (untied embeddings, GQA, q/k/v biases) end to end through the real CLI, like a real checkpoint dir."""
    source = family_dir("qwen2")
    config = json.loads((source / "config.json").read_text())
    assert config["model_type"] == "qwen2" and not config["tie_word_embeddings"] and config["num_key_value_heads"] == 2
    cfg = write_config(
        tmp_path / "q.yaml",
        source,
        corpus,
        tmp_path / "run",
        data={"seq_len": 16, "batch_size": 2},
        trainer={"max_steps": 2, "val_check_interval": 2, "limit_val_batches": 1},
        checkpoint={"every_n_train_steps": 2},
        deploy={"max_seq_len": 32},
        bench={"enabled": False},
        parity={"eval_blocks": 2, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
    )
    r = run_cli("fit", cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parity"]["passed"] and set(summary["metrics"]) == {"fp", "fake_quant", "converted", "pte"}
    assert (tmp_path / "run" / "model.pte").is_file() and (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()


# --- slow: every family through the CLI, with lowering and the runtime parity gate -----------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, command",
    [
        ("gemma2", "fit"),
        ("phi3", "fit"),
        ("mistral", "fit"),
        ("qwen3", "fit"),
        ("lfm2", "fit"),
        ("qwen3_5", "fit"),
        ("falcon_h1", "fit"),
        ("granitemoehybrid", "fit"),
        ("gemma", "calibrate"),
    ],
)
def test_family_through_the_cli(name, command, tmp_path, family_dir, corpus):
    source = family_dir(name, layers=2)
    cfg = write_config(
        tmp_path / "c.yaml",
        source,
        corpus,
        tmp_path / "run",
        model={"mode": "qat" if command == "fit" else "ptq"},
        bench={"enabled": False},
        trainer={"max_steps": 4, "val_check_interval": 2, "limit_val_batches": 1},
    )
    r = run_cli(command, cfg)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parity"]["passed"] and summary["parity"]["argmax_agreement"] >= 0.9


# --- the fast path for every family: a lowered .pte through the parity gate ------------------------------------
# The list of families, with test_fastpath's tiny configs (2 layers, windows of 8 shorter than the 64-position
# cache, soft-capping as configured).
FAST_FAMILIES = {
    f: test_fastpath.FAMILIES[f]
    for f in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "stablelm")
}


DEFAULT_PARITY = {("olmo2", "xnnpack_8da4w")}  # gemma2 deploys and passes parity in the default suite in test_families


@pytest.mark.parametrize(
    "family, recipe_name",
    [  # ~10-30 s each: the default suite keeps one, quantized (the rest: -m slow)
        pytest.param(f, recipe, marks=() if (f, recipe) in DEFAULT_PARITY else pytest.mark.slow)
        for recipe in ("xnnpack_fp32", "xnnpack_8da4w")
        for f in sorted(FAST_FAMILIES)
    ],
)
def test_family_pte_takes_the_fast_path_and_passes_parity(family, recipe_name, tmp_path):
    """The .pte against the converted graph it was lowered from, as the pipeline's gate judges it: prefill +
    greedy decode (``compare_decoding``) and perplexity over blocks."""
    from qharness.checks.parity import compare_decoding, fold_constants, gate, score_deployed
    from qharness.config import ParityConfig
    from qharness.deploy.deployed import export_path, fallback_reason
    from qharness.deploy.fastpath.twin import all_logits_twin
    from qharness.deploy.lower import lower_to_pte, quantize_for_deploy, runner_metadata
    from qharness.recipes.registry import load_recipe
    from qharness.runtime.pte import PteModel

    model, recipe, cache = test_fastpath._tiny(family, **FAST_FAMILIES[family]), load_recipe(recipe_name), 64
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (3, 25), generator=torch.Generator().manual_seed(0))
    deployed = quantize_for_deploy(model, recipe, cache, lambda g: [g(b[None, :24], torch.tensor([0])) for b in x])
    assert export_path(deployed) == "fast", fallback_reason(deployed)
    (tmp_path / "m.pte").write_bytes(lower_to_pte(deployed, recipe, cache, runner_metadata(cache, vocab, 1, [2])))
    reference = fold_constants(deployed)
    scorer = all_logits_twin(reference)
    pte = PteModel(tmp_path / "m.pte")
    ref = lambda tokens, start: reference(tokens, torch.tensor([start]))  # noqa: E731
    figures = compare_decoding(pte, ref, x[:2, :12], decode_steps=16, tie_margin=ParityConfig().tie_margin)
    ppl = {
        name: score_deployed(step, x[:, :-1], x[:, 1:])["ppl"]
        for name, step in (("pte", pte), ("converted", lambda t, s: scorer(t, torch.tensor([s]))))
    }
    figures["ppl_rel_diff"] = abs(ppl["pte"] - ppl["converted"]) / ppl["converted"]
    assert gate(figures, ParityConfig()) == [], figures
    assert figures["max_abs_diff"] < 1e-3 if recipe_name == "xnnpack_fp32" else True
