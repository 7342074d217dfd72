"""Fuzzed bad input (hypothesis): configs, recipes and data files that must each end in one error line naming the
field (``UserError``: exit 2), never a traceback, a hang or a silent success.

The default run drives the same functions the CLI calls, in-process and derandomized (the pre-check of a run
config, ``qharness.api.precheck.precheck``; the text-source loader, ``load_texts``); the ``slow`` run sends more
cases through the real ``python -m qharness fit CONFIG``. Each example is one distinct bad input.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import types
import typing
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, write_config
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qharness.api.precheck import precheck
from qharness.errors import UserError
from qharness.recipes.registry import _FIELDS as KNOWN_RECIPE_FIELDS

FAST = settings(
    max_examples=60,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
)


def more(n: int):
    return settings(FAST, max_examples=n)


@contextmanager
def time_limit(seconds: int):
    """A hang fails the example (SIGALRM in the main thread) instead of stalling the suite."""

    def _raise(signum, frame):
        raise TimeoutError(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ---------------------------------------------------------------- configs

# field: (kind, low, high). kind: int/float/bool/list/choice; a value outside [low, high] (None: no bound) is bad.
# The base config (conftest.write_config) has data.seq_len 32, batch_size 4, deploy.max_seq_len 64, eval off.
FIELDS = {
    "model.lr": ("float", 0, None, "open"),
    "model.weight_decay": ("float", 0, None),
    "model.warmup_steps": ("int", 0, None),
    "model.fake_quant_after_n_steps": ("int", 0, None),
    "model.freeze_observers_after_n_steps": ("int", 0, None),
    "model.layerwise": ("bool",),
    "model.activation_checkpointing": ("bool",),
    "model.trust_remote_code": ("bool",),
    "model.distill.kl_weight": ("float", 0, None, "open"),
    "model.distill.temperature": ("float", 0, None, "open"),
    "data.seq_len": ("int", 2, 63),
    "data.batch_size": ("int", 1, 8),
    "data.val_fraction": ("float", 0, 1, "open"),
    "trainer.max_steps": ("int", 1, None),
    "trainer.accumulate_grad_batches": ("int", 1, None),
    "trainer.check_val_every_n_epoch": ("int", 1, None),
    "trainer.gradient_clip_val": ("float", 0, None),
    "trainer.limit_val_batches": ("float", 0, None),
    "checkpoint.every_n_train_steps": ("int", 0, None),
    "deploy.max_seq_len": ("int", 33, None),
    "deploy.enabled": ("bool",),
    "parity.prompts": ("int", 1, None),
    "parity.prompt_len": ("int", 1, 32),
    "parity.decode_steps": ("int", 0, 47),
    "parity.eval_blocks": ("int", 4, None),
    "parity.max_ppl_rel_diff": ("float", 0, None),
    "parity.min_argmax_agreement": ("float", 0, 1),
    "parity.fake_quant_min_argmax_agreement": ("float", 0, 1),
    "parity.fake_quant_max_ppl_rel_diff": ("float", 0, None),
    "parity.tie_margin": ("float", 0, None),
    "parity.max_abs_diff": ("float", 0, None),
    "calibration.blocks": ("int", 1, None),
    "bench.prompt_len": ("int", 1, 56),
    "bench.decode_tokens": ("int", 1, 48),
    "bench.reps": ("int", 1, None),
    "bench.eager": ("bool",),
    "eval.limit": ("int", 1, None),
    "eval.num_fewshot": ("int", 0, None),
    "eval.bootstrap_iters": ("int", 0, None),
    "eval.max_length": ("int", 2, 32),
    "eval.tasks": ("list",),
    "wandb.enabled": ("bool",),
    "wandb.mode": ("choice", "offline", "online"),
    "wandb.tags": ("list",),
}
# fields whose range check needs eval on (eval.max_length against data.seq_len)
NEEDS = {"eval.max_length": {"eval": {"enabled": True, "tasks": ["qharness_ppl"]}}}


def _parses(text: str, kind) -> bool:
    try:
        kind(text)
        return True
    except ValueError:
        return False


texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
not_numbers = texts.filter(lambda s: not _parses(s, float))
not_bools = texts.filter(lambda s: s.strip().lower() not in {"true", "false", "yes", "no", "on", "off"})
containers = st.one_of(
    st.lists(st.integers(), min_size=1, max_size=3), st.dictionaries(texts, st.integers(), max_size=2)
)
huge = st.sampled_from([10**30, -(10**30), 1e300, -1e300, float("inf"), float("-inf"), float("nan")])


def bad_values(field: str) -> st.SearchStrategy:
    """Values of the wrong type, NaN/inf, and numbers out of the field's range."""
    kind, *bounds = FIELDS[field]
    if kind == "bool":
        return st.one_of(not_bools, st.integers(), st.floats(allow_nan=True), containers)
    if kind == "list":
        return st.one_of(st.integers(), st.floats(), st.booleans())
    if kind == "choice":
        return st.one_of(texts.filter(lambda s: s not in bounds), st.integers(), containers)
    low, high, *open_ = bounds
    wrong_type = st.one_of(not_numbers, containers, st.booleans())
    if kind == "int":
        wrong_type = st.one_of(
            wrong_type, st.floats().filter(lambda x: not x.is_integer() if math.isfinite(x) else True)
        )
    out_of_range = [st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not math.isfinite(x))]
    below = low - 1 if kind == "int" and not open_ else low
    if kind == "int":
        out_of_range.append(st.integers(max_value=low - 1))
        if high is not None:
            out_of_range.append(st.integers(min_value=high + 1, max_value=10**6))
    else:
        out_of_range.append(st.floats(max_value=below, exclude_max=not open_, allow_nan=False, allow_infinity=False))
        if high is not None:
            out_of_range.append(st.floats(min_value=high, exclude_min=True, allow_nan=False, allow_infinity=False))
    if field == "trainer.limit_val_batches":  # whole numbers of batches are fine above 1
        out_of_range = [
            st.floats(max_value=-1e-9, allow_infinity=False, allow_nan=False),
            st.floats(1.01, 1e6).filter(lambda x: x % 1),
        ]
    return st.one_of(wrong_type, *out_of_range, huge.filter(lambda x: field != "trainer.max_steps" or x != -1))


