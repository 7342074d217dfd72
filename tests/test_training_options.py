"""Training options on the prepared graph (no Trainer): fake quantization after N steps, observers frozen after
M steps, mixed precision, the LR schedule, data resumption with gradient accumulation, and the rebuild on CPU
that deploys a graph trained on a GPU."""

import pytest
import torch

from qharness.errors import UserError
from qharness.recipes.registry import load_recipe
from qharness.schema.run import check_precision
from qharness.sources.models import load_model_and_tokenizer
from qharness.training.module import QuantLM
from qharness.training.prepare import export_for_training, set_fake_quant


class FakeTrainer:
    """What QuantLM reads from a Trainer: the step counter and the schedule length."""

    def __init__(self, global_step=0, estimated_stepping_batches=100):
        self.global_step, self.estimated_stepping_batches = global_step, estimated_stepping_batches


@pytest.fixture(scope="module")
def built(tiny_llama):
    """One prepared QAT graph for the module (building costs seconds) and its initial state."""
    m = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_int8_dynamic", mode="qat")
    m.build(2, 16)
    return m, {k: v.clone() for k, v in m.state_dict().items()}


@pytest.fixture
def make(built):
    """``make(**schedule)``: the shared module reset to its initial state, with these schedule fields."""

    def reset(fake_quant_after_n_steps=0, freeze_observers_after_n_steps=None):
        m, state = built
        m.load_state_dict(state)
        m.hparams.fake_quant_after_n_steps = fake_quant_after_n_steps
        m.hparams.freeze_observers_after_n_steps = freeze_observers_after_n_steps
        m.trainer = FakeTrainer()
        set_fake_quant(m.graph, True)
        m.to_train()
        return m

    return reset


def _weight_scales(m):
    return {k: v.clone() for k, v in m.graph.state_dict().items() if k.endswith(".scale") and v.numel() > 1}


def _step(m, x, opt):
    """One training step as Lightning runs it: batch-start hook, forward/backward, optimizer, step counter."""
    m.on_train_batch_start((x, x), 0)
    loss = m.loss((x, x))
    opt.zero_grad()
    loss.backward()
    opt.step()
    m.trainer.global_step += 1
    return loss


@pytest.mark.fast
def test_fake_quant_starts_after_n_steps_and_is_off_before(tiny_llama, make):
    fp, _ = load_model_and_tokenizer(str(tiny_llama))
    fp_graph = export_for_training(fp, 2, 16)
    m = make(fake_quant_after_n_steps=2)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    m.on_train_batch_start((x, x), 0)
    with torch.no_grad():
        torch.testing.assert_close(m.graph(x), fp_graph(x), rtol=0, atol=0)  # fake-quant off: the FP graph exactly
    opt = torch.optim.SGD(m.graph.parameters(), lr=0.0)  # weights stay put: only the switch changes the output
    _step(m, x, opt)
    _step(m, x, opt)
    m.on_train_batch_start((x, x), 0)  # step 2: fake quantization on
    with torch.no_grad():
        assert not torch.allclose(m.graph(x), fp_graph(x), atol=1e-4)
        set_fake_quant(m.graph, False)
        torch.testing.assert_close(m.graph(x), fp_graph(x), rtol=0, atol=0)


