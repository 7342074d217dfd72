"""What a killed writer leaves behind (a hidden temp file beside a result, a ``<name>.tmp<pid>`` directory in the
cache) is removed by the next command on that directory, and only that: never a live process's temporary, never
a file of another name. The kills themselves are driven by the slow ``tests/test_kills.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qharness.io.atomic import atomic_dir, write_bytes_atomic
from qharness.io.temps import remove_stale_temps, temp_dir_for

# a writer that creates its temporary the way write_bytes_atomic does, says so, then waits to be killed
_WRITER = """
import os, sys, tempfile, time
fd, tmp = tempfile.mkstemp(dir=sys.argv[1], prefix=f".model.pte.{os.getpid()}.", suffix=".tmp")
os.write(fd, b"half a program")
d = os.path.join(sys.argv[1], f"cache_entry.tmp{os.getpid()}")
os.mkdir(d)
print(tmp, d, flush=True)
time.sleep(600)
"""


def _writer(directory):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(directory)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().split()


@pytest.mark.fast
def test_temps_of_killed_writers_are_removed_and_live_ones_kept(tmp_path):
    killed, (dead_file, dead_dir) = _writer(tmp_path)
    killed.kill()  # SIGKILL: no clean-up runs
    killed.wait()
    live, (live_file, live_dir) = _writer(tmp_path)
    try:
        keep = ["model.pte", ".qharness.lock", "notes.tmp", ".x.tmp", "dir.tmpdir", ".model.pte.abc.tmp"]
        for name in keep:
            (tmp_path / name).write_text("mine")
        removed = remove_stale_temps(tmp_path)
        assert sorted(map(str, removed)) == sorted([dead_file, dead_dir])
        assert not os.path.exists(dead_file) and not os.path.exists(dead_dir)
        assert os.path.exists(live_file) and os.path.isdir(live_dir)  # its writer still runs
        assert all((tmp_path / name).exists() for name in keep)
        old = time.time() - 2 * 24 * 3600  # a temporary this old is stale whoever wrote it
        os.utime(live_file, (old, old))
        assert remove_stale_temps(tmp_path) == [tmp_path / os.path.basename(live_file)]
        assert os.path.isdir(live_dir)
    finally:
        live.kill()
        live.wait()
    assert remove_stale_temps(tmp_path) == [tmp_path / os.path.basename(live_dir)]
    assert remove_stale_temps(tmp_path / "missing") == []


@pytest.mark.fast
def test_atomic_writers_name_their_temporaries_so_they_can_be_found(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append(os.path.basename(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    write_bytes_atomic(tmp_path / "summary.json", b"{}")
    for name in ("a.json", "b.json"):
        with atomic_dir(tmp_path / "tokenizer") as d:
            (d / name).write_text("1")
    assert seen[0].startswith(f".summary.json.{os.getpid()}.") and seen[0].endswith(".tmp")
    assert seen[1].startswith(f".tokenizer.{os.getpid()}.") and seen[1].endswith(".tmp")
    assert temp_dir_for(tmp_path / "tokenizer").name == f"tokenizer.tmp{os.getpid()}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json", "tokenizer"]  # no temporaries left
    assert [p.name for p in (tmp_path / "tokenizer").iterdir()] == ["b.json"]
    monkeypatch.undo()
    # the pattern remove_stale_temps knows is the one the writers use: a dead pid's temporary is found
    dead = tmp_path / seen[0].replace(f".{os.getpid()}.", f".{_dead_pid()}.")
    dead.write_text("x")
    dead_dir = tmp_path / seen[1].replace(f".{os.getpid()}.", f".{_dead_pid()}.")
    dead_dir.mkdir()  # a killed atomic_dir's directory
    assert sorted(remove_stale_temps(tmp_path)) == sorted([dead, dead_dir])


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.fast
def test_taking_a_run_directory_cleans_it_and_its_checkpoints(tmp_path):
    from qharness.io.locks import hold_run_lock, release_run_locks

    pid = _dead_pid()
    stale = [tmp_path / f".model.pending.pte.{pid}.abcd1234.tmp", tmp_path / "checkpoints" / f".last.ckpt.{pid}.x.tmp"]
    stale[1].parent.mkdir()
    for path in stale:
        path.write_bytes(b"\0" * 1000)
    try:
        hold_run_lock(tmp_path)
    finally:
        release_run_locks()
    assert not any(p.exists() for p in stale)


@pytest.mark.fast
def test_the_cache_builder_cleans_temporaries_of_dead_builds(tmp_path):
    """A killed pretraining of the embedded model leaves ``<key>.tmp<pid>`` in the cache; the next build removes it."""
    from qharness.sources.embedded import EmbeddedSpec, pretrain_embedded
    from qharness.sources.text import embedded_corpus

    stale = tmp_path / f"embedded-abc.tmp{_dead_pid()}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 100)
    dims = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    spec = EmbeddedSpec(**dims, steps=2, batch_size=2, seq_len=16, vocab_size=300)
    pretrain_embedded(spec, tmp_path / "embedded-def", ["\n\n".join(embedded_corpus(20_000))[:20_000]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["embedded-def"]  # built; the dead build's leftovers gone


@pytest.mark.fast
@pytest.mark.parametrize("status", [None, {"config_sha256": "other", "returncode": None}])
def test_a_sweep_resumes_only_a_started_qat_run_of_the_same_config(tmp_path, status):
    from qharness.sweep.plan import SweepRun
    from qharness.sweep.resume import STATUS, resumable

    run = SweepRun("int8-qat", "xnnpack_int8_dynamic", "qat", {"trainer": {"max_steps": 6}}, tmp_path / "r")
    (run.run_dir / "checkpoints").mkdir(parents=True)
    (run.run_dir / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    if status is not None:
        (run.run_dir / STATUS).write_text(json.dumps(status))
    assert not resumable(run)
    (run.run_dir / STATUS).write_text(json.dumps({"config_sha256": run.digest(), "returncode": None}))
    assert resumable(run)
    ptq = SweepRun("int8-ptq", "xnnpack_int8_dynamic", "ptq", run.config, run.run_dir)
    assert not resumable(ptq)  # nothing to resume: calibration starts over
    (run.run_dir / "checkpoints" / "last.ckpt").unlink()
    assert not resumable(run)


@pytest.mark.fast
def test_checkpoints_are_written_beside_themselves_and_renamed(tmp_path, monkeypatch):
    """Lightning's own checkpoint write goes through a temp file in $TMPDIR (left there by a kill, copied rather
    than renamed across file systems); the CLI's ``AtomicCheckpointIO`` writes one beside the checkpoint."""
    import tempfile

    import torch

    from qharness.training.checkpoints import AtomicCheckpointIO

    elsewhere = tmp_path / "tmpdir"
    elsewhere.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(elsewhere))
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append((src, dst)), real_replace(src, dst))[1])
    path = tmp_path / "run" / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 3, "w": torch.ones(2)}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 3
    [(src, dst)] = renamed
    assert (
        Path(src).parent == path.parent
        and Path(dst) == path
        and Path(src).name.startswith(f".last.ckpt.{os.getpid()}.")
    )
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]
