"""Checks on the offload directory before any work starts, and the lock that keeps it to one run.

Each failure is a ``ValueError`` naming the setting (``offload_dir``), the value and the fix.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_greedysnake.io import ALIGN_BYTES, AlignedBuffer
from lightning_greedysnake.offload.regions import FILE_NAMES

LOCK_NAME = ".greedysnake.lock"

FreeSpaceProbe = Callable[[Path], int]


def disk_free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def human_bytes(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError


@dataclass
class PreflightReport:
    offload_dir: Path
    o_direct: bool
    free_bytes: int
    required_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)

    def text(self) -> str:
        lines = [f"greedysnake offload_dir={self.offload_dir} (O_DIRECT: {'yes' if self.o_direct else 'no'})"]
        for name, nbytes in self.breakdown.items():
            lines.append(f"  {name:<28} {human_bytes(nbytes):>12}")
        lines.append(f"  {'total needed':<28} {human_bytes(self.required_bytes):>12}")
        lines.append(f"  {'free':<28} {human_bytes(self.free_bytes):>12}")
        return "\n".join(lines)


class OffloadDirLock:
    """An exclusive ``flock`` on ``offload_dir/.greedysnake.lock``, held for the whole run.

    flock locks belong to the open file description, so a second run (or a second strategy in the same
    process) is refused; the kernel drops the lock when the process dies, so a crash leaves no stale lock.
    """

    def __init__(self, directory: Path, keep_files: bool = False) -> None:
        """``keep_files``: the run keeps its files (``offload.keep_files``); the lock file says so, so that
        what a killed run leaves is kept too (:func:`clear_leftovers` reads it)."""
        self.path = directory / LOCK_NAME
        self.keep_files = keep_files
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").partition("\n")[0].strip() or "unknown"
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(
                    f"offload_dir={str(self.path.parent)!r} is in use by another greedysnake run (pid {holder}). "
                    "Two runs sharing one offload directory would overwrite each other's state. Fix: give "
                    "this run its own offload_dir, or wait for the other run to finish."
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{KEEP_MARK if self.keep_files else ''}".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def probe_o_direct(directory: Path) -> bool:
    """Whether an aligned O_DIRECT write and read work in ``directory`` (False: the caller falls back)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    fd_probe, name = tempfile.mkstemp(prefix=".greedysnake-probe-", dir=directory)
    os.close(fd_probe)
    try:
        fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        try:
            with AlignedBuffer(ALIGN_BYTES) as buf:
                os.pwritev(fd, [buf.memoryview()], 0)
                os.preadv(fd, [buf.memoryview()], 0)
            return True
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    finally:
        os.unlink(name)


def preflight(
    offload_dir: str | os.PathLike[str],
    breakdown: Mapping[str, int],
    free_space_probe: FreeSpaceProbe = disk_free_bytes,
    fixes: Sequence[str] = (),
) -> PreflightReport:
    """Check ``offload_dir`` for a run that will keep ``sum(breakdown.values())`` bytes there; ``fixes``:
    what else would shrink those bytes for this run, said beside the general fixes when they do not fit.

    Creates the directory itself (owner-only) when its parent exists; a missing parent is refused, since
    it usually means a mistyped mount point and creating it would silently fill the root filesystem.
    Does not take the lock: see :class:`OffloadDirLock`.
    """
    raw = str(offload_dir)
    if not raw:
        raise ValueError("offload_dir='' is empty. Fix: set offload_dir to a directory on a local SSD.")
    path = Path(raw).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"offload_dir={raw!r} is a file, not a directory. Fix: point offload_dir at a directory "
            "(it is created if its parent exists)."
        )
    if not path.exists():
        if not path.parent.is_dir():
            raise ValueError(
                f"offload_dir={raw!r}: its parent {str(path.parent)!r} does not exist (a mistyped mount "
                "point?). Fix: create the parent directory first or correct the path."
            )
        try:
            path.mkdir(mode=0o700)
        except OSError as e:
            raise ValueError(
                f"offload_dir={raw!r} cannot be created: {e.strerror}. Fix: create it yourself or choose a "
                "directory you can write to."
            ) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".greedysnake-write-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(
            f"offload_dir={raw!r} is not writable: {e.strerror}. Fix: make it writable (check permissions, "
            "read-only mounts and immutable attributes) or choose another directory."
        ) from None
    o_direct = probe_o_direct(path)
    required = int(sum(breakdown.values()))
    free = int(free_space_probe(path))
    report = PreflightReport(path, o_direct, free, required, dict(breakdown))
    if free < required:
        ways = ["free space", "point offload_dir at a larger disk", "keep more state in host memory", *fixes]
        raise ValueError(
            f"offload_dir={raw!r} has {human_bytes(free)} free but this model and placement need "
            f"{human_bytes(required)} there:\n{report.text()}\nFix: {', '.join(ways[:-1])}, or {ways[-1]}."
        )
    return report