@pytest.mark.fast
def test_frozen_observers_keep_their_scales_while_weights_train(make):
    m = make(freeze_observers_after_n_steps=2)
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(m.graph.parameters(), lr=1.0)  # large steps: min-max ranges move unless frozen
    history = [None]
    for _ in range(4):
        _step(m, x, opt)
        history.append(_weight_scales(m))
    moved = lambda a, b: any(not torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    assert moved(history[1], history[2])  # steps 0 and 1 observe the changing weights
    assert not moved(history[2], history[3]) and not moved(history[3], history[4])  # frozen from step 2 on
    m.to_eval(), m.to_train()  # a validation round does not thaw them
    _step(m, x, opt)
    assert not moved(history[4], _weight_scales(m))


@pytest.mark.fast
def test_schedule_fields_are_refused_for_source_level_recipes(tiny_llama):
    with pytest.raises(UserError, match="need a PT2E recipe"):
        QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w", mode="qat", fake_quant_after_n_steps=10)
    with pytest.raises(UserError, match="must be >= 0"):
        QuantLM(
            checkpoint=str(tiny_llama), recipe="xnnpack_int8_dynamic", mode="qat", freeze_observers_after_n_steps=-1
        )


@pytest.mark.fast
def test_precision_policy():
    pt2e, source = load_recipe("xnnpack_int8_dynamic"), load_recipe("xnnpack_8da4w")
    for ok in ("32-true", 32, "bf16-mixed", "16-mixed", None):
        check_precision(ok, pt2e, "qat")
    check_precision("32-true", source, "qat")
    for bad in ("bf16-true", "16-true", "64-true", "transformer-engine"):
        with pytest.raises(UserError, match=f"trainer.precision={bad} does not work with fake quantization"):
            check_precision(bad, pt2e, "qat")
    with pytest.raises(UserError, match="does not work with recipe 'xnnpack_8da4w'"):
        check_precision("bf16-mixed", source, "qat")


@pytest.mark.fast
def test_pt2e_qat_graph_trains_under_bf16_autocast(make):
    """What trainer.precision=bf16-mixed does on CPU: the unfused FakeQuantize runs under autocast."""
    m = make()
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m.graph(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten())
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(
        p.dtype == torch.float32 and p.grad is not None and torch.isfinite(p.grad).all() for p in m.graph.parameters()
    )


@pytest.mark.slow
def test_torchao_8da4w_now_runs_under_bf16_autocast(tiny_llama):
    """torchao 0.18's fake quantizer used to fail under autocast ("dtype mismatch"); it now runs forward and backward.
    check_precision still refuses bf16-mixed for 8da4w until a bf16-mixed 8da4w fit is verified through deployment
    and parity; this test records the upstream change that makes that worth doing."""
    m = QuantLM(checkpoint=str(tiny_llama), recipe="xnnpack_8da4w", mode="qat")
    m.build(2, 16)
    x = torch.randint(0, 300, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = m.graph(x)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten())
    loss.backward()
    assert logits.dtype == torch.bfloat16 and torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in m.graph.parameters() if p.grad is not None)


@pytest.mark.fast
def test_lr_schedule_warms_up_then_decays_to_a_tenth(tiny_llama):
    m = QuantLM(checkpoint=str(tiny_llama), lr=1e-3, warmup_steps=4)
    m.graph = torch.nn.Linear(2, 2)  # the schedule only needs parameters
    m.trainer = FakeTrainer(estimated_stepping_batches=20)
    sched = m.configure_optimizers()["lr_scheduler"]["scheduler"]
    lrs = [sched.get_last_lr()[0]]
    for _ in range(20):
        sched.optimizer.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] == pytest.approx(1e-4)  # cosine down to 0.1 * lr


@pytest.mark.fast
def test_resumed_data_with_gradient_accumulation_continues_at_the_next_micro_batch():
    """After k optimizer steps with accumulate_grad_batches=a, training data resumes at micro-batch k*a."""
    from qharness.data.datamodule import TextDataModule

    class T:
        def __init__(self, step, accumulate):
            self.global_step, self.accumulate_grad_batches, self.global_rank, self.world_size = step, accumulate, 0, 1
            self.val_check_interval, self.limit_train_batches, self.check_val_every_n_epoch = 1.0, 1.0, 1

    dm = TextDataModule(seq_len=4, batch_size=2)
    dm.train_x = dm.train_y = torch.arange(80).view(20, 4)
    batches = lambda: [b[0][:, 0].tolist() for b in dm.train_dataloader()]  # noqa: E731
    dm.trainer = T(0, 2)
    whole = batches()
    dm.trainer = T(3, 2)
    assert batches() == whole[6:] and len(whole) == 10


@pytest.mark.fast
def test_batches_done_counts_the_short_accumulation_at_the_end_of_each_pass():
    from qharness.data.datamodule import batches_done

    assert [batches_done(s, 3, 10) for s in range(9)] == [0, 3, 6, 9, 10, 13, 16, 19, 20]  # 4 steps per pass of 10
    assert batches_done(7, 2, 10) == 7 * 2 and batches_done(7, 1, 10) == 7


@pytest.mark.fast
def test_validation_before_the_first_training_step_runs(make):
    """Lightning's sanity check validates before any training: static observers that saw nothing stay on."""
    m = make()
    m.to_eval()
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(m.graph(x)).all()
        scales = _weight_scales(m)
        for p in m.graph.parameters():
            p.mul_(2.0)
        m.to_eval()
        m.graph(x)
    assert scales and all(torch.equal(v, _weight_scales(m)[k]) for k, v in scales.items())  # observed once, now frozen


