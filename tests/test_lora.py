"""LoRA-QAT (``model.lora``): adapters on frozen base weights, fake-quantized merged (``W + (alpha/r) B A``), so the
trained fake-quant model is what deployment quantizes; only the adapters train; merged before deployment; through the
CLI with resume and the parity gate. Bad ``model.lora`` values are cases of test_bad_input.py."""

import json

import pytest
import torch
from conftest import run_cli, write_config

from qharness.errors import UserError
from qharness.schema.model import LoRA
from qharness.training.lora import check_merged_fake_quant, is_adapter, targets
from qharness.training.module import QuantLM

X = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
Y = torch.roll(X, -1, 1)


class FakeTrainer:
    global_step, estimated_stepping_batches = 0, 100


def _build(model_dir, recipe, **hp):
    m = QuantLM(checkpoint=str(model_dir), recipe=recipe, mode="qat", lr=1e-2, **hp)
    m.build(2, 16)
    m.trainer = FakeTrainer()
    m.to_train()
    return m


def _train(m, steps=3):
    """``steps`` AdamW steps on one batch; returns the optimizer."""
    opt = m.configure_optimizers()["optimizer"]
    for _ in range(steps):
        loss = m.loss((X, Y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


def _with_weights(plain, weights):
    """``plain`` (a full-QAT QuantLM) with ``weights`` (HF names) copied into its graph."""
    with torch.no_grad():
        for name, p in plain.graph.named_parameters():
            if name.startswith("model.") and name[len("model.") :] in weights:
                p.copy_(weights[name[len("model.") :]])
    return plain


@pytest.mark.fast
def test_lora_settings_are_checked():
    assert LoRA(targets=["q_proj"]).targets == ("q_proj",) and LoRA(rank=4, alpha=8).scale == 2.0
    assert LoRA().record() == {"rank": 8, "alpha": 16.0, "targets": list(LoRA().targets)}
    for bad, field in (
        (dict(rank=0), "rank must be an integer >= 1"),
        (dict(rank=2.5), "rank must be an integer >= 1"),
        (dict(alpha=-1.0), "alpha must be a positive number"),
        (dict(alpha=float("inf")), "alpha must be a positive number"),
        (dict(targets=[]), "targets must be a non-empty list"),
        (dict(targets="q_proj"), "targets must be a non-empty list"),
        (dict(targets=["q_proj", ""]), "targets must hold non-empty names"),
    ):
        with pytest.raises(UserError, match=f"model.lora.{field}"):
            LoRA(**bad)


@pytest.mark.fast
def test_targets_match_names_and_patterns_and_refuse_tied_weights(tiny_llama):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert len(targets(model, LoRA())) == 14  # 7 projections x 2 layers; lm_head is no default target
    names = [n for n, _ in targets(model, LoRA(targets=["q_proj", "model.layers.1.mlp.*"]))]
    assert names == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
    ]
    with pytest.raises(UserError, match=r"targets \['qproj'\] match no linear layer.*fix: name some of its.*q_proj"):
        targets(model, LoRA(targets=["q_proj", "qproj"]))
    with pytest.raises(UserError, match="lm_head.*tied to another parameter"):  # the tiny Llama ties it to embeddings
        targets(model, LoRA(targets=["lm_head"]))


@pytest.mark.parametrize("recipe", ["xnnpack_int8_dynamic", "xnnpack_8da4w"])  # PT2E graph; torchao source modules
def test_only_adapters_train_and_the_trained_model_is_full_qat_of_the_merged_weights(tiny_llama, recipe):
    """Step 0 equals full QAT bit for bit (B = 0); after training, the LoRA model equals the full-QAT model given the
    merged weights bit for bit (the fake quantization saw the merged weight), and the base weights did not move."""
    plain = _build(tiny_llama, recipe)
    m = _build(tiny_llama, recipe, lora={"rank": 4, "alpha": 8})
    assert m.hparams.lora == {"rank": 4, "alpha": 8.0, "targets": list(LoRA().targets)}
    with torch.no_grad():
        assert torch.equal(plain.graph(X), m.graph(X))
    trainable = [n for n, p in m.graph.named_parameters() if p.requires_grad]
    assert len(trainable) == 28 and all(is_adapter(n) for n in trainable)  # A and B of 14 layers, nothing else
    if recipe == "xnnpack_int8_dynamic":  # the exported graph: one weight fake-quant on each merged weight
        assert check_merged_fake_quant(m.graph) == 14
    base = {k: v.clone() for k, v in plain.trained_weights().items()}
    opt = _train(m)
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for n, p in m.graph.named_parameters() if is_adapter(n)
    }
    summary = m.lora_summary()
    # rank 4 x (in + out) per layer: q, o 64+64; k, v 64+32; gate, up, down 64+128; two decoder layers
    assert summary["layers"] == 14 and summary["trained_parameters"] == 2 * 4 * (2 * 128 + 2 * 96 + 3 * 192) == 8192
    assert summary["parameters"] == sum(p.numel() for p in m.graph.parameters())

    merged = m.trained_weights()
    assert set(merged) == set(base) and all(merged[k].shape == base[k].shape for k in base)  # what deployment takes
    moved = [k for k in base if not torch.equal(merged[k], base[k])]
    assert sorted(moved) == sorted(f"{n}.weight" for n in summary_targets(m))  # only adapted weights changed
    frozen = {n[len("model.") :]: p for n, p in m.graph.named_parameters(remove_duplicate=False) if not is_adapter(n)}
    assert all(torch.equal(frozen[k], base[k]) for k in base)  # the base itself never trained

    _with_weights(plain, merged)
    m.to_train()
    with torch.no_grad():  # training mode: the weight observers follow the (merged) weights they are given
        assert torch.equal(plain.graph(X), m.graph(X))


