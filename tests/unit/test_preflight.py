"""Preflight of the offload directory on real filesystems: each bad input gets a clear error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.offload import OffloadDirLock, preflight
from lightning_greedysnake.offload.preflight import LockRecord
from lightning_greedysnake.strategy.offload_dir import OffloadDirectory
from tests.helpers import mounted

GiB = 1 << 30


def test_creates_the_directory_and_reports_the_breakdown(tmp_path):
    target = tmp_path / "offload"
    report = preflight(target, {"compute weights": 2 * GiB, "optimizer state": 12 * GiB},
                       free_space_probe=lambda p: 100 * GiB)
    assert target.is_dir() and (target.stat().st_mode & 0o777) == 0o700
    assert report.o_direct  # ext4
    assert report.required_bytes == 14 * GiB
    text = report.text()
    assert "optimizer state" in text and "14.0 GiB" in text
    assert os.listdir(target) == []  # probes clean up after themselves


def test_missing_parent(tmp_path):
    with pytest.raises(ValueError, match=r"offload_dir=.*parent .* does not exist.*Fix"):
        preflight(tmp_path / "no" / "such" / "dir", {})


def test_file_instead_of_directory(tmp_path):
    file = tmp_path / "afile"
    file.write_text("x")
    with pytest.raises(ValueError, match=r"offload_dir=.*afile.* is a file.*Fix"):
        preflight(file, {})


def test_read_only_directory(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    # root ignores permission bits, so make the directory immutable instead
    if subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        with pytest.raises(ValueError, match=r"offload_dir=.*ro.* is not writable.*Fix"):
            preflight(target, {})
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=False)


def test_too_little_space_with_an_injected_probe(tmp_path):
    with pytest.raises(ValueError, match=r"has 1\.0 GiB free but .* need 3\.0 GiB(.|\n)*master weights(.|\n)*Fix"):
        preflight(tmp_path, {"master weights": 3 * GiB}, free_space_probe=lambda p: 1 * GiB)
    with pytest.raises(ValueError, match=r"Fix: free space, point offload_dir at a larger disk, keep more state in "
                                         r"host memory, or set x=1\.$"):
        preflight(tmp_path, {"master weights": 3 * GiB}, free_space_probe=lambda p: 1 * GiB, fixes=("set x=1",))


def test_too_little_space_on_a_tiny_filesystem(tmp_path):
    with mounted(tmp_path / "tiny", size="20M") as mount:
        preflight(mount, {"weights": 10 << 20})  # fits
        with pytest.raises(ValueError, match="free but this model and placement need"):
            preflight(mount, {"weights": 64 << 20})


def _kept_by_a_run(directory, owner: str) -> dict[str, bytes]:
    """What a run with keep_files=True leaves in ``directory``: its offload file and its lock record naming
    it (written by the real OffloadDirectory); returns the directory's contents."""
    run = OffloadDirectory(OffloadConfig(path=str(directory), keep_files=True), str(directory), owner=owner)
    run.prepare(directory.parent, {"weights": 8192})
    (directory / "weights.bin").write_bytes(b"w" * 8192)
    run.record([directory / "weights.bin"])
    run.cleanup([directory / "weights.bin"])
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_files_another_run_kept_are_refused_and_left_as_they_were(tmp_path):
    """Files a run kept (keep_files=True: its lock record stays, naming them) are refused by another run's
    prepare, which takes nothing with it: no lock held, the record and the files as they were. The same
    owner (the same Trainer's next validate or test) finds them its own."""
    kept = _kept_by_a_run(tmp_path, owner="fit")
    assert kept.keys() == {"weights.bin", ".greedysnake.lock"}
    directory = OffloadDirectory(OffloadConfig(path=str(tmp_path)), str(tmp_path), owner="someone else")
    with pytest.raises(ValueError, match=rf"offload_dir=.*another greedysnake run \(pid {os.getpid()}\) kept there "
                                         r"\(offload.keep_files=True\): weights.bin \(8.0 KiB\).*Fix: give this run "
                                         r"another offload directory"):
        directory.prepare(tmp_path.parent, {"weights": 8192})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == kept
    same = OffloadDirectory(OffloadConfig(path=str(tmp_path), keep_files=True), str(tmp_path), owner="fit")
    same.prepare(tmp_path.parent, {"weights": 8192})  # its own files (and nobody holds the lock)
    same.cleanup([])
    assert LockRecord.parse((tmp_path / ".greedysnake.lock").read_bytes()).files == ("weights.bin",)  # still named


def test_a_users_file_named_like_an_offload_file_is_not_called_kept(tmp_path):
    """A file of the user's that happens to bear an offload file's name, with no greedysnake record of it,
    is refused as what it is (this run would overwrite and then delete it), never as files a greedysnake
    run kept; the directory is left as it was (no lock file)."""
    (tmp_path / "weights.bin").write_bytes(b"mine" * 2048)
    directory = OffloadDirectory(OffloadConfig(path=str(tmp_path)), str(tmp_path))
    with pytest.raises(ValueError, match=r"offload_dir=.* holds weights.bin \(8.0 KiB\), under the names of "
                                         r"greedysnake's offload files, but no greedysnake run recorded it as its "
                                         r"own.*overwrite it.*Fix: move those files out of that directory") as info:
        directory.prepare(tmp_path.parent, {"weights": 8192})
    assert "kept" not in str(info.value)
    assert [(p.name, p.read_bytes()) for p in tmp_path.iterdir()] == [("weights.bin", b"mine" * 2048)]


def test_lock_refuses_a_second_run_and_is_released(tmp_path):
    first = OffloadDirLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(ValueError, match=rf"in use by another greedysnake run \(pid {os.getpid()}\).*Fix"):
            OffloadDirLock(tmp_path).acquire()
        # and from another process
        code = textwrap.dedent(f"""
            from pathlib import Path
            from lightning_greedysnake.offload import OffloadDirLock
            try:
                OffloadDirLock(Path({str(tmp_path)!r})).acquire()
            except ValueError as e:
                print("refused:", e)
        """)
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert child.returncode == 0, child.stderr
        assert "refused" in child.stdout
    finally:
        first.release()
    second = OffloadDirLock(tmp_path)
    second.acquire()
    second.release()
    assert not (tmp_path / ".greedysnake.lock").exists()


def test_lock_dies_with_its_process(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from lightning_greedysnake.offload import OffloadDirLock
        OffloadDirLock(Path({str(tmp_path)!r})).acquire()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr  # it held the lock when it died
    lock = OffloadDirLock(tmp_path)
    lock.acquire()  # no stale lock after a crash
    lock.release()