def test_rebuilding_the_graph_on_another_device_keeps_the_trained_state(make):
    """What deployment does with a graph trained on a GPU (QuantLM.graph_to_cpu), run here CPU -> CPU."""
    m = make()
    x = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(m.graph.parameters(), lr=0.5)
    _step(m, x, opt)
    m.loss((x, x))  # observers see the updated weights
    m.to_eval()
    with torch.no_grad():
        before = m.graph(x)
    old = m.graph
    m.rebuild_on("cpu")
    m.to_eval()
    with torch.no_grad():
        assert m.graph is not old
        torch.testing.assert_close(m.graph(x), before, rtol=0, atol=0)


@pytest.mark.slow
def test_resume_with_gradient_accumulation_ends_where_an_uninterrupted_run_ends(tmp_path, tiny_llama, corpus):
    """accumulate_grad_batches=2 over passes of an odd number of batches (Lightning also steps at each pass end):
    a run resumed from its step-3 checkpoint matches the uninterrupted 6-step run."""
    import shutil

    from conftest import run_cli, write_config

    from qharness.data.datamodule import TextDataModule

    text = corpus.read_text()
    for chars in range(800, 4000, 100):  # a small text whose pass has an odd number of batches (steps cross it)
        data = tmp_path / f"small{chars}.txt"  # a new name each time: datasets caches by path
        data.write_text(text[:chars])
        dm = TextDataModule(source=str(data), tokenizer=str(tiny_llama), seq_len=32, batch_size=4, val_fraction=0.3)
        try:
            dm.setup()
        except Exception:  # too little text for one validation batch yet
            continue
        if len(dm.train_x) // 4 in (3, 5, 7):
            break
    assert len(dm.train_x) // 4 in (3, 5, 7)
    off = {"deploy": {"enabled": False, "max_seq_len": 64}, "bench": {"enabled": False}}
    trainer = {"max_steps": 6, "accumulate_grad_batches": 2, "val_check_interval": None, "check_val_every_n_epoch": 1}
    small = {"val_fraction": 0.3}
    a_cfg = write_config(
        tmp_path / "a.yaml",
        tiny_llama,
        data,
        tmp_path / "a",
        trainer=trainer,
        data=small,
        checkpoint={"save_top_k": -1},
        **off,
    )
    b_cfg = write_config(tmp_path / "b.yaml", tiny_llama, data, tmp_path / "b", trainer=trainer, data=small, **off)
    assert run_cli("fit", a_cfg).returncode == 0
    step3 = next((tmp_path / "a" / "checkpoints").glob("*step=3.ckpt"))
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copy(step3, tmp_path / "b" / "checkpoints" / "last.ckpt")
    r = run_cli("fit", b_cfg, "--ckpt_path", "last")
    assert r.returncode == 0, r.stderr[-3000:]
    a, b, s3 = (
        torch.load(p, weights_only=True)
        for p in (tmp_path / "a" / "checkpoints" / "last.ckpt", tmp_path / "b" / "checkpoints" / "last.ckpt", step3)
    )
    assert a["global_step"] == b["global_step"] == 6 and s3["global_step"] == 3

    def max_diff(x, y):
        return max(
            (x["state_dict"][k].float() - y["state_dict"][k].float()).abs().max().item() for k in x["state_dict"]
        )

    assert max_diff(a, b) < 1e-6 < max_diff(a, s3)


@pytest.mark.fast
def test_sigterm_mid_accumulation_keeps_the_last_step_boundary_checkpoint(tmp_path):
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from qharness.training.checkpoints import SaveOnSigterm

    saved = []

    def trainer(completed, accumulate):
        progress = SimpleNamespace(current=SimpleNamespace(completed=completed))
        return SimpleNamespace(
            global_step=3,
            accumulate_grad_batches=accumulate,
            save_checkpoint=lambda path, weights_only: saved.append((path, weights_only)),
            fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
        )

    cb = SaveOnSigterm(tmp_path / "last.ckpt")
    cb.on_exception(trainer(7, 2), None, SIGTERMException())  # killed after micro-batch 1 of 2
    assert saved == []
    cb.on_exception(trainer(8, 2), None, SIGTERMException())  # at a step boundary
    cb.on_exception(trainer(7, 1), None, SIGTERMException())
    assert saved == [(tmp_path / "last.ckpt", False)] * 2  # the full state: resumable
