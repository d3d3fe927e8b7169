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


def test_a_directory_holding_kept_files_is_refused_and_left_as_it_was(tmp_path):
    """Files a run kept (keep_files=True: no lock file) are refused by the next run's prepare, which
    takes nothing with it: no lock held, no lock file, the files as they were."""
    (tmp_path / "weights.bin").write_bytes(b"w" * 8192)
    directory = OffloadDirectory(OffloadConfig(path=str(tmp_path)), str(tmp_path))
    with pytest.raises(ValueError, match=r"offload_dir=.*kept there \(offload.keep_files=True\): weights.bin "
                                         r"\(8.0 KiB\).*Fix: give this run another offload directory"):
        directory.prepare(tmp_path.parent, {"weights": 8192})
    assert [(p.name, p.read_bytes()) for p in tmp_path.iterdir()] == [("weights.bin", b"w" * 8192)]
    lock = OffloadDirLock(tmp_path)
    lock.acquire()  # (nobody holds it)
    lock.release()


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
