"""The run config's schema (qharness/schema): one dataclass per section, from which the CLI's options and --help, the
check before torch loads, the Python configs and docs/config-reference.md are all derived.

``test_every_field_reaches_every_place`` walks every field of every section: a field added to one dataclass must show
up in ``qharness fit --help`` with its help text, be known to (and type-checked by) the pre-check, be accepted by
``RunConfig``, and appear in the reference; a field that fails to reach one of them fails here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import yaml
from conftest import ROOT

from qharness.api.precheck import check_config
from qharness.errors import UserError
from qharness.schema import RunConfig
from qharness.schema import run as run_module
from qharness.schema.fields import field_docs, hints
from qharness.schema.reference import PATH, reference


def _fields():
    """``(section, field, dataclass)`` of every field of every section, nested ones (``model.distill``) included."""
    from qharness.schema.reference import _nested

    for section, cls in RunConfig.sections().items():
        for f in dataclasses.fields(cls):
            yield section, f.name, cls
        for name, nested in _nested(cls):
            for f in dataclasses.fields(nested):
                yield f"{section}.{name}", f.name, nested


def _words(text: str) -> str:
    return " ".join(text.split())


def test_schema_imports_without_torch():
    """The schema, the pre-check and the reference load neither torch, Lightning nor transformers (fresh process)."""
    code = (
        "import sys, qharness.schema, qharness.schema.reference, qharness.api.precheck\n"
        "heavy = [m for m in ('torch', 'lightning', 'transformers', 'executorch') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "qharness.schema.RunConfig().validate('fit')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.fast
def test_every_field_has_a_type_a_default_and_help():
    for section, name, cls in _fields():
        f = {f.name: f for f in dataclasses.fields(cls)}[name]
        assert name in hints(cls), f"{section}.{name}: no type"
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, name
        assert field_docs(cls).get(name), f"{section}.{name}: no line in {cls.__name__}'s Args:"


def _default(cls, name):
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return list(value) if isinstance(value, tuple) else value


def _takes_a_mapping(tp) -> bool:
    import typing

    members = typing.get_args(tp) or (tp,)
    return any(m is dict or dataclasses.is_dataclass(m) or typing.get_origin(m) is dict for m in members)


# fields the CLI sets from others (QHarnessCLI.add_arguments_to_parser's links): no options of their own
LINKED = {f"{section}.{name}" for section, name in run_module.LINKED}


def _help(monkeypatch, *args: str) -> str:
    """``qharness fit ARGS`` help text as the CLI prints it (in-process: the same parser, without a process start)."""
    from qharness.api.lightning_cli import run_lightning_cli

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        run_lightning_cli(["fit", *args])
    return _words(out.getvalue())


@pytest.mark.fast
def test_every_field_reaches_every_place(monkeypatch):
    """For every field: ``qharness fit --help`` shows it (with its help text, for qharness's own sections), the
    pre-check knows it (its default passes into the ``RunConfig`` it returns; a value of no type it takes is one
    ``UserError`` naming it), and the config reference lists it."""
    pages = {"": _help(monkeypatch, "--help")}
    pages |= {f"model.{n}": _help(monkeypatch, f"--model.{n}.help") for n in ("distill", "lora")}
    text = reference()
    for section, name, cls in _fields():
        dotted, top = f"{section}.{name}", section.split(".")[0]
        page = pages.get(section, pages[""])
        if dotted in LINKED:
            assert f"--{dotted} " not in page, f"{dotted}: linked, yet an option"
        else:
            assert f"--{dotted} " in page, f"{dotted}: not an option of qharness fit"
        if top not in ("trainer", "checkpoint"):  # those two show Lightning's own help text
            squeezed = re.sub(r"\s+", "", field_docs(cls)[name])[:60]
            assert squeezed in re.sub(r"\s+", "", page), f"{dotted}: its help is not in qharness fit --help"
        assert f"| `{dotted}` |" in text, f"{dotted}: not in docs/config-reference.md"
        if dotted == "checkpoint.dirpath":
            continue  # set by qharness: refused when given (test_precheck)
        cfg: dict = {}
        node = cfg
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[name] = _default(cls, name)
        got = check_config(cfg, subcommand="validate")
        for part in dotted.split("."):
            got = getattr(got, part)
        assert got == node[name] or list(got) == node[name], dotted
        if not _takes_a_mapping(hints(cls)[name]):
            node[name] = {"a": "mapping"}
            with pytest.raises(UserError, match=re.escape(dotted)):
                check_config(cfg, subcommand="validate")


def test_reference_is_current():
    """docs/config-reference.md is what ``python -m qharness.schema.reference`` writes from the schema."""
    assert PATH.read_text() == reference(), "run: python -m qharness.schema.reference"


@pytest.mark.fast
def test_trainer_fields_are_lightnings():
    """The trainer and checkpoint fields qharness reads are Lightning's own (a renamed one fails here)."""
    import inspect

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    for section, cls in (("trainer", Trainer), ("checkpoint", ModelCheckpoint)):
        ours = set(hints(RunConfig.sections()[section]))
        assert ours <= set(inspect.signature(cls).parameters), ours - set(inspect.signature(cls).parameters)


@pytest.mark.fast
def test_run_config_from_yaml_and_validate(tmp_path, monkeypatch):
    run = RunConfig.from_yaml(ROOT / "configs" / "qat_xnnpack.yaml", {"model.lr": "2e-4", "trainer.max_steps": 7})
    assert run.model.lr == 2e-4 and run.trainer.max_steps == 7
    run.validate("fit")
    with pytest.raises(UserError, match="deploy.max_seq_len=64 must exceed data.seq_len=128"):
        RunConfig.from_yaml(ROOT / "configs" / "qat_xnnpack.yaml", {"deploy.max_seq_len": 64}).validate("fit")
    again = RunConfig.from_dict(run.to_dict())  # the mapping a config file holds, read back
    assert again.model == run.model and again.trainer == run.trainer and again.eval == run.eval
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run.to_dict()))
    printed = _help(
        monkeypatch, "--config", str(tmp_path / "run.yaml"), "--print_config"
    )  # Lightning's parser takes it
    assert "min_lr_ratio: 0.1" in printed and "lr: 0.0002" in printed
    with pytest.raises(UserError, match="unknown config field.s. model.lrr"):
        RunConfig.from_yaml(ROOT / "configs" / "qat_xnnpack.yaml", {"model.lrr": 1})


