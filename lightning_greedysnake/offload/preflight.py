"""Checks on the offload directory before any work starts, and the lock that keeps it to one run.

Each failure is a ``ValueError`` naming the setting (``offload_dir``), the value and the fix.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_greedysnake.io import ALIGN_BYTES, AlignedBuffer
from lightning_greedysnake.offload.regions import FILE_NAMES

LOCK_NAME = ".greedysnake.lock"

FreeSpaceProbe = Callable[[Path], int]


def disk_free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def human_bytes(nbytes: int, decimals: int = 1) -> str:
    """``nbytes`` in the largest binary unit under 1024 of it; ``decimals`` where a sum of rounded terms must
    still add up (the peak: 1.23 GiB, not 1.2 GiB, when its terms are 1.20 GiB and 31.2 MiB)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.{decimals}f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    raise AssertionError


@dataclass
class PreflightReport:
    offload_dir: Path
    o_direct: bool
    free_bytes: int
    required_bytes: int
    breakdown: dict[str, int] = field(default_factory=dict)

    def text(self, notes: Mapping[str, str] | None = None) -> str:
        """The directory, what each kind keeps there, and ``notes``: the kinds placed here that keep no
        bytes, each with why (in the placement table's words)."""
        lines = [f"greedysnake offload_dir={self.offload_dir} (O_DIRECT: {'yes' if self.o_direct else 'no'})"]
        for name, nbytes in self.breakdown.items():
            lines.append(f"  {name:<28} {human_bytes(nbytes):>12}")
        for name, note in (notes or {}).items():
            if name not in self.breakdown:
                lines.append(f"  {name:<28} {note}")
        lines.append(f"  {'total needed':<28} {human_bytes(self.required_bytes):>12}")
        lines.append(f"  {'free':<28} {human_bytes(self.free_bytes):>12}")
        return "\n".join(lines)


@dataclass(frozen=True)
class LockRecord:
    """What the lock file says about the run that holds the directory, or held it last: the lock file is
    greedysnake's marker in an offload directory, and the only thing that makes files there its own.

    A run writes it when it takes the lock (its pid, whether it keeps its files, its owner), names its
    files once they are open (:meth:`OffloadDirLock.record`), and removes it at its end, unless it keeps
    its files (``offload.keep_files=True``): then the record stays beside them, as after a kill."""

    pid: str
    keep_files: bool = False
    owner: str = ""
    """The strategy the run belongs to (:data:`new_owner`): fit, validate and test of one Trainer share it."""
    files: tuple[str, ...] | None = None
    """The offload files the run wrote there (None: not recorded, a run killed before opening them)."""

    def text(self) -> str:
        lines = [self.pid, KEEP_MARK.strip() if self.keep_files else "", f"owner {self.owner}"]
        if self.files is not None:
            lines.append(" ".join(["files", *self.files]))
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, raw: bytes) -> LockRecord | None:
        """The record in a lock file's bytes (None: empty, a lock file just created)."""
        lines = raw.decode(errors="replace").split("\n")
        if not raw.strip():
            return None
        fields = {line.partition(" ")[0]: line.partition(" ")[2] for line in lines[2:]}
        files = tuple(fields["files"].split()) if "files" in fields else None
        return cls(lines[0].strip() or "unknown", len(lines) > 1 and lines[1].strip() == KEEP_MARK.strip(),
                   fields.get("owner", "").strip(), files)

    def owns(self, name: str) -> bool:
        """Whether the file ``name`` is one this record's run wrote (unrecorded: any offload file name)."""
        return name in (self.files if self.files is not None else LEFTOVER_FILES)


def new_owner() -> str:
    """A fresh owner for :class:`LockRecord`: one per strategy, so that files one Trainer kept are its own
    in its later runs (fit, then validate) and another's to every other run."""
    return uuid.uuid4().hex


RECORD_BYTES = 4096
"""The most of a lock file read back: a record is a few short lines."""


