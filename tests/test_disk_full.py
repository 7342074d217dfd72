"""A full disk (#23): every write of a run's outputs ends in one line naming the file, about the space it needs and
the space free (exit 2); the file it would have replaced (a checkpoint, a ``.pte``, the tokenizer) stays whole and
no temporary file is left. Default suite: ENOSPC injected at the write, and a real 1 MB tmpfs when this machine
lets an unprivileged user mount one; slow: ``qharness fit`` on a tmpfs that fills at the second checkpoint, then a
resume from the checkpoint kept."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qharness.errors import DiskFullError
from qharness.io.atomic import atomic_dir, torch_save_atomic, write_bytes_atomic

LINE = re.compile(
    r"^error: no space left on device writing (?P<path>\S+) \((?:needs about (?P<needed>[\d.]+) MB, )?"
    r"(?P<free>[\d.]+) MB free\)\. fix: free space or point (?P<field>\S+) elsewhere$"
)
ROOT = Path(__file__).resolve().parent.parent


def _enospc_on_write(monkeypatch, after: int = 0) -> None:
    """Files opened by qharness.io's atomic writers raise ENOSPC once ``after`` bytes have been written."""
    real = os.fdopen

    class Full:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, b):
            if self.written + len(b) > after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.written += len(b)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: Full(real(fd, *a, **k)))


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.fast
def test_a_full_disk_keeps_the_old_pte_and_names_the_path_and_the_space(tmp_path, monkeypatch):
    pte = tmp_path / "model.pte"
    write_bytes_atomic(pte, b"old program")
    _enospc_on_write(monkeypatch, after=1000)
    with pytest.raises(DiskFullError) as info:
        write_bytes_atomic(pte, b"\0" * 2_500_000)
    m = LINE.match(f"error: {info.value}")
    assert m, str(info.value)
    assert m["path"] == str(pte) and m["needed"] == "2.5" and m["field"] == "trainer.default_root_dir"
    assert float(m["free"]) == pytest.approx(shutil.disk_usage(tmp_path).free / 1e6, rel=0.05, abs=0.5)
    assert pte.read_bytes() == b"old program"
    assert _hidden(tmp_path) == []  # the temporary file is gone


@pytest.mark.fast
def test_other_write_errors_stay_what_they_are(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    with pytest.raises(OSError) as info:
        write_bytes_atomic(tmp_path / "summary.json", b"{}")
    assert info.value.errno == errno.EIO and not isinstance(info.value, DiskFullError)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.fast
def test_a_full_disk_keeps_the_old_tokenizer_dir(tmp_path, monkeypatch):
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("old")

    def save(d: Path) -> None:
        (d / "tokenizer_config.json").write_text("{}")
        with open(d / "tokenizer.json", "w") as f:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), f.name)  # over quota: the same line

    with pytest.raises(DiskFullError) as info:
        with atomic_dir(tok) as d:
            save(d)
    m = LINE.match(f"error: {info.value}")
    assert m and m["path"] == str(tok) and m["needed"] is None, str(info.value)
    assert (tok / "tokenizer.json").read_text() == "old" and [p.name for p in tok.iterdir()] == ["tokenizer.json"]
    assert _hidden(tmp_path) == []


@pytest.mark.fast
def test_a_full_disk_keeps_the_last_checkpoint_loadable(tmp_path, monkeypatch):
    import torch

    ckpt = tmp_path / "checkpoints" / "last.ckpt"  # AtomicCheckpointIO (the fit's) saves with torch_save_atomic
    torch_save_atomic({"global_step": 3, "state_dict": {"w": torch.ones(1000)}}, ckpt)
    _enospc_on_write(monkeypatch, after=4096)
    with pytest.raises(DiskFullError) as info:
        torch_save_atomic({"global_step": 6, "state_dict": {"w": torch.zeros(500_000)}}, ckpt)
    m = LINE.match(f"error: {info.value}")
    assert m and m["path"] == str(ckpt) and m["needed"] == "2.0", str(info.value)  # 500k float32
    kept = torch.load(ckpt, weights_only=True)
    assert kept["global_step"] == 3 and torch.equal(kept["state_dict"]["w"], torch.ones(1000))
    assert _hidden(ckpt.parent) == []


