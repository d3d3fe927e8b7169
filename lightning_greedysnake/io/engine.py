"""The I/O engine: reads and writes between offload files and aligned host buffers.

Default backend: ``os.preadv``/``os.pwritev`` on files opened with ``O_DIRECT`` (so every read really
comes from the device, not the page cache), split into large chunks and run on a few threads (the
calls release the GIL). Filesystems that refuse ``O_DIRECT`` (EINVAL at open) get buffered I/O and one
warning. Every failure names the file, the offset and the operation; nothing is dropped silently.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lightning_greedysnake.io.aligned import ALIGN_BYTES, AlignedBuffer, align_up

MiB = 1 << 20


def when_all(futures: list[Future[None]], callback: Callable[[], None]) -> None:
    """Call ``callback`` once every one of ``futures`` completed: now if none is given, else on the thread
    that completes the last one (a countdown under its own lock)."""
    if not futures:
        callback()
        return
    remaining = [len(futures)]
    gate = threading.Lock()

    def one_done(_: Future[None]) -> None:
        with gate:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback()

    for f in futures:
        f.add_done_callback(one_done)


class OffloadIOError(OSError):
    """An offload read or write failed; the message names the file, offset and operation."""


class ShortReadError(OffloadIOError):
    """A read returned fewer bytes than the file should hold (truncated or replaced file)."""


@dataclass(frozen=True)
class IOConfig:
    num_threads: int = 4
    """Threads issuing preadv/pwritev calls."""
    chunk_bytes: int = 16 * MiB
    """Largest single request; large requests keep the device queue busy with few Python wake-ups."""
    direct: bool = True
    """Open files with O_DIRECT (falls back to buffered I/O, with a warning, where refused)."""

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError(f"io num_threads={self.num_threads} must be >= 1. Fix: e.g. num_threads=4.")
        if self.chunk_bytes < ALIGN_BYTES or self.chunk_bytes % ALIGN_BYTES:
            raise ValueError(
                f"io chunk_bytes={self.chunk_bytes} must be a positive multiple of {ALIGN_BYTES}. "
                "Fix: e.g. chunk_bytes=16777216 (16 MiB)."
            )


class OffloadFile:
    """A preallocated file of ``size_bytes`` (a multiple of the alignment), open for reading and writing."""

    def __init__(self, path: Path, fd: int, size_bytes: int, direct: bool) -> None:
        self.path = path
        self.fd: int | None = fd
        self.size_bytes = size_bytes
        self.direct = direct

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __repr__(self) -> str:
        return f"OffloadFile({str(self.path)!r}, {self.size_bytes} bytes, direct={self.direct})"


class IOEngine(Protocol):
    """What the tensor manager needs from an I/O backend."""

    def open(self, path: Path, size_bytes: int, preallocate: bool = True) -> OffloadFile: ...

    def submit_read(self, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int,
                    nbytes: int) -> Future[None]: ...

    def submit_write(self, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int,
                     nbytes: int) -> Future[None]: ...

    def close(self) -> None: ...


Opener = Callable[[str, int, int], int]

_fallback_warned: set[str] = set()
_fallback_lock = threading.Lock()


def open_offload_file(path: Path, size_bytes: int, direct: bool, opener: Opener = os.open,
                      preallocate: bool = True) -> OffloadFile:
    """Create (or reuse) ``path`` with owner-only permissions and preallocate ``size_bytes``.

    Preallocation makes a full filesystem fail here, up front, with ENOSPC, not halfway into a step.
    ``preallocate=False``: a sparse file of that size (only parts of it are ever written: a rank's chunks
    of partitioned state); preflight has counted just those parts.
    """
    size_bytes = align_up(size_bytes)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    use_direct = direct and hasattr(os, "O_DIRECT")
    try:
        fd = opener(str(path), flags | (os.O_DIRECT if use_direct else 0), 0o600)
    except OSError as e:
        if not (use_direct and e.errno == errno.EINVAL):
            raise _error("open", path, 0, size_bytes, e) from e
        with _fallback_lock:
            key = str(path.parent)
            if key not in _fallback_warned:
                _fallback_warned.add(key)
                warnings.warn(
                    f"the filesystem of {path.parent} refuses O_DIRECT (EINVAL; tmpfs and some overlay "
                    "filesystems do): using buffered I/O there, so reads may come from the page cache and "
                    "host memory use grows with it. Point offload_dir at a local SSD for real offload.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        use_direct = False
        try:
            fd = opener(str(path), flags, 0o600)
        except OSError as e2:
            raise _error("open", path, 0, size_bytes, e2) from e2
    try:
        os.fchmod(fd, 0o600)
        if os.fstat(fd).st_size < size_bytes:
            if preallocate:
                os.posix_fallocate(fd, 0, size_bytes)
            else:
                os.ftruncate(fd, size_bytes)
    except OSError as e:
        os.close(fd)
        raise _error("preallocate", path, 0, size_bytes, e) from e
    return OffloadFile(path, fd, size_bytes, use_direct)


def _error(op: str, path: Path, offset: int, nbytes: int, cause: OSError) -> OffloadIOError:
    hint = ""
    if cause.errno == errno.ENOSPC:
        hint = " The offload filesystem is full: free space there or point offload_dir at a larger disk."
    elif cause.errno == errno.EIO:
        hint = " The device reported an I/O error: check the disk (dmesg) before retrying."
    elif cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = " Fix the directory's permissions or choose a writable offload_dir."
    return OffloadIOError(
        cause.errno,
        f"{op} of {nbytes} bytes at offset {offset} in {path} failed: {os.strerror(cause.errno or 0)}.{hint}",
    )


class ThreadedIOEngine:
    """preadv/pwritev from a thread pool, in chunks of ``config.chunk_bytes``."""

    def __init__(self, config: IOConfig | None = None,
                 on_request: Callable[[str, float, float, int], None] | None = None) -> None:
        """``on_request(op, start, end, nbytes)``: after every request that completed (one chunk's
        ``preadv``/``pwritev``, on the I/O thread that ran it): what the disk was asked for and when."""
        self.config = config or IOConfig()
        self._on_request = on_request
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            max_workers=self.config.num_threads, thread_name_prefix="greedysnake-io"
        )
        self._files: list[OffloadFile] = []
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0

    def open(self, path: Path, size_bytes: int, preallocate: bool = True) -> OffloadFile:
        file = open_offload_file(Path(path), size_bytes, self.config.direct, preallocate=preallocate)
        with self._lock:
            self._files.append(file)
        return file

    def submit_read(self, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int,
                    nbytes: int) -> Future[None]:
        return self._submit("read", file, offset, buffer, buffer_offset, nbytes)

    def submit_write(self, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int,
                     nbytes: int) -> Future[None]:
        return self._submit("write", file, offset, buffer, buffer_offset, nbytes)

    def read(self, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int, nbytes: int) -> None:
        self.submit_read(file, offset, buffer, buffer_offset, nbytes).result()

    def write(self, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int, nbytes: int) -> None:
        self.submit_write(file, offset, buffer, buffer_offset, nbytes).result()

    def _check_request(self, op: str, file: OffloadFile, offset: int, buffer_offset: int, nbytes: int) -> None:
        if self._pool is None:
            raise RuntimeError("the I/O engine is closed")
        for name, value in (("offset", offset), ("buffer_offset", buffer_offset), ("nbytes", nbytes)):
            if value % ALIGN_BYTES:
                raise ValueError(f"{op} {name}={value} is not a multiple of {ALIGN_BYTES} (O_DIRECT alignment)")
        if offset + nbytes > file.size_bytes:
            raise ValueError(f"{op} of {nbytes} bytes at offset {offset} runs past the end of {file}")

    def _submit(self, op: str, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int,
                nbytes: int) -> Future[None]:
        self._check_request(op, file, offset, buffer_offset, nbytes)
        pool = self._pool
        assert pool is not None
        # Split into chunks; the returned future completes when every chunk has, and carries the first
        # chunk's error. Each chunk touches a disjoint part of the buffer and the file: no order among them.
        chunk = self.config.chunk_bytes
        pieces = [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)] or [(0, 0)]
        fn = self._read_piece if op == "read" else self._write_piece
        chunks = [pool.submit(fn, file, offset + rel, buffer, buffer_offset + rel, size) for rel, size in pieces]
        done: Future[None] = Future()

        def settle() -> None:  # on the I/O thread that completes the last chunk
            error = next((e for e in (f.exception() for f in chunks) if e is not None), None)
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error)

        when_all(chunks, settle)
        return done

    def _read_piece(self, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int,
                    nbytes: int) -> None:
        t0 = time.perf_counter()
        self._transfer("read", os.preadv, file, offset, buffer.memoryview(buffer_offset, nbytes))
        if self._on_request is not None:
            self._on_request("read", t0, time.perf_counter(), nbytes)
        with self._lock:
            self.bytes_read += nbytes

    def _write_piece(self, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int,
                     nbytes: int) -> None:
        t0 = time.perf_counter()
        self._transfer("write", os.pwritev, file, offset, buffer.memoryview(buffer_offset, nbytes))
        if self._on_request is not None:
            self._on_request("write", t0, time.perf_counter(), nbytes)
        with self._lock:
            self.bytes_written += nbytes

    @staticmethod
    def _transfer(op: str, syscall: Callable[[int, list, int], int], file: OffloadFile, offset: int,
                  view: memoryview) -> None:
        """Loop until the whole view moved: the kernel may return less than asked (signals, EOF)."""
        nbytes = len(view)
        done = 0
        while done < nbytes:
            fd = file.fd
            if fd is None:
                raise OffloadIOError(errno.EBADF, f"{op} on closed file {file.path}")
            try:
                n = syscall(fd, [view[done:]], offset + done)
            except OSError as e:
                raise _error(op, file.path, offset + done, nbytes - done, e) from e
            if n == 0:
                if op == "read":
                    raise ShortReadError(
                        errno.EIO,
                        f"read of {nbytes} bytes at offset {offset} in {file.path} got only {done}: the file "
                        "ends early (truncated or replaced while in use)",
                    )
                raise OffloadIOError(errno.EIO, f"write at offset {offset + done} in {file.path} wrote nothing")
            done += n

    def close(self) -> None:
        """Waits for in-flight requests, stops the threads, closes every file. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            files, self._files = self._files, []
        for file in files:
            file.close()

    def __enter__(self) -> ThreadedIOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InlineIOEngine(ThreadedIOEngine):
    """A debugging backend: every transfer runs on the submitting thread and is complete when ``submit_*``
    returns. Nothing overlaps, and every staging buffer goes back to the pool at the earliest moment
    its owner allows; with the poisoning pool (``GREEDYSNAKE_DEBUG_POOL=1``) any use of a buffer after
    it was handed to write-behind computes with NaN, deterministically. Select it with
    ``GREEDYSNAKE_DEBUG_IO=inline``."""

    def _submit(self, op: str, file: OffloadFile, offset: int, buffer: AlignedBuffer, buffer_offset: int,
                nbytes: int) -> Future[None]:
        self._check_request(op, file, offset, buffer_offset, nbytes)
        done: Future[None] = Future()
        try:
            fn = self._read_piece if op == "read" else self._write_piece
            if nbytes:
                fn(file, offset, buffer, buffer_offset, nbytes)
        except BaseException as e:  # noqa: BLE001 - delivered through the future, as the threaded engine does
            done.set_exception(e)
        else:
            done.set_result(None)
        return done


DEBUG_IO_ENV = "GREEDYSNAKE_DEBUG_IO"


def default_engine(config: IOConfig,
                   on_request: Callable[[str, float, float, int], None] | None = None) -> ThreadedIOEngine:
    """The backend for ``config``: the threaded O_DIRECT engine, or :class:`InlineIOEngine` when
    ``GREEDYSNAKE_DEBUG_IO=inline``; ``on_request``: :class:`ThreadedIOEngine`'s."""
    mode = os.environ.get(DEBUG_IO_ENV, "").strip().lower()
    if mode in ("", "0", "threaded"):
        return ThreadedIOEngine(config, on_request)
    if mode == "inline":
        return InlineIOEngine(config, on_request)
    raise ValueError(f"{DEBUG_IO_ENV}={mode!r} is not a known I/O mode. Fix: unset it, or set it to 'inline'.")
