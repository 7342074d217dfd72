"""Fast validation (qharness/api/precheck.py): a bad run config fails with one error line before torch loads,
and every config the full CLI accepts passes it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, run_cli, write_config

from qharness.api.precheck import merged_config, precheck
from qharness.errors import UserError


def _good(tmp, **sections):
    return write_config(tmp / "c.yaml", "embedded", "embedded", tmp / "run", **sections)


def _text(tmp, text):
    (tmp / "c.yaml").write_text(text)
    return tmp / "c.yaml"


# name: (config path from tmp, extra arguments, expected in the error line)
CASES = {
    "bad lr": (lambda t: _good(t, model={"lr": -1}), [], "model.lr must be positive (got -1)"),
    "bad lr override": (lambda t: _good(t), ["--model.lr=-1"], "model.lr must be positive (got -1)"),
    "bad warmup override": (lambda t: _good(t), ["--model.warmup_steps", "-2"], "model.warmup_steps must be >= 0"),
    "unknown field": (lambda t: _good(t, data={"seq_lenn": 3}), [], "unknown config field(s) data.seq_lenn"),
    "unknown field override": (lambda t: _good(t), ["--model.recipee", "x"], "unknown config field(s) model.recipee"),
    "unknown section": (lambda t: _text(t, "modle: {lr: 1}\n"), [], "unknown config section(s) modle"),
    "missing file": (lambda t: t / "nope.yaml", [], "config file " + "{tmp}/nope.yaml does not exist"),
    "YAML syntax": (lambda t: _text(t, "model: {lr: 1\n"), [], "c.yaml is not valid YAML (line 2"),
    "not a mapping": (lambda t: _text(t, "- model\n"), [], "c.yaml must hold a mapping of sections (got list)"),
    "unknown recipe": (
        lambda t: _good(t),
        ["--model.recipe", "xnnpack_int3"],
        "unknown recipe 'xnnpack_int3'. fix: use one of: vulkan_int8w, ",
    ),
    "unknown mode": (lambda t: _good(t), ["--model.mode", "int8"], "does not support mode 'int8'"),
    "missing data.source": (
        lambda t: _good(t, data={"source": str(t / "none.txt")}),
        [],
        "data.source {tmp}/none.txt does not exist",
    ),
    "bad section value": (lambda t: _good(t), ["--parity.prompts", "0"], "parity.prompts must be a number >= 1"),
    "across sections": (lambda t: _good(t, deploy={"max_seq_len": 32}), [], "deploy.max_seq_len=32 must exceed"),
    "bench longer than the .pte": (
        lambda t: _good(t, bench={"enabled": True, "prompt_len": 60}),
        [],
        "bench.prompt_len + bench.decode_tokens = 68 exceeds the .pte's KV cache (64 positions)",
    ),
    "zero max_steps": (lambda t: _good(t), ["--trainer.max_steps", "0"], "trainer.max_steps must be positive"),
    "bad deploy filename": (lambda t: _good(t, deploy={"filename": "x.bin"}), [], "deploy.filename 'x.bin'"),
    "fsdp without layer graphs": (
        lambda t: _good(t, trainer={"strategy": "fsdp_layers"}),
        [],
        "trainer.strategy fsdp_layers shards per decoder layer",
    ),
    "checkpointing without layer graphs": (
        lambda t: _good(t),
        ["--model.activation_checkpointing", "true"],
        "model.activation_checkpointing recomputes decoder layers",
    ),
    "bf16 QAT with torchao's fake quantizer": (
        lambda t: _good(t, model={"recipe": "xnnpack_8da4w"}),
        ["--trainer.precision", "bf16-mixed"],
        "trainer.precision=bf16-mixed does not work with recipe 'xnnpack_8da4w'",
    ),
    "half-precision weights": (lambda t: _good(t), ["--trainer.precision", "16-true"], "trainer.precision=16-true"),
    "missing model directory": (
        lambda t: _good(t),
        ["--model.checkpoint", "{tmp}/no_model"],
        "model.checkpoint {tmp}/no_model does not exist",
    ),
    # one per family of Lightning's late refusals (the rest in-process: test_lightning_fields_refused_early)
    "trainer field Lightning refuses late": (lambda t: _good(t), ["--trainer.devices", "0"], "trainer.devices must be"),
    "checkpoint field Lightning refuses late": (
        lambda t: _good(t),
        ["--checkpoint.save_top_k", "-5"],
        "checkpoint.save_top_k must be >= -1",
    ),
    "empty config file": (lambda t: _text(t, "# nothing yet\n"), [], "c.yaml is empty"),
    "-- before the options end": (lambda t: _good(t), ["--", "x.yaml"], "`--` in the command line"),
    "model directory without config.json": (
        lambda t: _good(t),
        ["--model.checkpoint", "{tmp}"],
        "model.checkpoint {tmp} has no config.json",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_config_fails_before_torch(name, tmp_path):
    make, extra, expected = CASES[name]
    result = subprocess.run(
        [
            *(sys.executable, "-X", "importtime", "-m", "qharness", "fit", "--config", str(make(tmp_path))),
            *(a.format(tmp=tmp_path) for a in extra),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(errors) == 1 and expected.format(tmp=tmp_path) in errors[0], errors
    assert " fix: " in errors[0]
    assert "Traceback" not in result.stderr
    heavy = [line for line in lines if re.search(r"\|\s+(torch|lightning|transformers|executorch)(\.|$)", line)]
    assert not heavy, heavy[:3]


@pytest.mark.fast
def test_shipped_and_test_configs_pass(tmp_path):
    shipped = [
        ROOT / "configs" / name
        for name in ("qat_xnnpack.yaml", "ptq_xnnpack.yaml", "qat_fsdp.yaml", "qat_chat.yaml", "qat_generated.yaml")
    ]
    (tmp_path / "trained.ckpt").touch()
    for config in [*shipped, _good(tmp_path)]:
        ptq = (yaml.safe_load(config.read_text()).get("model") or {}).get("mode") == "ptq"
        for sub in ("fit", "calibrate", "validate", "test", "export", "evaluate", "sensitivity"):
            argv = [sub, "--config", str(config), "--trainer.max_steps", "5", "--model.lr=1e-3"]
            if sub == "export":  # it reads the run's last.ckpt, which a config alone does not have
                argv.append(f"--ckpt_path={tmp_path / 'trained.ckpt'}")
            if sub == "calibrate" and not ptq:
                with pytest.raises(UserError, match="calibrate needs model.mode: ptq"):
                    precheck(argv)
            else:
                precheck(argv)


@pytest.mark.fast
def test_sweep_run_configs_pass(tmp_path):
    from qharness.sweep.plan import plan
    from qharness.sweep.spec import load_sweep

    for sweep in ("sweep_xnnpack.yaml", "sweep_chat.yaml"):
        for run in plan(load_sweep(ROOT / "configs" / sweep)):
            (tmp_path / "run.yaml").write_text(yaml.safe_dump(run.config))
            precheck([run.subcommand, "--config", str(tmp_path / "run.yaml")])


def test_full_cli_config_passes(tmp_path):
    """The complete config LightningCLI prints (every section and field, as ``config.yaml`` in a run) passes."""
    printed = run_cli("fit", "--config", ROOT / "configs" / "ptq_xnnpack.yaml", "--print_config")
    assert printed.returncode == 0, printed.stderr[-2000:]
    (tmp_path / "full.yaml").write_text(printed.stdout)
    assert {"model", "data", "trainer", "checkpoint", "ckpt_path"} <= set(yaml.safe_load(printed.stdout))
    precheck(["fit", "--config", str(tmp_path / "full.yaml")])


@pytest.mark.fast
def test_overrides_and_what_it_cannot_read(tmp_path):
    cfg, unclear = merged_config(
        ["--config", str(_good(tmp_path)), "--model.lr", "-1", "--data.seq_len=16", "--trainer.callbacks+=X"]
    )
    assert cfg["model"]["lr"] == -1 and cfg["data"]["seq_len"] == 16 and cfg["data"]["batch_size"] == 4
    assert unclear == {"trainer"}
    with pytest.raises(UserError, match="model.lr must be positive"):
        precheck(["fit", "--config", str(_good(tmp_path)), "--model.lr", "-1"])
    # a whole section given another way, a config given inline, help: left to LightningCLI
    precheck(["fit", "--config", str(_good(tmp_path)), "--model", '{"lr": -1}'])
    precheck(["fit", "--config", "{model: {lr: 2.0e-4}}"])
    precheck(["fit", "--config", str(_good(tmp_path, model={"lr": -1})), "--help"])
    # a later --config overrides an earlier one, key by key
    later = Path(tmp_path / "later.yaml")
    later.write_text("model: {lr: 0.001}\n")
    precheck(["fit", "--config", str(_good(tmp_path, model={"lr": -1})), "--config", str(later)])


# Trainer and checkpoint values Lightning takes and refuses only when it builds the Trainer (a traceback after
# the model loads): (overrides, expected in the error)
LIGHTNING_LATE = {
    "devices 0": (["--trainer.devices", "0"], "trainer.devices must be auto, a number of devices >= 1"),
    "devices []": (["--trainer.devices", "[]"], "trainer.devices must be"),
    "negative max_epochs": (["--trainer.max_epochs", "-3"], "trainer.max_epochs must be positive, or -1"),
    "num_nodes 0": (["--trainer.num_nodes", "0"], "trainer.num_nodes must be >= 1 (got 0)"),
    "max_time forever": (["--trainer.max_time", "forever"], "trainer.max_time must be DD:HH:MM:SS"),
    "max_time unknown unit": (["--trainer.max_time", "{fortnights: 1}"], "trainer.max_time must be"),
    "save_top_k -5": (["--checkpoint.save_top_k", "-5"], "checkpoint.save_top_k must be >= -1 (got -5"),
    "dirpath": (["--checkpoint.dirpath", "/tmp/x"], "checkpoint.dirpath is set by qharness"),
    "bool field": (["--trainer.use_distributed_sampler", "maybe"], "trainer.use_distributed_sampler must be true or"),
    "int field": (["--trainer.num_nodes", "two"], "trainer.num_nodes must be an integer"),
}


@pytest.mark.fast
@pytest.mark.parametrize("name", list(LIGHTNING_LATE))
def test_lightning_fields_refused_early(name, tmp_path):
    extra, expected = LIGHTNING_LATE[name]
    with pytest.raises(UserError, match=re.escape(expected)) as e:
        precheck(["fit", "--config", str(_good(tmp_path)), *extra])
    assert "fix: " in str(e.value)


def test_trainer_fields_qharness_does_not_read_are_left_to_lightning(tmp_path):
    """The pre-check knows the trainer and checkpoint fields qharness reads (``qharness.schema.trainer``); any other
    name goes on to Lightning's own parser, which refuses an unknown one in one line once it is imported."""
    precheck(["fit", "--config", str(_good(tmp_path)), "--trainer.max_stepz", "5", "--checkpoint.top_k", "5"])
    result = run_cli("fit", "--config", _good(tmp_path), "--trainer.max_stepz", "5")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "max_stepz" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.fast