@pytest.mark.fast
def test_the_cli_prints_one_line_for_a_full_disk_anywhere(monkeypatch, capsys, tmp_path):
    """A write outside qharness's own helpers (Lightning's CSV log, a library's save) that fills the disk, and a
    ``DiskFullError`` followed by another error while Lightning cleans up: one line, exit 2, no traceback."""
    from qharness.cli import commands, main

    def logs_fill_the_disk() -> None:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "metrics.csv"))
        except OSError as e:
            raise RuntimeError("logger failed") from e

    def cleanup_fails_after_a_full_disk() -> None:
        try:
            raise DiskFullError(
                "no space left on device writing x/last.ckpt (needs about 1.3 MB, 0.2 MB free)", fix="free space"
            )
        except DiskFullError:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) from None

    for fn, path in ((logs_fill_the_disk, str(tmp_path / "metrics.csv")), (cleanup_fails_after_a_full_disk, None)):
        monkeypatch.setattr(commands, "recipes", fn)
        with pytest.raises(SystemExit) as info:
            main.main(["recipes"])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        if path:
            m = LINE.match(err[0])
            assert m and m["path"] == path and m["needed"] is None, err
        else:
            assert (
                err[0]
                == "error: no space left on device writing x/last.ckpt (needs about 1.3 MB, 0.2 MB free). fix: free space"
            )


def _unshare_tmpfs(size: str, script: str, cwd: Path) -> subprocess.CompletedProcess:
    """``script`` (sh) with a private tmpfs of ``size`` mounted on ``$RUN`` (a new user + mount namespace: no root
    needed where the kernel allows unprivileged user namespaces); skipped, with the reason, where it cannot mount."""
    if shutil.which("unshare") is None:
        pytest.skip("a full disk needs a tmpfs: `unshare` (util-linux) is not installed")
    run = cwd / "run"
    run.mkdir()
    wrapped = f'mount -t tmpfs -o size={size} tmpfs "$RUN" || exit 97\n{script}'
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", wrapped],
        cwd=ROOT,
        env={**os.environ, "RUN": str(run), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode == 97 or (result.returncode and "unshare:" in result.stderr):
        pytest.skip(f"cannot mount a tmpfs as this user here: {result.stderr.strip()[-300:]}")
    return result


def test_a_real_full_tmpfs(tmp_path):
    """The same on a real 1 MB tmpfs: the kernel's ENOSPC (for the checkpoint, inside ``torch.save``)."""
    code = textwrap.dedent(
        """
        import os, sys, torch
        from qharness.errors import DiskFullError
        from qharness.io.atomic import torch_save_atomic, write_bytes_atomic
        run = os.environ["RUN"]
        write_bytes_atomic(f"{run}/model.pte", b"old")
        torch_save_atomic({"w": torch.ones(100_000)}, f"{run}/checkpoints/last.ckpt")  # 0.4 MB
        for write in (lambda: write_bytes_atomic(f"{run}/model.pte", bytes(1_500_000)),
                      lambda: torch_save_atomic({"w": torch.zeros(200_000)}, f"{run}/checkpoints/last.ckpt")):
            try:
                write()
            except DiskFullError as e:
                print(f"error: {e}")
        print(open(f"{run}/model.pte", "rb").read(), torch.load(f"{run}/checkpoints/last.ckpt")["w"].sum().item())
        print(sorted(os.listdir(run)), os.listdir(f"{run}/checkpoints"))
        """
    )
    (tmp_path / "fill.py").write_text(code)
    result = _unshare_tmpfs("1m", f'"{sys.executable}" "{tmp_path / "fill.py"}"', tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout.splitlines()
    pte, ckpt = LINE.match(out[0]), LINE.match(out[1])
    assert pte and pte["path"].endswith("/run/model.pte") and pte["needed"] == "1.5", out
    assert ckpt and ckpt["path"].endswith("/run/checkpoints/last.ckpt") and ckpt["needed"] == "0.8", out
    assert float(pte["free"]) < 1.0
    assert out[2] == "b'old' 100000.0", out  # both old files whole
    assert out[3] == "['checkpoints', 'model.pte'] ['last.ckpt']", out  # no temporary file left


@pytest.mark.slow
def test_fit_on_a_full_disk_fails_in_one_line_and_resumes_from_the_last_checkpoint(tmp_path, tiny_llama, corpus):
    """``qharness fit`` with its run directory on a 2 MB tmpfs: the step-3 checkpoint (1.3 MB) fits, the step-6 one
    does not. One line, exit 2, the step-3 ``last.ckpt`` whole; after the tmpfs grows, ``--ckpt_path last`` resumes
    from it and finishes (the ``.pte`` and summary written)."""
    from conftest import write_config

    cfg = write_config(tmp_path / "run.yaml", tiny_llama, corpus, tmp_path / "run", bench={"enabled": False})
    out = tmp_path / "out"
    out.mkdir()
    qh = f'"{sys.executable}" -m qharness fit "{cfg}"'
    script = f"""
        {qh} > "{out}/1.out" 2> "{out}/1.err"; echo $? > "{out}/1.rc"
        ls -A "$RUN/checkpoints" > "{out}/1.ls"; cp "$RUN/checkpoints/last.ckpt" "{out}/kept.ckpt"
        mount -o remount,size=16m "$RUN" || exit 98
        {qh} --ckpt_path last > "{out}/2.out" 2> "{out}/2.err"; echo $? > "{out}/2.rc"
        ls -A "$RUN" > "{out}/2.ls"; cp "$RUN/checkpoints/last.ckpt" "{out}/final.ckpt"
    """
    result = _unshare_tmpfs("2m", textwrap.dedent(script), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    err = (out / "1.err").read_text()
    assert (out / "1.rc").read_text().strip() == "2", err[-3000:]
    assert "Traceback" not in err and "Traceback" not in (out / "1.out").read_text()
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err[-3000:]
    m = LINE.match(errors[0])
    assert m and m["path"] == str(tmp_path / "run" / "checkpoints" / "last.ckpt"), errors
    assert m["field"] == "trainer.default_root_dir" and 1.2 <= float(m["needed"]) <= 1.4, errors
    assert float(m["free"]) < float(m["needed"])
    assert (out / "1.ls").read_text().split() == ["last.ckpt"]  # no temporary checkpoint left
    import torch

    kept = torch.load(out / "kept.ckpt", weights_only=True)
    assert kept["global_step"] == 3  # the checkpoint before the disk filled
    assert (out / "2.rc").read_text().strip() == "0", (out / "2.err").read_text()[-3000:]
    assert torch.load(out / "final.ckpt", weights_only=True)["global_step"] == 6
    assert {"model.pte", "summary.json", "tokenizer"} <= set((out / "2.ls").read_text().split())


@pytest.mark.slow
def test_calibrate_on_a_full_disk_names_the_pte_and_leaves_no_file(tmp_path, tiny_llama, corpus):
    """PTQ (no checkpoints) with its run directory on a 200 KB tmpfs: the 0.26 MB ``.pte`` does not fit."""
    from conftest import write_config

    cfg = write_config(
        tmp_path / "run.yaml", tiny_llama, corpus, tmp_path / "run", model={"mode": "ptq"}, bench={"enabled": False}
    )
    out = tmp_path / "out"
    out.mkdir()
    script = f"""
        "{sys.executable}" -m qharness calibrate "{cfg}" > "{out}/1.out" 2> "{out}/1.err"; echo $? > "{out}/1.rc"
        ls -A "$RUN" > "{out}/1.ls"
    """
    result = _unshare_tmpfs("200k", textwrap.dedent(script), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    err = (out / "1.err").read_text()
    assert (out / "1.rc").read_text().strip() == "2" and "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error")]
    m = LINE.match(errors[-1]) if len(errors) == 1 else None
    assert m and m["path"] == str(tmp_path / "run" / "model.pending.pte"), errors
    assert 0.2 <= float(m["needed"]) <= 0.4 and float(m["free"]) < float(m["needed"]), errors
    assert (out / "1.ls").read_text().split() == [".qharness.lock"]  # no .pte, no temporary file


FSIZE_SCRIPT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, resource.RLIM_INFINITY))  # ulimit -f 100
from pathlib import Path
from qharness.errors import UserError
from qharness.io.atomic import write_bytes_atomic
from qharness.deploy.memory import check_deploy_memory
from qharness.sources.embedded import embedded_config
try:
    check_deploy_memory(embedded_config(), 64)
