"""The on-disk checkpoint: a directory that is complete or absent, never half-written.

Layout of ``NAME.ckpt/`` (what ``ModelCheckpoint`` and ``trainer.save_checkpoint`` name):

    CURRENT                  the name of the complete payload below, and the SHA-256 of its manifest
    v-<id>/manifest.json     format, version, every file's size and SHA-256, the parameters' index
    v-<id>/trainer_state.pt  Lightning's checkpoint dict without tensors of the model or optimizer
                             (loops, epoch, step, LR schedulers, callbacks, param groups): torch.save,
                             read back with ``weights_only=True``
    v-<id>/model/*.safetensors      fp32 (or the training dtype's) weights, one file per unit
    v-<id>/optimizer/*.safetensors  optimizer state per parameter, one file per unit

A save writes a fresh payload directory, fsyncs it, then replaces ``CURRENT`` with ``os.replace`` (atomic
on POSIX) and only then removes the previous payload: a process killed at any point leaves ``CURRENT``
naming a complete payload (the previous one until the switch). This is LevelDB's CURRENT-file pattern;
it keeps the checkpoint one ordinary directory that ``cp -r``, ``mv`` and ``rsync`` handle.

A process killed during the *first* save of a name leaves a directory with a payload and no ``CURRENT``
(:func:`~lightning_greedysnake.checkpoint.directory.is_incomplete_checkpoint_dir`). Every published save
removes such directories beside it, and unpublished payloads in complete ones (``directory.remove_partial``);
a writer holds a lock on its payload until it is published or dropped, so none being written is removed.

Loading checks every file's size up front (missing or truncated files fail before any state changes)
and each file's SHA-256 as it is read; nothing is unpickled but plain containers and tensors.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.checkpoint.directory import (  # the names: re-exported, as they were defined here
    CURRENT,
    CURRENT_TMP,
    MANIFEST,
    TRAINER_STATE,  # noqa: F401
    remove_partial,
    try_lock,
)
from lightning_greedysnake.checkpoint.safetensors_stream import NAMES as ST_NAMES
from lightning_greedysnake.checkpoint.safetensors_stream import header as st_header
from lightning_greedysnake.io.aligned import AlignedBuffer

FORMAT = "lightning-greedysnake-checkpoint"
VERSION = 1
MANIFEST_SHA256 = "manifest-sha256"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded as it is (missing, incomplete, truncated or corrupted)."""


def save_error(checkpoint: Path, target: Path, error: OSError) -> OSError:
    """An OSError of a save, naming the checkpoint, the file and the fix (the errno is kept)."""
    if getattr(error, "greedysnake_save", False):
        return error
    reason = os.strerror(error.errno) if error.errno else str(error)
    fix = ("Fix: free space on that filesystem or save checkpoints to another one (ModelCheckpoint(dirpath=...))"
           if error.errno in (errno.ENOSPC, errno.EDQUOT) else
           "Fix: check that the checkpoint directory is writable and its disk healthy")
    out = OSError(error.errno, f"saving checkpoint {checkpoint} failed writing {target}: {reason}. {fix}; the "
                               "previous checkpoint of that name, if any, is untouched.")
    out.greedysnake_save = True  # type: ignore[attr-defined]
    return out


def is_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
    """``path`` is a directory in this format (complete or not)."""
    p = Path(path)
    return p.is_dir() and ((p / CURRENT).exists() or any(c.name.startswith("v-") for c in p.iterdir()))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _safetensors_image(tensors: dict[str, Tensor], metadata: dict[str, str] | None) -> tuple[AlignedBuffer, int]:
    """A safetensors file (header, then the tensors back to back) built in one page-aligned buffer."""
    flat = [t.detach().contiguous() for t in tensors.values()]
    head, offsets = st_header([(n, t.dtype, tuple(t.shape)) for n, t in zip(tensors, flat)], metadata)
    start = len(head)
    total = start + sum(t.numel() * t.element_size() for t in flat)
    image = AlignedBuffer(total)
    image.memoryview(0, start)[:] = head
    for off, t in zip(offsets, flat):
        if t.numel():
            image.view(torch.uint8, t.numel() * t.element_size(), start + off).copy_(t.reshape(-1).view(torch.uint8))
    return image, total


def _open_direct(path: Path, flags: int, mode: int = 0o600) -> tuple[int, bool]:
    """``path`` opened with ``flags`` and O_DIRECT, or with ``flags`` alone where O_DIRECT is refused
    (EINVAL); returns the descriptor and whether the first open (O_DIRECT where the platform has it) did."""
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), mode), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return os.open(path, flags, mode), False