@st.composite
def bad_field(draw):
    field = draw(st.sampled_from(sorted(FIELDS)))
    value = draw(bad_values(field))
    return field, value


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        cfg = cfg.setdefault(p, {}) if isinstance(cfg.get(p), dict) else cfg.setdefault(p, {})
        if not isinstance(cfg, dict):
            raise AssertionError(dotted)
    cfg[last] = value


def _base(tmp: Path) -> dict:
    (tmp / "d.txt").write_text("some text " * 50)
    text = write_config(tmp / "base.yaml", "embedded", tmp / "d.txt", tmp / "run", bench={"enabled": True}).read_text()
    return yaml.safe_load(text)  # bench on: its fields are checked as a run that benchmarks checks them


def _override_text(value) -> str:
    """A value as the command line gives it: YAML text that reads back as ``value``."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**6)
    return text.removesuffix("\n...\n").removesuffix("\n")


def _precheck_error(tmp: Path, cfg: dict, extra: list[str]) -> str:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    with time_limit(30):
        try:
            precheck(["fit", "--config", str(path), *extra])
        except UserError as e:
            return str(e)
    raise AssertionError(f"accepted: {extra or cfg}")


def _one_line(message: str, *names: str) -> None:
    assert "\n" not in message, message
    assert any(UserError(n).what in message for n in names), message  # control characters shown escaped
    assert ". fix: " in message, message
    assert "Traceback" not in message


@pytest.mark.fast
@FAST
@given(bad=bad_field(), as_override=st.booleans(), drop=st.sets(st.sampled_from(["bench", "calibration", "wandb"])))
def test_a_bad_field_value_is_named(bad, as_override, drop):
    """One field of a good config gets a value of the wrong type, NaN/inf or out of range, in the config file or
    as a ``--section.field value`` override; sections the field does not depend on may be missing."""
    field, value = bad
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = _base(tmp)
        for section in drop - {field.split(".")[0]}:
            del cfg[section]
        for section, values in NEEDS.get(field, {}).items():
            cfg[section].update(values)
        extra = []
        if as_override:
            extra = [f"--{field}", _override_text(value)]
        else:
            _set(cfg, field, value)
        _one_line(_precheck_error(tmp, cfg, extra), field)


identifiers = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)


# ---- Lightning's trainer and checkpoint fields that qharness reads: their types come from the schema
# (qharness.schema.trainer); the ranges are those Lightning refuses only when it builds the Trainer.
CHECKABLE = re.compile(r"int|float|bool|None|Literal\[.*\]")


def _type_text(tp) -> str:
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is typing.Literal:
        return f"Literal[{', '.join(map(repr, typing.get_args(tp)))}]"
    return getattr(tp, "__name__", str(tp))


def _lightning_typed() -> dict[str, list[str]]:
    """``{group.field: type parts}`` of the trainer and checkpoint fields whose every type part the pre-check can check."""
    from qharness.schema import CheckpointConfig, TrainerConfig
    from qharness.schema.fields import hints

    out = {}
    for group, cls in (("trainer", TrainerConfig), ("checkpoint", CheckpointConfig)):
        for name, tp in hints(cls).items():
            union = typing.get_origin(tp) in (typing.Union, types.UnionType)
            parts = [_type_text(p) for p in (typing.get_args(tp) if union else (tp,))]
            if all(CHECKABLE.fullmatch(p) for p in parts):
                out[f"{group}.{name}"] = parts
    return out


LIGHTNING_TYPED = _lightning_typed()
LIGHTNING_RANGES = {
    "trainer.num_nodes": st.integers(max_value=0),
    "trainer.accumulate_grad_batches": st.integers(max_value=0),
    "trainer.reload_dataloaders_every_n_epochs": st.integers(max_value=-1),
    "trainer.max_epochs": st.one_of(st.just(0), st.integers(max_value=-2)),
    "trainer.max_steps": st.one_of(st.just(0), st.integers(max_value=-2)),
    "trainer.devices": st.one_of(st.just(0), st.just([]), st.integers(max_value=-2)),
    "trainer.max_time": st.one_of(
        texts.filter(lambda s: not re.fullmatch(r"\s*\d+:\d+:\d+:\d+\s*", s)),
        st.dictionaries(
            identifiers.filter(lambda k: k not in ("days", "hours", "minutes", "seconds")),
            st.integers(0, 9),
            min_size=1,
            max_size=2,
        ),
    ),
    "trainer.overfit_batches": st.one_of(
        st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False), st.floats(1.01, 1e6).filter(lambda x: x % 1)
    ),
    "checkpoint.save_top_k": st.integers(max_value=-2),
    "checkpoint.every_n_train_steps": st.integers(max_value=-1),
    "checkpoint.dirpath": texts.filter(lambda s: s.strip()),
}


@st.composite
def bad_lightning_field(draw):
    """A field of Lightning's Trainer or ModelCheckpoint and a value of none of its types, or out of its range."""
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(LIGHTNING_RANGES)))
        return field, draw(LIGHTNING_RANGES[field])
    field = draw(st.sampled_from(sorted(LIGHTNING_TYPED)))
    parts = LIGHTNING_TYPED[field]
    literals = [p for p in parts if p.startswith("Literal[")]
    wrong = [
        not_numbers.filter(lambda s: s.strip().lower() not in {"true", "false", "yes", "no", "on", "off", "link"}),
        st.dictionaries(identifiers, st.integers(), min_size=1, max_size=2),
        st.lists(st.integers(), min_size=1, max_size=2),
    ]
    if "float" not in parts:
        wrong.append(st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()))
    if parts == ["bool"] or parts == ["bool", "None"] or (literals and "int" not in parts):
        wrong.append(st.integers().filter(lambda n: n not in (0, 1)))
    return field, draw(st.one_of(wrong))