KEEP_MARK = "keep_files\n"
"""The lock file's second line where the run keeps its files (``offload.keep_files=True``)."""

LEFTOVER_FILES = tuple(FILE_NAMES.values())
"""The files a run keeps in its offload directory."""


@dataclass
class Leftover:
    """Offload files of a run that ended without cleaning up (killed): its lock file is still there,
    held by nobody."""

    directory: Path
    pid: str
    nbytes: int

    def text(self) -> str:
        return (f"removed {human_bytes(self.nbytes)} of offload files left in {self.directory} by a greedysnake run "
                f"that did not clean up (pid {self.pid}, no longer running; killed?)")


def refuse_kept_files(directory: Path, setting: str | None) -> None:
    """Refuse a run in ``directory`` (its lock held by this run, so no live run's files are there, and
    :func:`clear_leftovers` has removed a killed run's) that still holds offload files: another run left
    them there on purpose (``offload.keep_files=True``), and this run would overwrite them and, at its end,
    remove them. ``setting``: the configured ``offload.path`` it came from (None: the default)."""
    files = [directory / name for name in LEFTOVER_FILES if (directory / name).exists()]
    if not files:
        return
    named = ", ".join(f"{f.name} ({human_bytes(f.stat().st_size)})" for f in files)
    given = (f"offload_dir={setting!r}" if setting is not None
             else "the default offload directory (under the Trainer's default_root_dir)")
    raise ValueError(
        f"{given}: {directory} holds offload files that another greedysnake run kept there "
        f"(offload.keep_files=True): {named}. This run would overwrite them. Fix: give this run another "
        f"offload directory (offload_dir / offload.path), or delete those files if you no longer need them."
    )


def clear_leftovers(directories: list[Path]) -> list[Leftover]:
    """In each of ``directories`` that holds a greedysnake lock file nobody holds and offload files, remove
    those files and the lock (and the directory itself when that leaves it empty): a killed run's state
    is useless without its process (what it checkpointed is in its checkpoints). A directory whose run
    is alive, or that a run left on purpose (``keep_files``: no lock file after a normal end, the lock
    file's :data:`KEEP_MARK` after a kill), is not touched: the next run there refuses to start instead."""
    found = []
    for directory in directories:
        lock = directory / LOCK_NAME
        files = [directory / name for name in LEFTOVER_FILES if (directory / name).is_file()]
        if not lock.is_file() or not files:
            continue
        try:
            fd = os.open(lock, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live run holds it
            pid, _, rest = os.pread(fd, 64, 0).decode(errors="replace").partition("\n")
            if rest.startswith(KEEP_MARK):
                continue  # killed, but it asked to keep its files
            pid = pid.strip() or "unknown"
            nbytes = sum(f.stat().st_blocks * 512 for f in files)
            for f in files:
                f.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
            found.append(Leftover(directory, pid, nbytes))
        finally:
            os.close(fd)
        try:
            directory.rmdir()  # only when empty
        except OSError:
            pass
    return found
