"""Quiet, truthful output (qharness/upstream/quiet.py): known-harmless upstream lines hidden, real ones kept, --verbose shows all."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The CLI's start (`qharness recipes`, with the arguments given) installs the filters; then upstream code emits
# its known messages for real (torchao's import, lm-eval's git lookup, ExecuTorch's threadpool) or, where the
# real trigger is a whole export, with the same message and origin (warn_explicit), next to messages that only
# look alike and a genuine warning.
SCRIPT = r"""
import logging, sys, warnings
from qharness.cli import main as cli
from qharness.upstream import quiet
cli.main(sys.argv[1:])
import torchao  # torch's pytree enum records; torchao's CUDA-only .so load failures
warnings.warn_explicit("_check_is_size will be removed in a future PyTorch release", FutureWarning,
                       "custom_ops.py", 317, module="executorch.extension.llm.custom_ops.custom_ops")
warnings.warn_explicit("`past_key_values` is deprecated and will be removed in version 5.40.0 for `LlamaForCausalLM.forward`. "
                       "Use `cache` instead.", FutureWarning, "module.py", 1789, module="torch.nn.modules.module")
warnings.warn_explicit("_check_is_size will be removed, said another module", FutureWarning, "other.py", 1, module="other")
warnings.warn("a genuine warning nobody filtered")
logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_cpu_kernels.so: a CPU kernel missing")
logging.getLogger("qharness.sources.models").info("pretraining the embedded default model once")
quiet.quiet_lm_eval_git()
import lm_eval.evaluator
lm_eval.evaluator.get_git_commit_hash()  # git describe, outside a repository
quiet.quiet_executorch_threadpool()
from executorch.extension.pybindings import portable_lib
portable_lib._threadpool_get_thread_count()
import torch
from transformers.models.bamba import modeling_bamba  # a Mamba2 mixer's scan and convolution, without their kernels
modeling_bamba.causal_conv1d_fn(torch.ones(1, 2, 3), torch.ones(2, 2))
print("script finished", file=sys.stderr)
"""

NOISE = [
    "is an Enum subclass and is now natively supported",  # torch.utils._pytree
    "torchao/_C_mxfp8",  # torchao's .so load failures
    "custom_ops.py:317",  # the _check_is_size FutureWarning of ExecuTorch's custom ops
    "`past_key_values` is deprecated",  # transformers 5.x's renamed KV-cache argument
    "fatal: not a git repository",  # lm-eval's git describe
    "[cpuinfo_utils.cpp:",  # ExecuTorch's threadpool, native stderr
    "is falling back to its reference PyTorch implementation",  # transformers' Mamba2 CUDA kernels, absent on CPU
]
KEPT = [
    "_check_is_size will be removed, said another module",  # same message, another origin
    "a genuine warning nobody filtered",
    "_C_cpu_kernels.so: a CPU kernel missing",  # same logger, another message
    "[qharness] pretraining the embedded default model once",  # qharness's progress at INFO, in its own format
    "script finished",
]


def _run(tmp_path, *args, verbose_env=None):
    env = {k: v for k, v in os.environ.items() if k != "QHARNESS_VERBOSE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if verbose_env:
        env["QHARNESS_VERBOSE"] = verbose_env
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, "recipes", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quiet")  # not a git repository: lm-eval's git describe fails there
    return {"quiet": _run(tmp), "--verbose": _run(tmp, "--verbose"), "QHARNESS_VERBOSE=1": _run(tmp, verbose_env="1")}


def test_known_noise_is_hidden_and_everything_else_shows(outputs):
    out = outputs["quiet"]
    assert "xnnpack_8da4w" in out  # the command's own output
    for line in NOISE:
        assert line not in out, line
    for line in KEPT:
        assert line in out, line


@pytest.mark.parametrize("how", ["--verbose", "QHARNESS_VERBOSE=1"])
def test_verbose_shows_everything(outputs, how):
    out = outputs[how]
    for line in NOISE:
        if line == "[cpuinfo_utils.cpp:" and not sys.platform.startswith("linux"):
            continue  # the probe that prints it reads Linux /sys files
        assert line in out, line
    for line in KEPT:
        assert line in out, line


def test_the_verbose_flag_reaches_child_processes(monkeypatch):
    from qharness.upstream import quiet

    monkeypatch.delenv("QHARNESS_VERBOSE", raising=False)
    assert quiet.take_verbose_flag(["fit", "x.yaml"]) == ["fit", "x.yaml"] and not quiet.verbose()
    assert quiet.take_verbose_flag(["fit", "--verbose", "x.yaml"]) == ["fit", "x.yaml"]
    assert os.environ["QHARNESS_VERBOSE"] == "1" and quiet.verbose()  # what a sweep's runs inherit
    monkeypatch.setenv("QHARNESS_VERBOSE", "0")
    assert not quiet.verbose()


def test_every_filter_says_why():
    from qharness.upstream import quiet

    for entry in (*quiet.WARNINGS, *quiet.LOG_RECORDS, *quiet.ENVIRONMENT):
        assert len(entry[-1]) > 30, entry


@pytest.mark.parametrize("max_epochs, expected", [(-1, "Epoch 0"), (None, "Epoch 0"), (3, "Epoch 0/2")])
def test_training_bar_never_reads_epoch_minus_two(max_epochs, expected):
    from qharness.progress import lightning_progress_bar

    bar = lightning_progress_bar()
    if not hasattr(bar, "_get_train_description"):
        pytest.skip("rich is not installed: Lightning's tqdm bar writes 'Epoch N' alone")
    bar._trainer = SimpleNamespace(max_epochs=max_epochs)
    assert bar._get_train_description(0).strip() == expected


def test_a_quiet_stage_says_nothing_when_fast_and_announces_itself_when_slow(capsys):
    """Lowering's phases (progress.stage with quiet_below): silent for a tiny model, a start line once a phase has run
    that long and its end line; quiet_below 0 is an ordinary stage."""
    import time

    from qharness.progress import stage

    with stage("fast phase", quiet_below=5.0):
        pass
    assert capsys.readouterr().err == ""
    with stage("slow phase", quiet_below=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[qharness] slow phase ..." and err[1].startswith("[qharness] slow phase: done in ")
    with pytest.raises(ValueError), stage("failing phase", quiet_below=0.0):
        raise ValueError
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "[qharness] failing phase ..." and err[1].startswith("[qharness] failing phase: failed after ")