@pytest.mark.fast
@more(80)
@given(bad=bad_lightning_field(), as_override=st.booleans())
def test_a_bad_lightning_field_is_named(bad, as_override):
    """Trainer and checkpoint fields (Lightning's): a value of none of the field's types, or one Lightning refuses
    only once the Trainer is built (after the model loads), ends in one line naming the field before torch loads."""
    field, value = bad
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = _base(tmp)
        extra = [f"--{field}", _override_text(value)] if as_override else []
        if not as_override:
            _set(cfg, field, value)
        _one_line(_precheck_error(tmp, cfg, extra), field)


@pytest.mark.fast
def test_the_lightning_family_covers_typed_fields():
    """The generated family reaches the typed trainer and checkpoint fields qharness reads (ints, bools, optional
    ints) of both groups."""
    for field in (
        "trainer.num_nodes",
        "trainer.max_epochs",
        "trainer.use_distributed_sampler",
        "checkpoint.save_top_k",
    ):
        assert field in LIGHTNING_TYPED, sorted(LIGHTNING_TYPED)
    assert len(LIGHTNING_TYPED) >= 15


SECTIONS = ["model", "data", "trainer", "checkpoint", "deploy", "parity", "calibration", "bench", "eval", "wandb"]
KNOWN_TOP = set(SECTIONS) | {"seed_everything", "ckpt_path", "weights_only", "verbose", "pte", "tasks", "limit"}
KNOWN_TOP |= {"num_fewshot", "models"}