def summary_targets(m):
    return [n[len("model.") : -len(".lora_a")] for n, _ in m.graph.named_parameters() if n.endswith(".lora_a")]


@pytest.mark.fast
def test_the_deployed_weights_are_the_fake_quantized_merged_weights(tiny_llama):
    """torchao 8da4w: ``quantize_`` of the merged weights (deployment) gives exactly the fake quantizer's output during
    training, per layer, bit for bit."""
    m = _build(tiny_llama, "xnnpack_8da4w", lora={"rank": 4, "alpha": 8, "targets": ["q_proj", "down_proj"]})
    _train(m)
    fp, _ = m.load_fp()
    m.load_into(fp)
    m.recipe.make_quantizer(is_qat=False).convert(fp)
    names = summary_targets(m)
    assert len(names) == 4
    with torch.no_grad():
        for name in names:
            layer = m.graph.get_submodule(f"model.{name}")
            w = layer.weight + layer.lora_scale * (layer.lora_b @ layer.lora_a)
            assert torch.equal(fp.get_parameter(f"{name}.weight").dequantize(), layer.weight_fake_quantizer(w)), name


def test_a_recipe_that_quantizes_inside_the_adapter_path_is_refused(tiny_llama, tmp_path):
    """Static activations (a user's QAT recipe) annotate the adapter's ``mul``/``add`` too: the graph would train a
    quantized ``B @ A`` that deployment (merged weights) never computes."""
    recipe = tmp_path / "static_qat.yaml"
    recipe.write_text("base: xnnpack_int8_static\nmodes: [qat, ptq]\n")
    with pytest.raises(UserError, match="quantizes inside a LoRA adapter's weight path.*dynamic-activation recipe"):
        _build(tiny_llama, str(recipe), lora={"rank": 4})


def test_a_checkpoint_restores_the_adapters_and_a_mismatched_one_is_refused(tiny_llama, tmp_path):
    from qharness.training.checkpoints import read_checkpoint

    m = _build(tiny_llama, "xnnpack_int8_dynamic", lora={"rank": 4})
    _train(m, 2)
    fresh = _build(tiny_llama, "xnnpack_int8_dynamic", lora={"rank": 4})
    fresh.load_state_dict(m.state_dict())  # what resuming does after configure_model's build
    m.to_train()
    fresh.to_train()
    with torch.no_grad():
        assert torch.equal(fresh.graph(X), m.graph(X))
    path = tmp_path / "x.ckpt"
    torch.save({"state_dict": m.state_dict(), "hyper_parameters": dict(m.hparams)}, path)
    read_checkpoint(str(path), {**m.hparams, "lora": {"rank": 4, "targets": list(LoRA().targets)}})  # same: passes
    with pytest.raises(UserError, match="trained with model.lora=.*this config has None"):
        read_checkpoint(str(path), {**m.hparams, "lora": None})