except UserError as e:
    print("before:", e)
try:
    write_bytes_atomic(Path(sys.argv[1]) / "model.pte", b"\\0" * 300_000)
except UserError as e:
    print("write:", e)
"""


def test_a_file_size_limit_is_said_before_work_and_named_at_the_write(tmp_path):
    """Under ``ulimit -f 100``: the run refuses before any work, and a write past the limit says it is the limit,
    not the free space (the disk has plenty)."""
    r = subprocess.run(
        [sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    before, write = r.stdout.splitlines()
    assert before.startswith("before: the file-size limit (ulimit -f) is 0.1 MB, less than the .pte needs"), before
    assert "fix: raise the limit (ulimit -f unlimited" in before
    assert write.startswith(f"write: the file-size limit (ulimit -f, 0.1 MB) stopped writing {tmp_path}/model.pte")
    assert "no space left" not in write and "free" not in write
    assert not list(tmp_path.iterdir())  # the partial temporary is gone


@pytest.mark.fast
def test_the_file_size_check_passes_without_a_limit(monkeypatch):
    from qharness.errors import UserError
    from qharness.io import disk

    monkeypatch.setattr(disk, "file_size_limit", lambda: None)
    disk.check_file_size_limit(10**12, "the .pte")
    monkeypatch.setattr(disk, "file_size_limit", lambda: 10**6)
    disk.check_file_size_limit(10**6, "the .pte")
    with pytest.raises(UserError, match=r"ulimit -f\) is 1.0 MB, less than the .pte needs \(at least 2.0 MB\)"):
        disk.check_file_size_limit(2 * 10**6, "the .pte")
