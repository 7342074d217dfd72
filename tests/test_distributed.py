"""Many devices: DDP shards training batches by rank (resumable). The two-process CPU DDP run through the CLI
(gloo) is marked slow (two processes each export the model). Moving a GPU-trained graph to CPU for deployment
is tested in test_training_options.py (it reuses that module's prepared graph)."""

import json

import pytest
import torch
from conftest import run_cli, write_config

from qharness.data.datamodule import ResumableShuffle


def test_ddp_ranks_share_each_global_batch_like_one_process_with_a_larger_batch():
    one = list(ResumableShuffle(40, 4, seed=3))  # one process, batch 4
    ranks = [list(ResumableShuffle(40, 2, seed=3, rank=r, world=2)) for r in range(2)]  # two ranks, batch 2 each
    assert len(ranks[0]) == len(ranks[1]) == len(one) == 10
    for k, batch in enumerate(one):
        assert ranks[0][k] + ranks[1][k] == batch  # global batch k = the one-process batch k, split by rank
    resumed = list(ResumableShuffle(40, 2, seed=3, start=7, rank=1, world=2))
    assert resumed == ranks[1][7:]


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