@pytest.mark.fast
def test_min_lr_ratio_is_where_the_cosine_decay_ends(tmp_path):
    """``model.min_lr_ratio`` (added to ``ModelConfig`` alone): the learning rate the schedule ends at; a value
    outside [0, 1] is one line before torch loads."""
    import torch

    from qharness.training.module import QuantLM

    for ratio in (0.0, 0.1, 0.5):
        module = QuantLM(min_lr_ratio=ratio, lr=1e-3, warmup_steps=2)
        module.graph = torch.nn.Module()
        module.graph.model = torch.nn.Linear(2, 2)
        module._trainer = SimpleNamespace(estimated_stepping_batches=10)
        sched = module.configure_optimizers()["lr_scheduler"]["scheduler"]
        for _ in range(12):
            sched.optimizer.step()
            sched.step()
        assert sched.get_last_lr()[0] == pytest.approx(1e-3 * ratio), ratio
    with pytest.raises(UserError, match=re.escape("model.min_lr_ratio must lie in [0, 1] (got 2)")):
        RunConfig.from_yaml(ROOT / "configs" / "qat_xnnpack.yaml", {"model.min_lr_ratio": 2})


def test_bad_min_lr_ratio_fails_in_about_a_second(tmp_path):
    """Through the CLI: one error line, before torch, lightning or transformers load."""
    from conftest import write_config

    config = write_config(tmp_path / "c.yaml", "embedded", "embedded", tmp_path / "run")
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "qharness", "fit", str(config), "--model.min_lr_ratio", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - start
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and errors == [
        "error: model.min_lr_ratio must lie in [0, 1] (got 2). fix: e.g. model.min_lr_ratio: 0.1"
    ], result.stderr[-2000:]
    assert not re.search(r"\|\s+(torch|lightning|transformers)(\.|$)", result.stderr, re.M)
    print(f"bad model.min_lr_ratio refused in {seconds:.2f} s")