@pytest.mark.fast
@FAST
@given(  # trainer and checkpoint: Lightning's classes, whose other fields its own parser checks after import
    section=st.sampled_from([s for s in SECTIONS if s not in ("trainer", "checkpoint")]),
    key=st.one_of(identifiers, texts.filter(bool)),
    value=st.one_of(st.integers(), texts, st.none()),
)
def test_an_unknown_field_is_named(section, key, value):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = _base(tmp)
        if key in cfg[section] or key in _known(section):
            return
        cfg[section][key] = value
        _one_line(_precheck_error(tmp, cfg, []), f"{section}.{key}")


def _known(section):
    from qharness.schema import RunConfig
    from qharness.schema.fields import hints

    return set(hints(RunConfig.sections()[section]))


@pytest.mark.fast
@FAST
@given(
    key=st.one_of(identifiers, texts.filter(bool)).filter(lambda k: k not in KNOWN_TOP),
    section=st.sampled_from(SECTIONS),
    wrong=st.one_of(st.integers(), st.lists(st.integers(), max_size=2), st.booleans(), st.floats()),
)
@example(key="max_size_mb", section="model", wrong=0)  # autotune's key, unknown to fit (was accepted)
def test_unknown_sections_and_sections_that_are_not_mappings(key, section, wrong):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = _base(tmp)
        cfg[key] = {"x": 1}
        _one_line(_precheck_error(tmp, cfg, []), "unknown config section")
        cfg = _base(tmp)
        cfg[section] = wrong
        _one_line(_precheck_error(tmp, cfg, []), section)


odd_names = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="/\x00"), min_size=1, max_size=20)