class OffloadDirLock:
    """An exclusive ``flock`` on ``offload_dir/.greedysnake.lock``, held for the whole run; the file holds
    the run's :class:`LockRecord`.

    flock locks belong to the open file description, so a second run (or a second strategy in the same
    process) is refused; the kernel drops the lock when the process dies, so a crash leaves no stale lock.
    """

    def __init__(self, directory: Path, keep_files: bool = False, owner: str | None = None) -> None:
        """``keep_files``: the run keeps its files (``offload.keep_files``); the lock file says so, so that
        what a killed run leaves is kept too (:func:`clear_leftovers` reads it), and stays after a normal
        end as the record of the files kept. ``owner``: see :attr:`LockRecord.owner` (None: a new one)."""
        self.path = directory / LOCK_NAME
        self.keep_files = keep_files
        self.owner = owner if owner is not None else new_owner()
        self._files: tuple[str, ...] = ()
        """The offload files the record names: this run's, and those its owner kept there before."""
        self._fd: int | None = None

    def acquire(self, accept: Callable[[LockRecord | None], None] | None = None) -> None:
        """Take the lock and write this run's record. ``accept(previous)`` sees the record found there first
        (under the lock) and may refuse the directory by raising: then the lock file is left as it was
        (removed when this call created it) and the lock released."""
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
        previous = LockRecord.parse(os.pread(fd, RECORD_BYTES, 0))
        if accept is not None:
            try:
                accept(previous)
            except BaseException:
                if previous is None:  # (this call created it)
                    self.path.unlink(missing_ok=True)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                raise
        # files this owner kept there before (fit, then validate on one Trainer) stay its own
        self._files = (previous.files or ()) if previous is not None and previous.owner == self.owner else ()
        self._fd = fd
        self._write(None)

    def record(self, files: Sequence[Path]) -> None:
        """Name the offload files this run opened in the directory in its record."""
        self._write(tuple(dict.fromkeys([*self._files, *(f.name for f in files)])))

    def _write(self, files: tuple[str, ...] | None) -> None:
        assert self._fd is not None, "the lock is not held"
        if files is not None:
            self._files = files
        text = LockRecord(str(os.getpid()), self.keep_files, self.owner, files).text()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text.encode(), 0)

    def release(self, files: Sequence[Path] = ()) -> None:
        """Give the lock up. The record goes with it, unless the run keeps its files (``files``, with those
        :meth:`record` named): then it stays, naming those still there, so that the next run knows them for
        kept files, and whose."""
        if self._fd is not None:
            fd = self._fd
            if self.keep_files:
                names = dict.fromkeys([*self._files, *(f.name for f in files)])
                self._write(tuple(n for n in names if (self.path.parent / n).exists()))
            else:
                self.path.unlink(missing_ok=True)
            self._fd = None
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
        raise ValueError(
            f"offload_dir={raw!r} has {human_bytes(free)} free but this model and placement need "
            f"{human_bytes(required)} there:\n{report.text()}\nFix: {_ways(fixes)}."
        )
    return report


def _ways(fixes: Sequence[str]) -> str:
    ways = ["free space", "point offload_dir at a larger disk", "keep more state in host memory", *fixes]
    return f"{', '.join(ways[:-1])}, or {ways[-1]}"


def check_room(offload_dir: Path, more_bytes: int, what: str, fixes: Sequence[str] = (),
               free_space_probe: FreeSpaceProbe = disk_free_bytes) -> None:
    """:func:`preflight`'s space check for bytes whose size is known only once the run is under way (saved
    activations on SSD, sized at their first save): ``offload_dir`` must have ``more_bytes`` free for
    ``what`` (said in the refusal, with ``fixes`` beside the general ones). Called before any of them is
    written, so a disk too small is a ``ValueError`` naming the directory, the bytes and the fix, not an
    ``ENOSPC`` in the middle of a window."""
    free = int(free_space_probe(offload_dir))
    if free < more_bytes:
        raise ValueError(
            f"offload_dir={str(offload_dir)!r} has {human_bytes(free)} free but {what} need "
            f"{human_bytes(more_bytes)} more there. Fix: {_ways(fixes)}."
        )


