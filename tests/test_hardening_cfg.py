"""Inputs a hostile or careless user gives as configs and recipes, each refused in one line before any work (or given
the right result): YAML alias bombs and huge files, FIFOs and devices given as files, recipe fields that contradict
each other, relative paths in recipes."""

import os
import time

import pytest
from conftest import write_config

from qharness.api.precheck import precheck
from qharness.errors import UserError
from qharness.io.yaml_reader import MAX_BYTES, load_yaml, read_yaml
from qharness.recipes.registry import load_recipe

# "billion laughs": nine levels of nine aliases, 9^9 values once expanded, in under 1 KB
BOMB_LEVELS = "".join(f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + BOMB_LEVELS


def _quick(fn, *args, limit_s: float = 5.0, match: str = ""):
    start = time.monotonic()
    with pytest.raises(UserError, match=match) as e:
        fn(*args)
    assert time.monotonic() - start < limit_s, f"took {time.monotonic() - start:.1f} s"
    assert "\n" not in str(e.value) and "fix:" in str(e.value)
    return str(e.value)


@pytest.mark.fast
def test_an_alias_bomb_is_refused_at_once_in_any_yaml():
    _quick(load_yaml, BOMB, match="expands to more than 100,000 values")
    _quick(load_yaml, "a: &a [1, *a]\n", match="alias to a mapping or list inside itself")
    _quick(load_yaml, "[" * 5000 + "]" * 5000, match="more than 200 deep")
    # one long string repeated by aliases: few values, many characters
    _quick(load_yaml, f"x: &x {'y' * 5000}\nl: [{', '.join(['*x'] * 5000)}]\n", match="characters through its aliases")
    # aliases and merge keys as configs use them still load
    assert load_yaml("b: &b {p: 1}\nc:\n  <<: *b\n  p: 2\nd: [*b, *b]\n")["d"] == [{"p": 1}, {"p": 1}]


def _flow_bomb() -> str:
    """A billion laughs in one flow-style YAML value (a list), as a config value or a command-line override."""
    value = "&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"
    for i in range(1, 9):
        value = f"&a{i} [{value}, " + ", ".join([f"*a{i - 1}"] * 8) + "]"
    return value


@pytest.mark.fast
def test_an_alias_bomb_in_a_run_config_its_wandb_tags_or_an_override_is_one_line(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    _quick(precheck, ["fit", "--config", str(bomb)], match=f"config file {bomb} expands to more than")
    cfg = write_config(tmp_path / "c.yaml", "embedded", "embedded", tmp_path / "run")
    cfg.write_text(cfg.read_text().replace("wandb:\n", f"wandb:\n  tags: {_flow_bomb()}\n"))
    _quick(precheck, ["fit", "--config", str(cfg)], match=f"config file {cfg} expands to more than")
    good = write_config(tmp_path / "d.yaml", "embedded", "embedded", tmp_path / "run")
    _quick(precheck, ["fit", "--config", str(good), "--wandb.tags", _flow_bomb()], match="expands to more than")
    _quick(precheck, ["fit", "--config", str(good), f"--wandb.tags={_flow_bomb()}"], match="expands to more than")


@pytest.mark.fast
def test_an_alias_bomb_among_the_users_lm_eval_task_files_is_one_line_before_lm_eval_reads_it(tmp_path):
    from qharness.evaluation.tasks import check_tasks

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    # lm-eval's own tags (!function) are not constructed, so a real task file passes
    (tasks / "mine.yaml").write_text("task: mine\nprocess_docs: !function utils.process\n")
    check_tasks(["mine"], str(tasks))
    (tasks / "bomb.yaml").write_text("task: bomb\n" + BOMB)
    _quick(check_tasks, ["mine"], str(tasks), match=f"eval.include_path task file {tasks / 'bomb.yaml'} expands to")


@pytest.mark.fast
def test_a_huge_recipe_or_config_file_is_refused_without_reading_it_all(tmp_path):
    huge = tmp_path / "huge.yaml"
    with open(huge, "w") as f:
        f.write("description: d\nbackend: xnnpack\n")
        line = "# " + "x" * 1000 + "\n"
        for _ in range(MAX_BYTES // len(line) + 10):
            f.write(line)
    _quick(load_recipe, str(huge), match=f"recipe file {huge} is over 1,048,576 bytes")
    _quick(precheck, ["fit", "--config", str(huge)], match=f"config file {huge} is over")


@pytest.mark.fast
def test_a_fifo_or_a_device_as_a_config_or_recipe_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # nobody writes to it: opening it for reading would block forever
    for path, kind in ((str(fifo), "a FIFO"), ("/dev/zero", "a character device")):
        _quick(precheck, ["fit", "--config", path], match=f"config file {path} is not a regular file \\({kind}\\)")
        _quick(read_yaml, path, "sweep config", match=f"sweep config file {path} is not a regular file")
    _quick(load_recipe, str(fifo), match=f"recipe file {fifo} is not a regular file \\(a FIFO\\)")


@pytest.mark.fast
def test_a_relative_base_is_resolved_against_the_recipes_own_folder(tmp_path, monkeypatch):
    """A user's int8 recipe ``mine/child.yaml`` on ``sibling.yaml`` beside it: from a working directory holding
    another (FP) ``sibling.yaml`` it still extends its own sibling, not the working directory's."""
    mine, elsewhere = tmp_path / "mine", tmp_path / "elsewhere"
    (mine / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (mine / "sibling.yaml").write_text("base: xnnpack_int8_dynamic\ndescription: the int8 sibling\n")
    (mine / "sub" / "deeper.yaml").write_text("base: ../sibling.yaml\ndescription: two folders down\n")
    (mine / "child.yaml").write_text("base: sibling.yaml\n")
    (mine / "grandchild.yaml").write_text("base: sub/deeper.yaml\n")
    (elsewhere / "sibling.yaml").write_text("base: xnnpack_fp32\ndescription: an FP recipe of the same name\n")
    monkeypatch.chdir(elsewhere)
    for name in ("child", "grandchild"):
        r = load_recipe(str(mine / f"{name}.yaml"))
        assert r.quantizer == "xnnpack" and r.kind == "pt2e", name
    monkeypatch.chdir(tmp_path)
    (mine / "orphan.yaml").write_text("base: missing.yaml\n")
    message = _quick(load_recipe, str(mine / "orphan.yaml"), match="base 'missing.yaml' does not exist")
    assert f"a relative base is looked for in {mine}" in message
    (mine / "named.yaml").write_text("base: sibling\n")  # a name without .yaml is a built-in's
    message = _quick(load_recipe, str(mine / "named.yaml"), match="base 'sibling' is not a known recipe")
    assert f"a relative one is looked for in {mine}" in message


@pytest.mark.fast
@pytest.mark.parametrize(
    "text, message",
    [
        (
            "base: xnnpack_int8_dynamic\nbackend: cuda\n",
            "backend: cuda does not match its quantizer, which target xnnpack",
        ),
        (
            "base: xnnpack_8da4w\nbackend: vulkan\n",
            "backend: vulkan does not match its quantizer.*fix: backend: xnnpack",
        ),
        ("base: xnnpack_fp32\nbackend: cuda\n", "backend: cuda does not match its partitioners, which target xnnpack"),
        ("base: xnnpack_fp32\nbackend: cuda\npartitioners: []\n", "backend: cuda is not a backend qharness lowers to"),
        (
            "base: xnnpack_int8_dynamic\npartitioners: [vulkan]\n",
            "partitioner 'vulkan' delegates to vulkan, but quantizer",
        ),
        (
            "base: vulkan_int8w\npartitioners: [xnnpack]\n",
            "partitioner 'xnnpack' delegates to xnnpack, but quantizer 'vulkan'",
        ),
        (
            "base: xnnpack_fp32\nexecutorch_config: {passes: [ConstPropPass]}\n",
            "executorch_config.passes takes ExecuTorch objects",
        ),
        (
            "base: xnnpack_fp32\nexecutorch_config: {memory_planning_pass: greedy}\n",
            "memory_planning_pass takes ExecuTorch",
        ),
        (
            "base: xnnpack_fp32\nexecutorch_config: {segment_alignment: 100}\n",
            "segment_alignment must be a power of two",
        ),
        (
            "base: xnnpack_fp32\nexecutorch_config: {segment_alignment: -128}\n",
            "segment_alignment must be a power of two",
        ),
        (
            "base: xnnpack_fp32\nexecutorch_config: {segment_alignment: null}\n",
            "segment_alignment must be a power of two",
        ),
        (
            "base: xnnpack_fp32\nexecutorch_config: {delegate_alignment: 3}\n",
            "delegate_alignment must be a power of two",
        ),
        (
            "base: xnnpack_fp32\nexecutorch_config: {emit_stacktrace: yes please}\n",
            "emit_stacktrace must be true or false",
        ),
        ("base: xnnpack_fp32\nexecutorch_config: {external_constants: true}\n", "separate .ptd file"),
    ],
)
def test_recipe_fields_that_contradict_the_recipe_are_refused_when_read(tmp_path, text, message):
    """Each was found only after a 35-67 s one-layer deploy check (or never: ``backend: cuda`` was recorded)."""
    path = tmp_path / "r.yaml"
    path.write_text(text)
    _quick(load_recipe, str(path), match=message)


@pytest.mark.fast
def test_recipe_fields_that_fit_still_load(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(
        "base: xnnpack_8da4w\nexecutorch_config: {segment_alignment: 4096, delegate_alignment: null, emit_stacktrace: true}\n"
    )
    r = load_recipe(str(path))
    assert r.executorch_config["segment_alignment"] == 4096 and r.backend == "xnnpack"
    path.write_text("base: xnnpack_fp32\nbackend: portable\npartitioners: []\n")
    assert load_recipe(str(path)).backend == "portable"


@pytest.mark.fast
def test_a_data_source_of_an_unsupported_type_is_found_before_the_model_loads(tmp_path, monkeypatch):
    """``data.source: notes.xlsx`` (an existing file no reader takes) was found after the architecture check."""
    import jsonargparse

    import qharness.deploy.architectures as architectures
    import qharness.sources.embedded as embedded
    import qharness.sources.models as models
    from qharness.api.preflight import preflight

    def too_late(*args, **kwargs):
        raise AssertionError("the model was resolved or checked before data.source")

    monkeypatch.setattr(models, "resolve_checkpoint", too_late)
    monkeypatch.setattr(architectures, "check_architecture", too_late)
    monkeypatch.setattr(architectures, "load_config", too_late)
    monkeypatch.setattr(embedded, "embedded_config", too_late)
    (tmp_path / "notes.xlsx").write_bytes(b"PK\x03\x04")
    cfg = yaml_config(tmp_path, data={"source": str(tmp_path / "notes.xlsx")})
    with pytest.raises(UserError, match=r"data.source .*notes.xlsx: unsupported file type '.xlsx'"):
        preflight(jsonargparse.dict_to_namespace(cfg), "fit")


def yaml_config(tmp_path, **sections) -> dict:
    """A tiny run config (``write_config``) with every field, as the CLI's parser hands it to ``preflight``."""
    from qharness.schema import RunConfig

    return RunConfig.from_yaml(
        write_config(tmp_path / "c.yaml", "embedded", "embedded", tmp_path / "run", **sections)
    ).to_dict()


@pytest.mark.fast
def test_a_fifo_or_a_device_as_a_pte_is_not_a_regular_file(tmp_path):
    from qharness.runtime.pte import program_in

    fifo = tmp_path / "model.pte"
    os.mkfifo(fifo)
    _quick(program_in, fifo, match=f".pte file {fifo} is not a regular file \\(a FIFO\\)")
    _quick(program_in, "/dev/zero", match=".pte file /dev/zero is not a regular file \\(a character device\\)")
    _quick(program_in, tmp_path / "none.pte", match="none.pte does not exist")


@pytest.mark.fast
def test_an_option_value_starting_with_a_dash_is_its_value_not_a_missing_argument(tmp_path):
    """``qharness ship CONFIG --max_ppl_increase -1%`` said the option had no value; now the value is judged."""
    from qharness.cli import commands
    from qharness.cli.args import call

    message = _quick(call, commands.ship, [str(tmp_path / "s.yaml"), "--max_ppl_increase", "-1%"], "qharness ship")
    assert "--max_ppl_increase '-1%' is negative: a perplexity increase must be >= 0%" in message
    assert "expected one argument" not in message
    # an option still missing its value (the next token is another option) is said so
    _quick(
        call, commands.ship, ["s.yaml", "--max_ppl_increase", "--prefer", "size"], "qharness ship", match="expected one"
    )


@pytest.mark.fast
def test_projections_the_group_size_does_not_divide_are_named_with_the_per_channel_rule(tmp_path, capsys):
    """Gemma 3n-style widths (a per_layer_projection of input 48 under group_size 32) stay float by the recipe's own
    rule, exit 0 at 97-98% coverage: the run says so, and the rule it prints quantizes them per channel."""
    import re

    import torch

    from qharness.deploy import coverage
    from qharness.deploy.coverage_record import Coverage, FloatWeight

    why = "recipe settings: not among nn.Linear layers whose in_features group_size=32 divides"
    cov = Coverage(
        weights=3,
        bytes=10_000,
        quantized=2,
        quantized_bytes=9_800,
        fraction=0.98,
        float={"model.layers.0.per_layer_projection": FloatWeight("recipe", why, False, "linear", 200)},
    )
    coverage.check(cov, "xnnpack_8da4w", "Gemma3nForCausalLM")
    err = capsys.readouterr().err
    assert "keeps 1 linear layer(s) in floating point, 2.0% of the linear weight bytes" in err
    assert "model.layers.0.per_layer_projection" in err
    rule = re.search(r"`(layers: \[.*\])`", err).group(1)
    assert rule == 'layers: [{match: "*per_layer_projection", group_size: null}]'
    # the printed rule is a recipe rule that quantizes the layer per channel
    path = tmp_path / "pc.yaml"
    path.write_text(f"base: xnnpack_8da4w\n{rule}\n")
    model = torch.nn.Module()
    model.per_layer_projection, model.up = torch.nn.Linear(48, 8), torch.nn.Linear(64, 8)
    assignment = load_recipe(str(path)).make_quantizer(is_qat=False).check(model)
    assert assignment == {"per_layer_projection": "8da4w-pc", "up": "8da4w-g32"}
