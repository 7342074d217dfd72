"""Many devices: DDP shards training batches by rank (resumable); FSDP (fsdp_layers) trains what one process trains. The two-process CPU DDP run through the CLI
(gloo) is marked slow (two processes each export the model). Moving a GPU-trained graph to CPU for deployment
is tested in test_training_options.py (it reuses that module's prepared graph)."""

import json

import pytest
import torch
from conftest import ROOT, run_cli, write_config

from qharness.data.datamodule import ResumableShuffle


@pytest.mark.fast
def test_ddp_ranks_share_each_global_batch_like_one_process_with_a_larger_batch():
    one = list(ResumableShuffle(40, 4, seed=3))  # one process, batch 4
    ranks = [list(ResumableShuffle(40, 2, seed=3, rank=r, world=2)) for r in range(2)]  # two ranks, batch 2 each
    assert len(ranks[0]) == len(ranks[1]) == len(one) == 10
    for k, batch in enumerate(one):
        assert ranks[0][k] + ranks[1][k] == batch  # global batch k = the one-process batch k, split by rank
    resumed = list(ResumableShuffle(40, 2, seed=3, start=7, rank=1, world=2))
    assert resumed == ranks[1][7:]


@pytest.mark.fast
def test_too_few_blocks_for_every_rank_is_a_clear_error():
    from qharness.errors import UserError

    with pytest.raises(UserError, match="fewer than one batch on each of 4 processes"):
        ResumableShuffle(7, 2, seed=0, world=4)


@pytest.mark.slow
def test_cpu_ddp_two_processes_train_and_rank_zero_deploys_once(tmp_path, tiny_llama, corpus):
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "ddp.yaml",
        tiny_llama,
        corpus,
        run,
        bench={"enabled": False},
        data={"seq_len": 16, "batch_size": 2},
        deploy={"max_seq_len": 32},
        checkpoint={"every_n_train_steps": 3},
        trainer={
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "ddp",
            "max_steps": 3,
            "val_check_interval": 3,
            "limit_val_batches": 1,
        },
        parity={"eval_blocks": 2, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
    )
    r = run_cli("fit", cfg)
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in out  # two processes trained
    assert out.count("parity PASSED") == 1  # only rank 0 deployed
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    assert json.loads((run / "summary.json").read_text())["parity"]["passed"] and (run / "model.pte").is_file()


def _weights(ckpt) -> dict:
    """A checkpoint's trained weights by HF name (observers and constants left out), either graph form."""
    from qharness.training.layerwise import hf_name

    state = torch.load(ckpt, weights_only=True)["state_dict"]
    return {
        hf_name(k): v for k, v in state.items() if "activation_post_process" not in k and "_tensor_constant" not in k
    }