def _write_image(path: Path, image: AlignedBuffer, nbytes: int) -> tuple[str, int]:
    """Hash and write ``nbytes`` of ``image`` to ``path`` (O_DIRECT in page-sized pieces, the tail cut
    with ftruncate; buffered where O_DIRECT is refused), fsync; returns (sha256, nbytes)."""
    try:
        view = image.memoryview(0, image.nbytes)
        digest = hashlib.sha256(view[:nbytes]).hexdigest()
        fd, direct = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0))
        length = image.nbytes if direct else nbytes  # direct: whole pages; the file is cut to nbytes after
        try:
            done = 0
            while done < length:
                done += os.pwrite(fd, view[done : min(length, done + _CHUNK)], done)
            if length != nbytes:
                os.ftruncate(fd, nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        del view
        return digest, nbytes
    finally:
        image.close()


def _read_image(path: Path, nbytes: int) -> AlignedBuffer:
    """The first ``nbytes`` of ``path`` in page-aligned memory (O_DIRECT, buffered where refused)."""
    image = AlignedBuffer(max(nbytes, 1))
    view = image.memoryview(0, image.nbytes)
    try:
        fd, _ = _open_direct(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            done = 0
            while done < nbytes:
                try:
                    got = os.preadv(fd, [view[done : min(image.nbytes, done + _CHUNK)]], done)
                except OSError as e:  # O_DIRECT at an unaligned offset after a short read: truncated
                    if e.errno != errno.EINVAL:
                        raise
                    break
                if got <= 0:
                    break
                done += got
        finally:
            os.close(fd)
    finally:
        del view
    if done < nbytes:
        image.close()
        raise CheckpointError(f"{path}: read {done} of {nbytes} bytes (truncated).")
    return image


_CHUNK = 64 << 20


class CheckpointWriter:
    """Writes one payload under ``path``; :meth:`publish` makes it the checkpoint, :meth:`abort` drops it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        # Lightning's save_last="link" leaves a symlink, an older run a plain file: replacing them is
        # what the caller asked for (a save to this name); the old object is gone only after the
        # new payload is complete
        self._replace_link = self.path.is_symlink() or self.path.is_file()
        if not self._replace_link and self.path.exists() and not is_checkpoint_dir(self.path):
            raise CheckpointError(
                f"cannot save a checkpoint to {self.path}: it is a directory that is not a greedysnake "
                "checkpoint. Fix: choose another file name or directory for the checkpoint."
            )
        self.root = self.path.parent / f".{self.path.name}.gs-tmp" if self._replace_link else self.path
        self._created_root = not self.root.exists()
        """This save created the checkpoint's directory: a failed save removes it again."""
        self._lock: int | None = None
        self._published = False
        try:
            self._create_payload()
        except OSError as e:
            self.abort()
            raise save_error(self.path, self.payload, e) from e
        self.files: dict[str, dict[str, Any]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[tuple[str, Future[Any]]] = []

    def _create_payload(self) -> None:
        """Create a fresh payload directory and hold its lock (see the module docstring). A sweep by another
        process's save may remove the new directory (or the checkpoint's, still empty) before the lock is
        taken: then again, under a new name."""
        for attempt in range(4):
            self.payload_name = f"v-{uuid.uuid4().hex[:12]}"
            self.payload = self.root / self.payload_name
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self.payload.mkdir()
            except FileNotFoundError:
                if attempt == 3:
                    raise
                continue
            fd, busy = try_lock(self.payload)
            if (busy or (fd is None and not self.payload.exists())) and attempt < 3:
                continue  # a sweep holds it or removed it before the lock: again
            if fd is not None:
                try:
                    same = os.stat(self.payload).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same and attempt < 3:
                    os.close(fd)
                    continue
            self._lock = fd  # None where the filesystem has no flock on directories
            return

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def write_bytes(self, rel: str, data: bytes | memoryview) -> None:
        target = self.payload / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise save_error(self.path, target, e) from e
        self.files[rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def link_from(self, payload: Path, rel: str, info: dict[str, Any]) -> bool:
        """Reuse ``rel`` of an earlier published payload (a hard link: published files are never
        modified, only unlinked); False where the filesystem cannot link or the file is gone."""
        target = self.payload / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(payload / rel, target)
        except OSError:
            return False
        self.files[rel] = dict(info)
        return True

    def write_tensors(self, rel: str, tensors: dict[str, Tensor], metadata: dict[str, str] | None = None) -> None:
        """Write a safetensors file. The file's image is built once, in page-aligned memory, on the
        calling thread; hashing and writing it (O_DIRECT where the filesystem allows) go to a background
        thread, so the caller prepares the next unit meanwhile. :meth:`publish` waits for them."""
        image, nbytes = _safetensors_image(tensors, metadata)
        target = self.payload / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="greedysnake-checkpoint")
        if len(self._pending) >= 2:  # at most two images in memory: the one written and the next
            self._collect(self._pending.pop(0))
        self._pending.append((rel, self._pool.submit(_write_image, target, image, nbytes)))

    def _collect(self, pending: tuple[str, Future[str]]) -> None:
        rel, future = pending
        try:
            digest, nbytes = future.result()
        except OSError as e:
            raise save_error(self.path, self.payload / rel, e) from e
        self.files[rel] = {"bytes": nbytes, "sha256": digest}

    def _drain(self) -> None:
        try:
            while self._pending:
                self._collect(self._pending.pop(0))
        finally:
            self._pending.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def write_object(self, rel: str, obj: Any) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        self.write_bytes(rel, buf.getbuffer())

    def publish(self, index: dict[str, Any]) -> None:
        """Write the manifest, then switch ``CURRENT`` to this payload and remove older payloads."""
        self._drain()
        manifest = {"format": FORMAT, "version": VERSION, "files": self.files, **index}
        manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode()
        self.write_bytes(MANIFEST, manifest_bytes)
        for sub in {Path(rel).parent for rel in self.files} - {Path(".")}:
            _fsync_dir(self.payload / sub)
        _fsync_dir(self.payload)
        tmp = self.root / CURRENT_TMP
        with open(tmp, "w") as f:
            # the manifest's own checksum: it protects every other file's
            f.write(f"{self.payload_name}\n{MANIFEST_SHA256} {hashlib.sha256(manifest_bytes).hexdigest()}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / CURRENT)  # the commit point
        self._published = True
        _fsync_dir(self.root)
        if self._replace_link:
            # a directory cannot be renamed over a file or link: this one switch is not atomic, but
            # what it replaces is a link to another checkpoint (still there) or a file of another format
            self.path.unlink()
            os.replace(self.root, self.path)
            _fsync_dir(self.path.parent)
            self.root = self.path
        for child in self.root.iterdir():  # the previous payload, and any a killed save left behind
            if child.name in (CURRENT, self.payload_name):
                continue
            if child.is_dir() and not child.is_symlink():
                fd, busy = try_lock(child)
                if busy:  # another process saving to this name right now: its own publish removes ours
                    continue
                try:
                    shutil.rmtree(child)
                finally:
                    if fd is not None:
                        os.close(fd)
            else:
                child.unlink()
        self._unlock()
        # and what killed saves left beside it: checkpoint directories never published (the first save of
        # their name was killed), payloads never published in others. Best effort: the save is complete
        try:
            remove_partial(self.path.parent, keep=self.path)
        except OSError:
            pass

    def abort(self) -> None:
        if getattr(self, "_published", False):  # failed after the commit point: the checkpoint stays
            self._unlock()
            return
        try:
            self._drain()
        except BaseException:  # noqa: BLE001 - the save already failed; its files go anyway
            pass
        shutil.rmtree(self.payload, ignore_errors=True)
        self._unlock()
        if self._replace_link or self._created_root:
            shutil.rmtree(self.root, ignore_errors=True)


class CheckpointReader:
    """A published checkpoint: the manifest read and every file's size checked on open."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint {self.path} does not exist. Fix: check the path given as ckpt_path.")
        current = self.path / CURRENT
        if not current.is_file():
            raise CheckpointError(
                f"{self.path} is not a complete greedysnake checkpoint: {CURRENT} is missing (a save that "
                "never finished, or not a checkpoint of this format). Fix: load the previous checkpoint."
            )
        damaged = "Fix: load the previous checkpoint (this one is damaged)."
        try:
            lines = current.read_text().split()
        except UnicodeDecodeError:
            raise CheckpointError(f"checkpoint {self.path}: {current} is corrupted. {damaged}") from None
        if not lines or not lines[0].startswith("v-") or "/" in lines[0]:
            raise CheckpointError(f"checkpoint {self.path}: {current} names no payload. {damaged}")
        self.payload = self.path / lines[0]
        manifest_path = self.payload / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"checkpoint {self.path}: {manifest_path} is missing. {damaged}")
        raw = manifest_path.read_bytes()
        expected = dict(zip(lines[1::2], lines[2::2], strict=False)).get(MANIFEST_SHA256)
        if expected is not None and hashlib.sha256(raw).hexdigest() != expected:
            raise CheckpointError(
                f"checkpoint {self.path}: {manifest_path} does not match its checksum in {current} "
                f"(corrupted or edited). {damaged}"
            )
        try:
            self.manifest = json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"checkpoint {self.path}: {manifest_path} is corrupted ({e}). {damaged}") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            found = self.manifest.get("format") if isinstance(self.manifest, dict) else type(self.manifest).__name__
            raise CheckpointError(
                f"checkpoint {self.path}: {manifest_path} has format {found!r}, not {FORMAT!r}: not a greedysnake "
                "checkpoint. Fix: pass a greedysnake checkpoint directory or a Lightning checkpoint file as ckpt_path."
            )
        version = self.manifest.get("version")
        if version != VERSION:
            newer = isinstance(version, int) and not isinstance(version, bool) and version > VERSION
            raise CheckpointError(
                f"checkpoint {self.path}: {manifest_path} has format version {version!r}; this lightning-greedysnake "
                f"reads version {VERSION}. " + (
                    "The checkpoint was written by a newer lightning-greedysnake. Fix: upgrade lightning-greedysnake "
                    "(pip install -U lightning-greedysnake) to load it." if newer else
                    f"No lightning-greedysnake writes version {version!r}. Fix: load a checkpoint a greedysnake run "
                    "saved (this manifest was edited or written by another tool).")
            )
        self.files: dict[str, dict[str, Any]] = self.manifest["files"]
        for rel, info in self.files.items():
            f = self.payload / rel
            if not f.is_file():
                raise CheckpointError(f"checkpoint {self.path}: file {f} is missing. {damaged}")
            size = f.stat().st_size
            if size != info["bytes"]:
                raise CheckpointError(
                    f"checkpoint {self.path}: file {f} has {size} bytes, the manifest says {info['bytes']} "
                    "(truncated or overwritten). Fix: load the previous checkpoint."
                )

    def read_bytes(self, rel: str) -> bytes:
        info = self.files.get(rel)
        if info is None:
            raise CheckpointError(f"checkpoint {self.path} has no file {rel!r}.")
        f = self.payload / rel
        data = f.read_bytes()
        if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise CheckpointError(
                f"checkpoint {self.path}: file {f} does not match its checksum in the manifest (corrupted). "
                "Fix: load the previous checkpoint."
            )
        return data

    def read_tensors(self, rel: str) -> dict[str, Tensor]:
        return self.read_tensors_and_metadata(rel)[0]

    def read_tensors_and_metadata(self, rel: str) -> tuple[dict[str, Tensor], dict[str, str]]:
        """A safetensors file's tensors and its ``__metadata__``: one read (O_DIRECT into page-aligned
        memory where the filesystem allows), checksummed; the tensors are views of that memory."""
        info = self.files.get(rel)
        if info is None:
            raise CheckpointError(f"checkpoint {self.path} has no file {rel!r}.")
        path = self.payload / rel
        nbytes = info["bytes"]
        image = _read_image(path, nbytes)
        view = image.memoryview(0, image.nbytes)
        if hashlib.sha256(view[:nbytes]).hexdigest() != info["sha256"]:
            del view
            image.close()
            raise CheckpointError(
                f"checkpoint {self.path}: file {path} does not match its checksum in the manifest (corrupted). "
                "Fix: load the previous checkpoint."
            )
        n = int.from_bytes(view[:8], "little")
        header = json.loads(bytes(view[8 : 8 + n]))
        del view
        meta = header.pop("__metadata__", None) or {}
        start = 8 + n
        tensors: dict[str, Tensor] = {}
        for name, entry in header.items():
            dtype = ST_NAMES[entry["dtype"]]
            a, b = entry["data_offsets"]
            raw = image.view(torch.uint8, b - a, start + a)
            # a view when aligned for its dtype; a copy otherwise (files written elsewhere)
            t = raw.view(dtype) if (start + a) % raw.new_empty((), dtype=dtype).element_size() == 0 else \
                raw.clone().view(dtype)
            tensors[name] = t.view(entry["shape"])
        return tensors, meta

    def read_object(self, rel: str) -> Any:
        try:
            return torch.load(io.BytesIO(self.read_bytes(rel)), weights_only=True, map_location="cpu")
        except pickle.UnpicklingError as e:  # torch's message names the global it refused
            found = re.search(r"GLOBAL (\S+)", str(e))
            what = found.group(1) if found else str(e).splitlines()[0]
            raise CheckpointError(
                f"checkpoint {self.path}: {rel} holds an object of type {what}, which greedysnake does not "
                "unpickle (checkpoints load with weights_only=True: containers, numbers, strings, tensors). "
                "Fix: keep hyperparameters and callback state to plain values, or, if you trust the file, "
                f"allow the type first with torch.serialization.add_safe_globals([{what.rsplit('.', 1)[-1]}])."
            ) from None

    def verify(self) -> None:
        """Read every file and check its checksum."""
        for rel in self.files:
            self.read_bytes(rel)

    def files_under(self, prefix: str) -> Iterator[str]:
        return (rel for rel in sorted(self.files) if rel.startswith(prefix))