@pytest.mark.fast
@FAST
@given(
    field=st.sampled_from(["data.source", "model.checkpoint", "calibration.source", "trainer.default_root_dir"]),
    how=st.sampled_from(["missing", "empty", "under a file", "blank", "unwritable"]),
    name=odd_names,
)
def test_odd_paths_are_named(field, how, name):
    """Paths that do not exist (unicode, spaces, dots), empty or blank strings, a path under a file, a place that
    cannot be written (/proc)."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = _base(tmp)
        (tmp / "afile").write_text("x")
        value = {
            "missing": str(tmp / "nope" / name),
            "empty": "",
            "blank": " " * (1 + len(name) % 3),
            "under a file": str(tmp / "afile" / name),
            "unwritable": f"/proc/{name}/run" if field == "trainer.default_root_dir" else f"/proc/nope/{name}",
        }[how]
        _set(cfg, field, value)
        if field == "trainer.default_root_dir" and how == "missing":
            (tmp / "c.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
            precheck(["fit", "--config", str(tmp / "c.yaml")])  # a new run directory is created: fine
            return
        _one_line(_precheck_error(tmp, cfg, []), field)


# ---------------------------------------------------------------- recipes

RECIPE_FIELDS = {
    "xnnpack_int8_dynamic": ["weight_bits", "is_per_channel", "is_dynamic"],
    "xnnpack_8da4w": ["group_size"],
}


@st.composite
def bad_recipes(draw):
    """A recipe file: YAML syntax errors, fields of the wrong type, unknown fields, bad settings."""
    kind = draw(st.sampled_from(["syntax", "quantizer", "setting", "unknown", "executorch", "modes", "base"]))
    if kind == "syntax":
        junk = draw(st.sampled_from(["{a: 1", "[1, 2", "a: b: c", "\t- x", "'open", "key: [}"]))
        return f"base: xnnpack_int8_dynamic\nquantizer: {junk}\n", "not valid YAML"
    if kind == "quantizer":
        value = draw(st.one_of(st.lists(st.integers(), min_size=1, max_size=3), st.integers(), not_bools.filter(bool)))
        return yaml.safe_dump(
            {"description": "d", "backend": "xnnpack", "modes": ["qat"], "quantizer": value}
        ), "quantizer"
    if kind == "setting":
        base = draw(st.sampled_from(sorted(RECIPE_FIELDS)))
        setting = draw(st.sampled_from(RECIPE_FIELDS[base]))
        value = draw(st.one_of(not_numbers.filter(bool), st.lists(st.integers(), min_size=1, max_size=2)))
        if setting == "group_size":
            value = draw(
                st.one_of(st.just(value), st.integers(-100, 15), st.integers(17, 10**4).filter(lambda n: n & (n - 1)))
            )
        return yaml.safe_dump({"base": base, "quantizer": {setting: value}}, allow_unicode=True), setting
    if kind == "unknown":
        key = draw(
            identifiers.filter(
                lambda k: k not in KNOWN_RECIPE_FIELDS | {"base"}  # every known field of a recipe file
            )
        )
        return yaml.safe_dump({"base": "xnnpack_int8_dynamic", key: 1}), key
    if kind == "executorch":
        key = draw(identifiers.filter(lambda k: not k.startswith(("extract_", "memory_", "emit_", "external_"))))
        return yaml.safe_dump({"base": "xnnpack_int8_dynamic", "executorch_config": {key + "_x": 1}}), key + "_x"
    if kind == "modes":
        value = draw(st.one_of(texts.filter(lambda s: s not in ("qat", "ptq")), st.integers()))
        return yaml.safe_dump({"base": "xnnpack_int8_dynamic", "modes": [value]}, allow_unicode=True), "mode"
    value = draw(st.one_of(st.integers(), st.lists(st.integers(), max_size=2), texts.map(lambda s: "no_such_" + s)))
    return yaml.safe_dump({"base": value, "modes": ["qat"]}, allow_unicode=True), "base" if not isinstance(
        value, str
    ) else "recipe"


@pytest.mark.fast
@FAST
@given(recipe=bad_recipes())
def test_a_bad_recipe_file_is_named(recipe):
    text, expected = recipe
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "r.yaml").write_text(text)
        cfg = _base(tmp)
        cfg["model"]["recipe"] = str(tmp / "r.yaml")
        message = _precheck_error(tmp, cfg, [])
        _one_line(message, expected)
        assert "r.yaml" in message or "'r'" in message or "quantizer" in message, message


# ---------------------------------------------------------------- data files

JSON_KEYS = st.dictionaries(
    identifiers.filter(lambda k: k != "text"), st.one_of(texts, st.integers()), min_size=1, max_size=3
)
NON_TEXT = st.one_of(
    st.integers(), st.floats(allow_nan=False), st.booleans(), st.lists(st.integers(), min_size=1, max_size=2)
)


@st.composite
def bad_data(draw):
    """``(file name, bytes)`` of a data file the loader must refuse, naming data.source or data.text_field."""
    kind = draw(
        st.sampled_from(
            ["empty", "binary", "latin1", "no text field", "invalid json", "non-text field", "fake parquet", "blank"]
        )
    )
    suffix = draw(st.sampled_from([".txt", ".jsonl", ".json", ".csv", ".parquet"]))
    if kind == "empty":
        return "empty" + suffix, b""
    if kind == "blank":
        return "blank.txt", draw(st.text(" \t\n\r", min_size=1, max_size=50)).encode()
    if kind == "binary":
        data = draw(st.binary(max_size=200))
        return "blob.txt", data[: len(data) // 2] + b"\x00" + data[len(data) // 2 :]
    if kind == "latin1":
        text = draw(st.text(st.characters(min_codepoint=32, max_codepoint=255), min_size=1, max_size=80))
        data = text.encode("latin-1")
        try:
            data.decode("utf-8")
            data += "\xe9".encode("latin-1")  # not UTF-8 by construction
        except UnicodeDecodeError:
            pass
        return "latin1.txt", data
    if kind == "no text field":
        rows = draw(st.lists(JSON_KEYS, min_size=1, max_size=4))
        return "rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()
    if kind == "invalid json":
        junk = draw(
            st.sampled_from(['{"text": "a"', "{not json}", '{"text": "a"}}', "[1, 2", '{"text": "x"} trailing'])
        )
        return "bad.jsonl", (junk + "\n").encode()
    if kind == "non-text field":
        values = draw(st.lists(NON_TEXT, min_size=1, max_size=4))
        values = [v for v in values if type(v) is type(values[0])]  # one type per column, as a table has
        return "numbers.jsonl", "".join(json.dumps({"text": v}) + "\n" for v in values).encode()
    return "fake.parquet", b"PAR1" * draw(st.integers(0, 2)) + draw(st.binary(max_size=100))


def _load_error(name: str, data: bytes) -> str:
    from qharness.sources.text import load_texts

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / name
        path.write_bytes(data)
        with time_limit(60):
            try:
                out = load_texts(str(path))
            except UserError as e:
                return str(e)
    raise AssertionError(f"{name} {data[:80]!r} loaded as {str(out)[:200]}")


@pytest.mark.fast
@FAST
@given(bad=bad_data())
def test_a_bad_data_file_is_refused_in_one_line(bad):
    name, data = bad
    _one_line(_load_error(name, data), "data.source", "data.text_field")
    assert name in _load_error(name, data) or "data.text_field" in _load_error(name, data)


@pytest.mark.fast
@more(3)
@given(size=st.sampled_from([3_000_000, 6_000_000]), suffix=st.sampled_from([".txt", ".jsonl"]))
def test_one_huge_line_loads_whole(size, suffix):
    """A huge single line is valid text: it loads, whole (a jsonl row too), not cut or refused."""
    from qharness.sources.text import load_texts

    line = ("abc def " * (size // 8))[:size]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / ("one" + suffix)
        path.write_text(json.dumps({"text": line}) if suffix == ".jsonl" else line)
        with time_limit(120):
            assert load_texts(str(path)) == [line]


# ---------------------------------------------------------------- the real CLI (slow)


def _cli(tmp: Path, cfg: dict, extra: list[str]) -> subprocess.CompletedProcess:
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(cfg, allow_unicode=True))
    return subprocess.run(
        [sys.executable, "-m", "qharness", "fit", str(path), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _exit_2_one_line(result: subprocess.CompletedProcess, *names: str) -> None:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert len(errors) == 1 and " fix: " in errors[0], errors
    assert any(n in errors[0] for n in names), errors


@pytest.mark.slow
@more(40)
@given(bad=bad_field(), as_override=st.booleans())
def test_cli_bad_field_value(bad, as_override):
    field, value = bad
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = _base(tmp)
        for section, values in NEEDS.get(field, {}).items():
            cfg[section].update(values)
        extra = [f"--{field}", _override_text(value)] if as_override else []
        if not as_override:
            _set(cfg, field, value)
        _exit_2_one_line(_cli(tmp, cfg, extra), field)


@pytest.mark.slow
@more(15)
@given(bad=bad_data())
def test_cli_bad_data_file(bad, tiny_llama):
    name, data = bad
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / name).write_bytes(data)
        cfg = yaml.safe_load(write_config(tmp / "base.yaml", tiny_llama, tmp / name, tmp / "run").read_text())
        _exit_2_one_line(_cli(tmp, cfg, []), "data.source", "data.text_field")
        assert not (tmp / "run" / "model.pte").exists()
