"""Locks that speak: a run waiting on another process's lock (token cache, cached model) says at once whom it
waits for (pid, task, lock file), takes the lock when the holder is done, and gives up with one line naming the pid
and how to free the lock when the holder is stopped (SIGSTOP) or the wait runs past its bound
(``qharness.io.locks.hold_lock``); a run directory held by a stopped process says so."""

import os
import subprocess
import sys
import time

import pytest

from qharness.errors import UserError
from qharness.io.locks import hold_lock, hold_run_lock, release_run_locks

HOLD = (
    "import os, signal, sys, time\n"
    "from qharness.io.locks import hold_lock, hold_run_lock\n"
    "how, path = sys.argv[1], sys.argv[2]\n"
    "def hold():\n"
    "    print('held', flush=True)\n"
    "    if os.environ.get('STOP_SELF'):\n"
    "        os.kill(os.getpid(), signal.SIGSTOP)\n"
    "    time.sleep(float(os.environ.get('HOLD_S', '60')))\n"
    "if how == 'run':\n"
    "    hold_run_lock(path); hold()\n"
    "else:\n"
    "    with hold_lock(path, 'a test holder'): hold()\n"
)


def _holder(how, path, **env):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, how, str(path)], stdout=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    assert proc.stdout.readline().strip() == "held"
    if env.get("STOP_SELF"):
        for _ in range(100):  # until it has stopped itself
            if open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T":
                break
            time.sleep(0.05)
    return proc


def _end(proc):
    proc.kill()  # SIGKILL ends a stopped process too
    proc.wait()


@pytest.mark.fast
def test_a_stopped_holder_is_named_at_once_and_given_up_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QHARNESS_LOCK_STOPPED_S", "1")
    proc = _holder("lock", tmp_path / "x.lock", STOP_SELF="1")
    try:
        start = time.monotonic()
        with pytest.raises(UserError) as e:
            with hold_lock(tmp_path / "x.lock", "a test waiter"):
                pass
        waited = time.monotonic() - start
    finally:
        _end(proc)
    assert 1 <= waited < 10
    err = capsys.readouterr().err
    assert f"[qharness] waiting for pid {proc.pid} (a test holder), which holds {tmp_path / 'x.lock'}" in err
    assert str(e.value) == (
        f"{tmp_path / 'x.lock'} is held by pid {proc.pid} (a test holder), which is stopped (SIGSTOP or Ctrl-Z) and "
        f"cannot finish. fix: resume it (kill -CONT {proc.pid}) or end it (kill {proc.pid}): the lock is freed when "
        "it exits"
    )


def test_a_running_holder_is_waited_for_and_the_wait_is_bounded(tmp_path, monkeypatch, capsys):
    proc = _holder("lock", tmp_path / "x.lock", HOLD_S="1.5")  # it ends by itself: the waiter takes over
    try:
        with hold_lock(tmp_path / "x.lock", "a test waiter"):
            assert (tmp_path / "x.lock").read_text() == f"{os.getpid()} a test waiter\n"
    finally:
        _end(proc)
    err = capsys.readouterr().err
    assert f"waiting for pid {proc.pid} (a test holder)" in err and "is free after" in err
    monkeypatch.setenv("QHARNESS_LOCK_WAIT_S", "1")
    proc = _holder("lock", tmp_path / "x.lock")  # runs on, but past the bound
    try:
        with pytest.raises(UserError, match=rf"gave up after waiting 1 s for pid {proc.pid} \(a test holder\)"):
            with hold_lock(tmp_path / "x.lock", "a test waiter"):
                pass
    finally:
        _end(proc)


@pytest.mark.fast
def test_a_run_directory_held_by_a_stopped_process_says_so(tmp_path):
    proc = _holder("run", tmp_path / "run", STOP_SELF="1")
    try:
        with pytest.raises(UserError, match=rf"\(pid {proc.pid}\), which is stopped .*kill -CONT {proc.pid}"):
            hold_run_lock(tmp_path / "run")
    finally:
        _end(proc)
        release_run_locks()


def test_a_run_on_the_same_data_as_a_stopped_run_says_whom_it_waits_for_and_gives_up(
    tmp_path, tiny_llama, corpus, monkeypatch
):
    """The issue's case: the token-cache lock of this data held by a stopped process; another run (its own run
    directory) waited for more than 5 minutes without a word."""
    from conftest import run_cli, write_config

    data = tmp_path / "data.txt"
    data.write_text(corpus.read_text()[:60_000])  # a file of its own: no token cache of it exists yet
    key = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from transformers import AutoTokenizer; from qharness.sources.token_cache import cache_key, "
            "PIECE_CHARS; print(cache_key(sys.argv[1], 'text', 'train', AutoTokenizer.from_pretrained(sys.argv[2]), "
            "PIECE_CHARS))",
            str(data),
            str(tiny_llama),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    lock = os.path.join(os.environ["QHARNESS_CACHE"], "tokens", f"{key}.lock")
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    proc = _holder("lock", lock, STOP_SELF="1")
    cfg = write_config(tmp_path / "c.yaml", tiny_llama, data, tmp_path / "run", data={"seq_len": 16})
    monkeypatch.setenv("QHARNESS_LOCK_STOPPED_S", "2")
    try:
        r = run_cli("fit", cfg, timeout=300)  # before: waited without a word until this timeout
    finally:
        _end(proc)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"[qharness] waiting for pid {proc.pid} (a test holder), which holds {lock}" in r.stderr
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: {lock} is held by pid {proc.pid} (a test holder), which is stopped (SIGSTOP or Ctrl-Z)")
    )
    assert not (tmp_path / "run" / "model.pte").exists()