@pytest.mark.slow  # ~20 s: two graph exports; the whole-model graph's tests above run by default
def test_layerwise_graphs_carry_the_adapters(tiny_llama):
    """Per-layer graphs (FSDP units, activation checkpointing) with adapters compute what the whole-model graph does."""
    whole = _build(tiny_llama, "xnnpack_int8_dynamic", lora={"rank": 4})
    _train(whole, 2)
    layered = _build(tiny_llama, "xnnpack_int8_dynamic", lora={"rank": 4}, layerwise=True)
    trainable = [n for n, p in layered.graph.named_parameters() if p.requires_grad]
    assert len(trainable) == 28 and all(is_adapter(n) for n in trainable)
    from qharness.training.layerwise import hf_name

    weights, trained = whole.trained_weights(), dict(whole.graph.named_parameters())
    with torch.no_grad():  # the base weights are the same source's; the adapters come from the trained whole graph
        for name, p in layered.graph.named_parameters():
            if is_adapter(name):
                p.copy_(trained[hf_name(name)])
    whole.to_train()
    layered.to_train()
    with torch.no_grad():
        torch.testing.assert_close(layered.graph(X), whole.graph(X), rtol=0, atol=1e-5)
    ours = layered.trained_weights()
    common = ours.keys() & weights.keys()  # a tied weight may appear under either of its names
    assert {f"{n}.weight" for n in summary_targets(whole)} <= common
    assert all(torch.equal(ours[k], weights[k]) for k in common)  # merged alike


@pytest.mark.slow  # ~45 s through the CLI; the default suite trains, restores and deploys adapters in process above
def test_fit_with_lora_resumes_and_passes_parity(tmp_path, tiny_llama, corpus):
    """The key end-to-end check: ``qharness fit`` with ``model.lora`` (PT2E int8), 3 steps, resumed to 6 from
    last.ckpt, deployed: the ``.pte`` passes the parity gate; the checkpoint holds the adapters and optimizer state
    for them only; ``summary.json`` records the adapters."""
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "l.yaml",
        tiny_llama,
        corpus,
        run,
        model={"lora": {"rank": 4, "alpha": 8}, "lr": 1e-2},
        data={"seq_len": 16, "batch_size": 2},
        deploy={"max_seq_len": 32},
        bench={"enabled": False},
        parity={"eval_blocks": 2, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
    )
    first = run_cli("fit", cfg, "--trainer.max_steps", "3", "--deploy.enabled", "false")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["lora"] == {"rank": 4, "alpha": 8.0, "targets": list(LoRA().targets)}
    adapters = [k for k in ckpt["state_dict"] if is_adapter(k)]
    assert len(adapters) == 28 and any(ckpt["state_dict"][k].abs().sum() > 0 for k in adapters if "lora_b" in k)
    state = ckpt["optimizer_states"][0]["state"]
    assert sum(s["exp_avg"].numel() for s in state.values()) == sum(ckpt["state_dict"][k].numel() for k in adapters)

    second = run_cli("fit", cfg, "--ckpt_path", "last")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restoring states from the checkpoint" in second.stdout + second.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity"]["passed"] and (run / "model.pte").is_file()
    lora = summary["lora"]
    assert lora["rank"] == 4 and lora["layers"] == 14 and 0 < lora["trained_parameters"] < lora["parameters"] / 5
    print(next(line for line in second.stdout.splitlines() if "parity PASSED" in line))


@pytest.mark.slow  # ~3 min: two fits and deployments
def test_lora_pte_has_the_program_of_full_qat(tmp_path, tiny_llama, corpus):
    """torchao 8da4w with LoRA and without: the two ``.pte`` files have the same operators and delegates and the same
    size up to deduplicated constants, and the LoRA one passes the parity gate, also against its fake-quant model."""
    from qharness.runtime.pte import operators

    runs = {}
    for name, extra in (("full", {}), ("lora", {"lora": {"rank": 4, "alpha": 8}})):
        run = tmp_path / name
        cfg = write_config(
            tmp_path / f"{name}.yaml",
            tiny_llama,
            corpus,
            run,
            model={"recipe": "xnnpack_8da4w", **extra},
            bench={"enabled": False},
        )
        r = run_cli("fit", cfg)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = json.loads((run / "summary.json").read_text())
    full, lora = runs["full"], runs["lora"]
    assert lora["parity"]["passed"] and lora["parity"]["fake_quant"]["passed"], lora["parity"]
    assert operators(lora["pte"]["path"]) == operators(full["pte"]["path"])
    # the same size but for constants the program stores once when equal: LoRA leaves the 5 RMSNorm weight vectors of
    # this random-init model at their initial ones (4 duplicates of 64 floats), full QAT trains them apart; each
    # stored constant also costs its flatbuffer entry (32 bytes here, 64 allowed for alignment)
    assert 0 <= full["pte"]["size_bytes"] - lora["pte"]["size_bytes"] <= 4 * (64 * 4 + 64)
    assert lora["pte"]["sha256"] != full["pte"]["sha256"]  # other weights: it did train
