import subprocess
import sys

import pytest
from conftest import ROOT, run_cli

HEAVY = {"torch", "lightning", "executorch", "torchao", "transformers", "datasets", "lm_eval", "wandb"}


def test_top_level_help_lists_subcommands_without_importing_heavy_libraries():
    """``qharness --help`` answers at once because it imports none of the libraries that take seconds to load
    (read from ``python -X importtime``, not from a clock)."""
    cmd = [sys.executable, "-X", "importtime", "-m", "qharness", "--help"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    for sub in ("fit", "validate", "test", "export", "recipes"):
        assert sub in r.stdout
    lines = [line for line in r.stderr.splitlines() if line.startswith("import time:")]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in lines}
    assert "qharness" in imported and imported & HEAVY == set()


def test_unknown_subcommand_exits_2_with_the_known_ones():
    r = run_cli("fitt")
    assert r.returncode == 2
    assert "unknown subcommand 'fitt'" in r.stderr and "fit" in r.stderr


def test_fit_help_documents_fields():
    r = run_cli("fit", "--help")
    assert r.returncode == 0, r.stderr
    for text in (
        "--model.recipe",
        "Backend recipe name",
        "--data.seq_len",
        "Tokens per block",
        "--deploy.max_seq_len",
        "--parity.max_ppl_rel_diff",
        "--bench.prompt_len",
        "Tokens prefilled in one call",
        "--model.distill",
        "knowledge distillation",
    ):
        assert text in r.stdout, text


def test_positional_config_and_print_config():
    r = run_cli("fit", ROOT / "configs" / "qat_xnnpack.yaml", "--trainer.max_steps", "50", "--print_config")
    assert r.returncode == 0, r.stderr
    assert "max_steps: 50" in r.stdout
    assert "recipe: xnnpack_int8_dynamic" in r.stdout
    assert "default_root_dir: runs/qat_xnnpack" in r.stdout


def test_recipes_lists_known_recipes():
    r = run_cli("recipes")
    assert r.returncode == 0, r.stderr
    assert "xnnpack_int8_dynamic" in r.stdout and "qat/ptq" in r.stdout
    assert "xnnpack_8da4w_lsq" in r.stdout and "xnnpack_int4w_lsq" in r.stdout  # the learned-scale recipes


def test_unknown_recipe_is_one_line_exit_2(tmp_path):
    r = run_cli("fit", "--model.recipe", "nope", "--trainer.default_root_dir", tmp_path)
    assert r.returncode == 2
    assert "unknown recipe 'nope'" in r.stderr and "xnnpack_int8_dynamic" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.fast
def test_configs_start_with_the_command_that_runs_them():
    for cfg in (ROOT / "configs").glob("*.yaml"):
        first = cfg.read_text().splitlines()[0]
        assert first.startswith("# qharness ") and cfg.name in first, cfg


def test_a_bench_longer_than_the_kv_cache_fails_before_training(tmp_path):
    r = run_cli("fit", "--bench.prompt_len", "250", "--trainer.default_root_dir", tmp_path)
    assert r.returncode == 2
    assert "bench.prompt_len + bench.decode_tokens = 314 exceeds" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("entry", ["python -m qharness", "console script"])
def test_the_command_exits_without_the_final_garbage_collection(entry):
    """Both ways of running ``qharness`` end with ``gc.freeze()`` (``upstream/process.exit_without_final_collection``:
    CPython's collection over the objects of an export and a lowering took 2 s at shutdown), and the exit still runs
    its atexit handlers (registered first, this one runs last)."""
    start = {
        "python -m qharness": "runpy.run_module('qharness', run_name='__main__')",
        "console script": "entry_points(group='console_scripts')['qharness'].load()()",
    }[entry]
    script = (
        "import atexit, gc, runpy, sys\n"
        "from importlib.metadata import entry_points\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
        "sys.argv = ['qharness', '--help']\n" + start
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "fit" in r.stdout, r.stderr[-2000:]
    assert int(r.stdout.rsplit("frozen at exit:", 1)[1]) > 0
