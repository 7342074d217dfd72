"""One run directory, one writer (#23): a second command on a directory in use is refused; a dead holder never blocks."""

import os
import subprocess
import sys

import pytest

from qharness.errors import UserError
from qharness.io.locks import hold_run_lock, release_run_locks

HOLD = "import sys, time; from qharness.io.locks import hold_run_lock; hold_run_lock(sys.argv[1]); print('held', flush=True); time.sleep(60)"


def _holder(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.fast
def test_a_directory_in_use_is_refused_and_freed_when_the_holder_dies(tmp_path):
    proc = _holder(tmp_path / "run")
    try:
        with pytest.raises(UserError, match=rf"in use by another qharness process \(pid {proc.pid}\)"):
            hold_run_lock(tmp_path / "run")
    finally:
        proc.kill()  # SIGKILL: no clean-up code runs
        proc.wait()
    hold_run_lock(tmp_path / "run")  # the kernel dropped the dead process's lock: no stale lock
    assert (tmp_path / "run" / ".qharness.lock").read_text().strip() == str(os.getpid())
    release_run_locks()


def test_the_cli_refuses_a_second_writer_before_any_work(tmp_path, tiny_llama, corpus):
    from conftest import run_cli, write_config

    cfg = write_config(tmp_path / "c.yaml", tiny_llama, corpus, tmp_path / "run", model={"mode": "ptq"})
    proc = _holder(tmp_path / "run")
    try:
        r = run_cli("calibrate", cfg)
    finally:
        proc.kill()
        proc.wait()
    assert r.returncode == 2 and "is in use by another qharness process" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "run" / "model.pte").exists()


@pytest.mark.fast
def test_ranks_other_than_zero_share_rank_zeros_lock(tmp_path, monkeypatch):
    proc = _holder(tmp_path / "run")
    try:
        monkeypatch.setenv("LOCAL_RANK", "1")
        hold_run_lock(tmp_path / "run")  # a DDP worker of the same run: no lock of its own, no refusal
    finally:
        proc.kill()
        proc.wait()
