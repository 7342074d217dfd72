"""Distillation-based QAT (``model.distill``): the loss on fixed logits, the frozen FP teacher beside the prepared
graph (not in its state or optimizer), and ``qharness fit`` with distillation through resume and the parity gate.
The torchao source recipe under two-process DDP is marked slow. Bad ``model.distill`` values are cases of
test_bad_input.py."""

import csv
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli, write_config

from qharness.errors import UserError
from qharness.schema import Distill
from qharness.training.losses import distill_loss
from qharness.training.module import QuantLM
from qharness.training.prepare import set_fake_quant


@pytest.mark.fast
def test_distill_loss_is_zero_for_identical_logits_and_matches_a_hand_computation():
    s = torch.tensor([[[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]])  # [batch 1, 2 positions, vocab 3]
    t = torch.tensor([[[2.0, 0.0, 0.5], [1.0, 1.0, 1.0]]])
    assert distill_loss(s, s, 2.0).item() == pytest.approx(0.0, abs=1e-7)
    T = 2.0
    p, q = (t / T).softmax(-1), (s / T).softmax(-1)  # teacher p, student q
    per_position = (p * (p.log() - q.log())).sum(-1)  # KL(p || q) at each position
    assert distill_loss(s, t, T).item() == pytest.approx(T**2 * per_position.mean().item(), rel=1e-6)
    assert distill_loss(s, t, T).item() > 0


@pytest.mark.fast
def test_distill_settings_are_checked():
    for bad in (dict(temperature=0.0), dict(kl_weight=-1.0), dict(kl_weight=0), dict(temperature=float("nan"))):
        field = next(iter(bad))
        with pytest.raises(UserError, match=f"model.distill.{field} must be a positive number"):
            Distill(**bad)


@pytest.mark.fast
def test_distill_needs_qat(tiny_llama):
    with pytest.raises(UserError, match="model.distill needs model.mode: qat"):
        QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_int8_static", mode="ptq", distill=Distill())


def test_teacher_is_the_frozen_fp_model_outside_the_trained_state(tiny_llama):
    m = QuantLM(
        checkpoint=str(tiny_llama), recipe="xnnpack_int8_dynamic", distill={"temperature": 2.0, "hard_loss": False}
    )
    assert m.hparams.distill == {"kl_weight": 1.0, "temperature": 2.0, "hard_loss": False, "teacher": None}
    m.build(2, 16)
    m.to_train()
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    keys = set(m.state_dict())
    teacher = m.teacher()
    assert set(m.state_dict()) == keys and all(k.startswith("graph.") for k in keys)  # nothing of the teacher saved
    assert not any(p.requires_grad for p in teacher.parameters())
    trained = {id(p) for p in m.graph.parameters()}
    assert not any(id(p) in trained for p in teacher.parameters())  # its own copy, not the student's weights

    set_fake_quant(m.graph, False)  # the student in floating point is the teacher: nothing to distill
    parts = m.training_losses((x, y))
    assert parts["kl"].item() == pytest.approx(0.0, abs=1e-6)
    set_fake_quant(m.graph, True)
    parts = m.training_losses((x, y))
    assert parts["kl"].item() > 1e-6
    assert parts["loss"].item() == pytest.approx(parts["kl"].item(), rel=1e-6)  # hard_loss off: the KL term alone
    with torch.no_grad():
        assert parts["ce"].item() == pytest.approx(F.cross_entropy(m.graph(x).flatten(0, 1), y.flatten()).item())

    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    opt = torch.optim.SGD(m.graph.parameters(), lr=1.0)
    parts["loss"].backward()
    opt.step()
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())  # the teacher does not train
    m.distill = Distill(kl_weight=0.5, temperature=2.0, hard_loss=True)
    parts = m.training_losses((x, y))
    assert parts["loss"].item() == pytest.approx(parts["ce"].item() + 0.5 * parts["kl"].item(), rel=1e-6)


