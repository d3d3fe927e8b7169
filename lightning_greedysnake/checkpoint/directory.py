"""A checkpoint directory's names, and its housekeeping: which directories are this format's (complete or
not), the lock a save holds on the payload it writes, and the removal of what killed saves left.

A process killed during the *first* save of a name leaves a directory with a payload and no ``CURRENT``
(:func:`is_incomplete_checkpoint_dir`); one killed during a later save, a payload ``CURRENT`` does not name.
:func:`remove_partial` (every published save runs it on the directory it saved to) removes both, and never
a payload being written: its writer holds an exclusive ``flock`` on the payload directory until the save is
published or dropped (the kernel releases it when the writer dies), and a payload whose lock is held is left
alone. Where the filesystem has no ``flock`` on directories, nothing beside the saved checkpoint is removed.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path

CURRENT = "CURRENT"
CURRENT_TMP = f"{CURRENT}.tmp"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
_PAYLOAD_NAME = re.compile(r"v-[0-9a-f]{12}")
_PAYLOAD_ENTRIES = frozenset({MANIFEST, TRAINER_STATE, "model", "optimizer"})
"""What a payload directory holds (``model/`` and ``optimizer/`` hold the safetensors files)."""


def _payloads(path: Path) -> list[Path] | None:
    """The payload directories of ``path`` where it is recognisably a directory of this format: nothing in it
    but ``CURRENT``, ``CURRENT.tmp`` and payloads (``v-`` and 12 hex digits, holding nothing but a payload's
    entries), at least one payload. None otherwise (a symlink, a file, anything else in it)."""
    try:
        if path.is_symlink() or not path.is_dir():
            return None
        payloads = []
        for child in path.iterdir():
            if child.name in (CURRENT, CURRENT_TMP) and child.is_file() and not child.is_symlink():
                continue
            if (_PAYLOAD_NAME.fullmatch(child.name) is None or child.is_symlink() or not child.is_dir()
                    or any(entry.name not in _PAYLOAD_ENTRIES for entry in child.iterdir())):
                return None
            payloads.append(child)
    except OSError:  # gone meanwhile, or unreadable: not ours to judge
        return None
    return payloads or None


def is_incomplete_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    """``path`` is a checkpoint directory whose first save never finished: payloads of this format and no
    ``CURRENT`` (the process was killed during the save, or the save is still being written)."""
    p = Path(path)
    return not (p / CURRENT).exists() and _payloads(p) is not None


def _current_payload(path: Path) -> str | None:
    """The payload ``CURRENT`` of ``path`` names; None where it cannot be read, or is damaged: empty, not
    a payload's name (zero-filled, truncated), or the name of no payload there. Which payload a damaged one
    meant cannot be told, so :func:`_names` judges none stale."""
    try:
        lines = (path / CURRENT).read_text().split()
        if not lines or _PAYLOAD_NAME.fullmatch(lines[0]) is None or not (path / lines[0]).is_dir():
            return None
    except (OSError, UnicodeDecodeError):
        return None
    return lines[0]


def try_lock(payload: Path) -> tuple[int | None, bool]:
    """(fd holding an exclusive flock on ``payload``, busy): (fd, False) where locked, (None, True) where
    another open file holds it (a save writing it), (None, False) where the filesystem has no flock on
    directories or the payload is gone."""
    try:
        fd = os.open(payload, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None, False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, True
    except OSError:
        os.close(fd)
        return None, False
    return fd, False


def _names(path: Path, payload: Path) -> bool:
    """``CURRENT`` of ``path`` names ``payload``, or exists and cannot be read or is damaged (kept then: not
    ours to judge)."""
    current = _current_payload(path)
    return current == payload.name or (current is None and (path / CURRENT).exists())


def _remove_unpublished(path: Path, payloads: list[Path]) -> list[Path]:
    """Remove the ``payloads`` of ``path`` that no save is writing and ``CURRENT`` does not name (each under
    its lock, ``CURRENT`` read again once locked: a save publishes while it holds the lock), then, where
    none was left, ``CURRENT.tmp`` and, without ``CURRENT``, the emptied directory. Returns what it
    removed."""
    removed: list[Path] = []
    left = False
    for payload in payloads:
        fd, _ = try_lock(payload)
        if fd is None:  # being written, or no flock on this filesystem: left alone
            left = left or payload.exists()
            continue
        try:
            if _names(path, payload):
                left = True
                continue
            shutil.rmtree(payload, ignore_errors=True)
            removed.append(payload)
        finally:
            os.close(fd)
    if not left:
        tmp = path / CURRENT_TMP
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
        if not (path / CURRENT).exists():
            try:
                os.rmdir(path)  # fails where anything appeared meanwhile (a new save): left alone then
                removed.append(path)
            except OSError:
                pass
    return removed


def remove_partial(directory: str | os.PathLike[str], keep: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove what killed saves left in ``directory``: checkpoint directories of this format without
    ``CURRENT`` (:func:`is_incomplete_checkpoint_dir`), and the payloads ``CURRENT`` does not name in
    complete ones. Never a directory that holds anything else, never a payload ``CURRENT`` names (nor any
    where ``CURRENT`` cannot be read or names no payload there), never a payload a save is writing (its
    lock is held; where the filesystem cannot lock, nothing is removed), never ``keep``. Returns what it
    removed; errors leave things as they are."""
    removed: list[Path] = []
    keep_path = Path(keep).absolute() if keep is not None else None
    try:
        entries = sorted(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        if keep_path is not None and entry.absolute() == keep_path:
            continue
        payloads = _payloads(entry)
        if payloads is None:
            continue
        stale = [p for p in payloads if not _names(entry, p)]
        if stale or not (entry / CURRENT).exists():
            removed += _remove_unpublished(entry, stale)
    return removed