def test_good_lightning_values_pass(tmp_path):
    for extra in (
        ["--trainer.devices", "2", "--trainer.num_nodes", "1", "--trainer.max_epochs", "-1"],
        ["--trainer.max_time", "00:12:00:00", "--checkpoint.save_top_k", "-1"],
        ["--trainer.max_time", "{hours: 2, minutes: 30}", "--trainer.devices", "auto"],
        ["--trainer.devices", "[0, 1]", "--trainer.deterministic", "warn"],
    ):
        precheck(["fit", "--config", str(_good(tmp_path)), *extra])


@pytest.mark.fast
def test_strategy_and_accelerator_named_before_the_model_loads(monkeypatch):
    """What needs Lightning's registries or the machine: checked in preflight, before any model or data loads."""
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    from qharness.api.preflight import check_strategy_and_accelerator

    with pytest.raises(UserError, match="trainer.strategy 'foo' is not a Lightning strategy. fix: use auto, ddp"):
        check_strategy_and_accelerator("foo", "auto")
    with pytest.raises(UserError, match="trainer.accelerator 'tpuu' is not a Lightning accelerator"):
        check_strategy_and_accelerator("auto", "tpuu")
    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: False))
    for accelerator in ("gpu", "cuda"):
        with pytest.raises(UserError, match=f"trainer.accelerator {accelerator} was asked for, but this machine"):
            check_strategy_and_accelerator("auto", accelerator)
    for strategy in ("auto", "ddp", "fsdp_layers", "DDP"):
        check_strategy_and_accelerator(strategy, "cpu")


def test_cache_that_cannot_be_written_fails_before_torch(tmp_path):
    """QHARNESS_CACHE at a file (was a FileExistsError traceback) or at a read-only place (was found only after
    pretraining the embedded model): one line before torch loads."""
    (tmp_path / "afile").write_text("x")
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "qharness", "fit", str(_good(tmp_path))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "QHARNESS_CACHE": str(tmp_path / "afile" / "cache")},
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert errors == [
        f"error: QHARNESS_CACHE={tmp_path}/afile/cache: {tmp_path}/afile is a file. "
        "fix: point QHARNESS_CACHE at a writable directory (default ~/.cache/qharness)"
    ], errors
    assert not re.search(r"\|\s+torch(\.|$)", result.stderr, re.M)


@pytest.mark.fast
def test_unwritable_cache_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("QHARNESS_CACHE", "/proc/qharness_cache")
    with pytest.raises(UserError, match=r"QHARNESS_CACHE=/proc/qharness_cache: /proc is not writable"):
        precheck(["fit", "--config", str(_good(tmp_path))])
    monkeypatch.setenv("QHARNESS_CACHE", str(tmp_path / "new" / "cache"))  # to be created: fine
    precheck(["fit", "--config", str(_good(tmp_path))])
