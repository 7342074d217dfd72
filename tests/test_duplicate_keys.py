"""A key given twice in one YAML mapping (PyYAML keeps the last one, silently) is refused with one line naming the key
and the file, in every YAML qharness reads: run configs, recipes, sweep files (``qharness.io.yaml_reader.load_yaml``)."""

import pytest
from conftest import run_cli, write_config

from qharness.errors import UserError
from qharness.io.yaml_reader import load_yaml


@pytest.mark.fast
def test_the_loader_refuses_a_key_given_twice_and_keeps_merge_keys():
    with pytest.raises(Exception, match=r"duplicate key 'lr' \(lines 2 and 4\)"):
        load_yaml("model:\n  lr: 1\n  mode: qat\n  lr: 2\n")
    # the same key in two mappings, and a merge key overridden, are not duplicates
    assert load_yaml("a: {x: 1}\nb: {x: 2}\nbase: &b {p: 1}\nc:\n  <<: *b\n  p: 2\n")["c"] == {"p": 2}


def test_a_run_config_with_a_key_twice_is_one_line_before_torch(tmp_path):
    # a model directory that does not exist: without the duplicate check the run stops there, at once, too
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "no_model", "embedded", tmp_path / "run")
    cfg.write_text(cfg.read_text().replace("  lr: 0.001\n", "  lr: 0.001\n  lr: 10000000000.0\n"))
    r = run_cli("fit", cfg)
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: config file {cfg} has the duplicate key 'lr' (lines "), r.stderr
    assert "fix:" in line and "Traceback" not in r.stderr


@pytest.mark.fast
def test_a_recipe_with_a_key_twice_is_refused(tmp_path):
    from qharness.recipes.registry import load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("base: xnnpack_int8_dynamic\nquantizer: {weight_bits: 4}\nquantizer: {weight_bits: 8}\n")
    with pytest.raises(UserError, match=rf"recipe file {path} has the duplicate key 'quantizer' \(lines 2 and 3\)"):
        load_recipe(str(path))


@pytest.mark.fast
def test_a_sweep_file_with_a_key_twice_is_refused(tmp_path):
    from qharness.sweep.spec import load_sweep

    path = tmp_path / "sweep.yaml"
    path.write_text("runs:\n  - recipe: xnnpack_int8_dynamic\n    modes: [ptq]\n    modes: [qat]\n")
    with pytest.raises(
        UserError, match=r"sweep config file .*sweep.yaml has the duplicate key 'modes' \(lines 3 and 4\)"
    ):
        load_sweep(path)