KEEP_MARK = "keep_files\n"
"""The lock record's second line where the run keeps its files (``offload.keep_files=True``)."""

LEFTOVER_FILES = tuple(FILE_NAMES.values())
"""The names of the files a run keeps in its offload directory."""


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


def refuse_kept_files(directory: Path, setting: str | None, previous: LockRecord | None, owner: str) -> None:
    """Refuse a run in ``directory`` (its lock held by this run, so no live run's files are there, and
    :func:`clear_leftovers` has removed a killed run's) that holds files under the names of greedysnake's
    offload files which are not this run's to overwrite: another run kept them there on purpose
    (``offload.keep_files=True``: ``previous``, the lock record found there, says so and names them), or
    no greedysnake run recorded them at all (someone else's files). This run would overwrite them and,
    at its end, remove them. Files that ``previous`` records as kept by ``owner`` (the same Trainer's
    earlier fit, validate or test) are this run's own. ``setting``: the configured ``offload.path`` the
    directory came from (None: the default)."""
    present = [directory / name for name in LEFTOVER_FILES if (directory / name).exists()]
    if not present:
        return
    kept = [f for f in present if previous is not None and previous.keep_files and previous.owns(f.name)]
    foreign = [f for f in present if f not in kept]
    given = (f"offload_dir={setting!r}" if setting is not None
             else "the default offload directory (under the Trainer's default_root_dir)")

    def named(files: list[Path]) -> str:
        return ", ".join(f"{f.name} ({human_bytes(f.stat().st_size)})" for f in files)

    if foreign:
        it = "it" if len(foreign) == 1 else "them"
        raise ValueError(
            f"{given}: {directory} holds {named(foreign)}, under the names of greedysnake's offload files, "
            f"but no greedysnake run recorded {it} as its own (its lock file, {LOCK_NAME}, names the files a "
            f"run keeps). This run would overwrite {it} with its own offload files and remove {it} at its end. "
            "Fix: move those files out of that directory, or give this run another offload directory "
            "(offload_dir / offload.path)."
        )
    assert previous is not None
    if previous.owner == owner:
        return  # this Trainer's own, kept by its earlier fit, validate or test
    raise ValueError(
        f"{given}: {directory} holds offload files that another greedysnake run (pid {previous.pid}) kept "
        f"there (offload.keep_files=True): {named(kept)}. This run would overwrite them. Fix: give this run "
        "another offload directory (offload_dir / offload.path), or delete those files (and the "
        f"{LOCK_NAME} beside them) if you no longer need them."
    )


def clear_leftovers(directories: list[Path]) -> list[Leftover]:
    """In each of ``directories`` that holds a greedysnake lock file nobody holds and offload files its
    record names (or, unnamed, offload file names), remove those files and the lock (and the directory
    itself when that leaves it empty): a killed run's state is useless without its process (what it
    checkpointed is in its checkpoints). A directory whose run is alive, or that a run left on purpose
    (``keep_files``: the lock record's :data:`KEEP_MARK`, after a kill or a normal end), is not touched:
    the next run there refuses to start instead."""
    found = []
    for directory in directories:
        lock = directory / LOCK_NAME
        if not lock.is_file() or not any((directory / name).is_file() for name in LEFTOVER_FILES):
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
            record = LockRecord.parse(os.pread(fd, RECORD_BYTES, 0)) or LockRecord("unknown")
            if record.keep_files:
                continue  # it asked to keep its files
            files = [directory / name for name in LEFTOVER_FILES
                     if record.owns(name) and (directory / name).is_file()]
            nbytes = sum(f.stat().st_blocks * 512 for f in files)
            for f in files:
                f.unlink(missing_ok=True)
            lock.unlink(missing_ok=True)
            found.append(Leftover(directory, record.pid, nbytes))
        finally:
            os.close(fd)
        try:
            directory.rmdir()  # only when empty
        except OSError:
            pass
    return found