@pytest.mark.slow
def test_fsdp_two_processes_train_what_one_process_trains_and_export_and_resume(tmp_path, tiny_llama, corpus):
    """FSDP (``fsdp_layers``, one unit per decoder layer, 2 processes, gloo) against one process with the same global
    batch (gradient accumulation over the same two micro-batches the ranks take): the same weights, a .pte that
    passes parity, ``qharness export`` of the consolidated checkpoint on one process, and resume (same process count)."""
    common = dict(
        bench={"enabled": False},
        data={"seq_len": 16, "batch_size": 2},
        deploy={"max_seq_len": 32},
        checkpoint={"every_n_train_steps": 4},
        parity={"eval_blocks": 4, "prompts": 1, "prompt_len": 8, "decode_steps": 2},
    )
    trainer = {"accelerator": "cpu", "max_steps": 4, "val_check_interval": 4, "limit_val_batches": 1}
    one = write_config(
        tmp_path / "one.yaml", tiny_llama, corpus, tmp_path / "one",
        trainer={**trainer, "devices": 1, "accumulate_grad_batches": 2}, **common,
    )  # fmt: skip
    fsdp = write_config(
        tmp_path / "fsdp.yaml", tiny_llama, corpus, tmp_path / "fsdp",
        trainer={**trainer, "devices": 2, "strategy": "fsdp_layers"}, model={"layerwise": True}, **common,
    )  # fmt: skip
    for cfg in (one, fsdp):
        r = run_cli("fit", cfg)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (r.stdout + r.stderr).count("parity PASSED") == 1  # one process deployed
    a, b = (
        _weights(tmp_path / "one" / "checkpoints" / "last.ckpt"),
        _weights(tmp_path / "fsdp" / "checkpoints" / "last.ckpt"),
    )
    shared = a.keys() & b.keys()
    assert {"graph.model.model.layers.1.mlp.down_proj.weight", "graph.model.lm_head.weight"} <= shared
    assert max((a[k] - b[k]).abs().max().item() for k in shared) < 1e-6
    assert json.loads((tmp_path / "fsdp" / "summary.json").read_text())["parity"]["passed"]

    (tmp_path / "fsdp" / "model.pte").unlink()
    r = run_cli("export", fsdp, "--trainer.devices", "1", "--trainer.strategy", "auto")  # one CPU process
    assert r.returncode == 0 and "parity PASSED" in r.stdout + r.stderr, r.stderr[-3000:]
    assert (tmp_path / "fsdp" / "model.pte").is_file()

    for cfg in (one, fsdp):
        r = run_cli("fit", cfg, "--trainer.max_steps", "6", "--ckpt_path", "last", "--deploy.enabled", "false")
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = (
        _weights(tmp_path / "one" / "checkpoints" / "last.ckpt"),
        _weights(tmp_path / "fsdp" / "checkpoints" / "last.ckpt"),
    )
    assert torch.load(tmp_path / "fsdp" / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert max((a[k] - b[k]).abs().max().item() for k in shared) < 1e-5  # resumed alike (optimizer state restored)


@pytest.mark.slow
def test_fsdp_shards_torchao_source_recipes_eager_decoder_layers_alike(tmp_path, tiny_llama, corpus):
    """xnnpack_8da4w (torchao fake-quantized eager modules, no layerwise graphs needed): two FSDP processes end with
    the weights of one process on the same global batch."""
    common = dict(
        data={"seq_len": 16, "batch_size": 2}, deploy={"enabled": False}, checkpoint={"every_n_train_steps": 4}
    )
    trainer = {"accelerator": "cpu", "max_steps": 3, "val_check_interval": 3, "limit_val_batches": 1}
    runs = {
        "one": {**trainer, "devices": 1, "accumulate_grad_batches": 2},
        "fsdp": {**trainer, "devices": 2, "strategy": "fsdp_layers"},
    }
    for name, t in runs.items():
        cfg = write_config(
            tmp_path / f"{name}.yaml", tiny_llama, corpus, tmp_path / name,
            trainer=t, model={"recipe": "xnnpack_8da4w"}, **common,
        )  # fmt: skip
        r = run_cli("fit", cfg)
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = (_weights(tmp_path / n / "checkpoints" / "last.ckpt") for n in runs)
    assert a.keys() == b.keys() and "graph.model.model.layers.0.self_attn.q_proj.weight" in a
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


@pytest.mark.slow
def test_memory_benchmark_script_measures_each_mode_on_every_process(tmp_path):
    """scripts/bench_memory.py (docs/benchmarks/memory.md) on a tiny shape: each mode's fresh processes report."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "mem.json"
    cmd = [
        sys.executable,
        str(root / "scripts" / "bench_memory.py"),
        "--shape",
        "tiny",
        "--procs",
        "2",
        "--repeats",
        "1",
    ]
    cmd += ["--modes", "ddp,fsdp_ac", "--steps", "2", "--seq", "16", "--layers", "1", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert sorted(runs) == ["ddp", "fsdp_ac"]
    for mode, (ranks,) in runs.items():  # one repeat of each mode
        assert [x["rank"] for x in ranks] == [0, 1] and all(x["mode"] == mode and x["world"] == 2 for x in ranks), mode
        assert all(x["steady"] > 0 and x["params"] > 0 for x in ranks)
    assert "fsdp_ac " in r.stdout and "steady B/param" in r.stdout
    assert "tiny shape with 1 layers (0.1M parameters)" in r.stdout  # --layers: the shape's width, fewer layers
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64  # q, o; k, v (2 KV heads of 16); MLP; 2 norms
    assert {x["params"] for ranks in runs.values() for x in ranks[0]} == {512 * 64 + layer + 64}  # tied embedding


@pytest.mark.slow
def test_shipped_fsdp_config_trains_sharded_and_deploys(tmp_path, tiny_llama, corpus):
    """configs/qat_fsdp.yaml as shipped (fsdp_layers, layer graphs, activation checkpointing, 2 processes), on CPU
    with the tiny model and a few steps instead of the embedded default's 100."""

    run = tmp_path / "run"
    r = run_cli(
        "fit", "--config", ROOT / "configs" / "qat_fsdp.yaml",
        "--model.checkpoint", tiny_llama, "--data.source", corpus, "--data.seq_len", "32",
        "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
        "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", run, "--deploy.max_seq_len", "64",
        "--parity.eval_blocks", "8", "--parity.prompts", "1", "--eval.enabled", "false", "--bench.enabled", "false",
        "--wandb.enabled", "false",
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in out and out.count("parity PASSED") == 1
    hp = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert hp["layerwise"] and hp["activation_checkpointing"]