def test_teacher_from_an_fp_run_is_its_fine_tuned_model(tmp_path, tiny_llama, corpus):
    """``model.distill.teacher``: the run directory of an FP ``qharness fit`` (through the CLI) gives its trained
    weights, not the source's; a quantized run or a model with another vocabulary is refused."""
    fp_run = tmp_path / "fp"
    cfg = write_config(
        tmp_path / "fp.yaml",
        tiny_llama,
        corpus,
        fp_run,
        model={"recipe": "xnnpack_fp32_finetune", "lr": 1e-2},
        data={"seq_len": 16, "batch_size": 2},
        trainer={"max_steps": 2, "val_check_interval": 2},
        checkpoint={"every_n_train_steps": 2},
    )
    done = run_cli("fit", cfg, "--deploy.enabled", "false")
    assert done.returncode == 0, done.stderr[-3000:]
    student = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w", distill={"teacher": str(fp_run)})
    student.build(2, 16)
    teacher = student.teacher().model
    source = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w").load_fp()[0]
    trained = torch.load(fp_run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    key = next(k for k in trained if k.endswith("q_proj.weight"))  # e.g. graph.model.model.layers.0...
    name = key[key.index("layers.") :]
    assert torch.equal(teacher.get_parameter(f"model.{name}"), trained[key])  # the run's trained weight
    assert not torch.equal(teacher.get_parameter(f"model.{name}"), source.get_parameter(f"model.{name}"))
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    assert student.training_losses((x, torch.roll(x, -1, 1)))["kl"].item() > 0

    quantized = tmp_path / "q"
    (quantized / "checkpoints").mkdir(parents=True)
    ckpt = torch.load(fp_run / "checkpoints" / "last.ckpt", weights_only=True)
    ckpt["hyper_parameters"]["recipe"] = "xnnpack_8da4w"
    torch.save(ckpt, quantized / "checkpoints" / "last.ckpt")
    with pytest.raises(UserError, match="was trained with the quantized recipe 'xnnpack_8da4w'"):
        QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w", distill={"teacher": str(quantized)}).teacher("cpu")


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path, tiny_llama):
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(tiny_llama)
    other.resize_token_embeddings(other.config.vocab_size + 8)
    other.save_pretrained(tmp_path / "other")
    for f in tiny_llama.glob("*token*"):  # the same tokenizer files; only the model's vocabulary differs
        (tmp_path / "other" / f.name).write_bytes(f.read_bytes())
    m = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_int8_dynamic", distill={"teacher": str(tmp_path / "other")})
    m.build(2, 16)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(UserError, match="gives logits of shape .* fix: distill from a model with the student's vocab"):
        m.training_losses((x, x))


@pytest.mark.slow  # ~90 s: a CLI fit, resume and deploy; the loss, teacher and settings tests above run by default
def test_fit_with_distillation_resumes_and_passes_parity(tmp_path, tiny_llama, corpus):
    """3 distilled QAT steps, then resumed to 6 from last.ckpt (teacher rebuilt from the source), deployed."""
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "d.yaml",
        tiny_llama,
        corpus,
        run,
        model={"distill": {"kl_weight": 1.0, "temperature": 2.0}},
        data={"seq_len": 16, "batch_size": 2},
        trainer={"log_every_n_steps": 1},
        deploy={"max_seq_len": 32},
        bench={"enabled": False},
        parity={"eval_blocks": 2, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
    )
    first = run_cli("fit", cfg, "--trainer.max_steps", "3", "--deploy.enabled", "false")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["hyper_parameters"]["distill"]["temperature"] == 2.0
    assert ckpt["state_dict"] and all(k.startswith("graph.") for k in ckpt["state_dict"])  # no teacher weights

    second = run_cli("fit", cfg, "--ckpt_path", "last")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Restoring states from the checkpoint" in second.stdout + second.stderr
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity"]["passed"] and (run / "model.pte").is_file()
    assert summary["distill"] == {"kl_weight": 1.0, "temperature": 2.0, "hard_loss": True, "teacher": None}
    rows = [r for f in sorted(run.glob("lightning_logs/version_*/metrics.csv")) for r in csv.DictReader(open(f))]
    kl = [float(r["train/kl"]) for r in rows if r.get("train/kl")]
    ce = [float(r["train/ce"]) for r in rows if r.get("train/ce")]
    assert len(kl) == len(ce) == 6 and all(v > 0 for v in kl)  # logged at every step, before and after the resume


@pytest.mark.slow
def test_torchao_recipe_distills_under_two_process_ddp(tmp_path, tiny_llama, corpus):
    """Source-level 8da4w (eager torchao fake-quant modules) with hard_loss off, on two CPU processes (gloo)."""
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "ddp.yaml",
        tiny_llama,
        corpus,
        run,
        model={"recipe": "xnnpack_8da4w", "distill": {"kl_weight": 1.0, "temperature": 2.0, "hard_loss": False}},
        data={"seq_len": 16, "batch_size": 2},
        deploy={"max_seq_len": 32},
        bench={"enabled": False},
        trainer={
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "ddp",
            "max_steps": 3,
            "val_check_interval": 3,
            "limit_val_batches": 1,
            "log_every_n_steps": 1,
        },
        parity={"eval_blocks": 2, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
    )
    r = run_cli("fit", cfg)
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in out and out.count("parity PASSED") == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parity"]["passed"] and summary["recipe"] == "xnnpack_8da4w"
    assert summary["distill"]["hard_loss"] is False
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 3 and all(k.startswith("graph.") for k in ckpt["state_dict"])
    rows = list(csv.DictReader(open(next(run.glob("lightning_logs/version_*/metrics.csv")))))
    logged = [(float(r["train/loss"]), float(r["train/kl"])) for r in rows if r.get("train/kl")]
    assert len(logged) == 3 and all(loss == pytest.approx(kl) and kl > 0 for loss, kl in logged)  # loss is the KL term
