"""Per-unit regions of one kind of tensor on one tier.

``HostRegions`` keeps one page-aligned buffer per unit in RAM: users work on it in place. ``SSDRegions``
keeps one preallocated file per kind with a region per unit; its reads and writes are asynchronous and
ordered where they touch the same bytes: an operation starts only after every earlier one on an
overlapping byte range of the region has completed, unless both are reads. So a read never sees a
half-written range and a write never races a prefetch, while reads of different ranges (the slots of
an optimizer state) and of one range by two readers run at once. Submitting never blocks: an operation
that must wait is started by the completion of the last one it waits for.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from lightning_greedysnake.io import AlignedBuffer, IOEngine, OffloadFile, align_up, when_all
from lightning_greedysnake.layout import FileLayout, build_file_layout
from lightning_greedysnake.offload.stats import IOStats


class HostRegions:
    def __init__(self, kind: str, region_bytes: list[int],
                 pinner: tuple[Callable[[int, int], None], Callable[[int], None]] | None = None) -> None:
        """``pinner``: ``(pin, unpin)`` of the device tier, which copies straight out of these regions."""
        self.kind = kind
        self.layout: FileLayout = build_file_layout(region_bytes)
        # anonymous mmap: pages are materialized on first touch, so unused regions cost nothing
        # (page-locking touches them all: on a device tier host regions are resident)
        self._buffers: list[AlignedBuffer | None] = [AlignedBuffer(size) if size else None for size in region_bytes]
        if pinner is not None:
            try:
                for buf in self._buffers:
                    if buf is not None:
                        buf.pin(*pinner)
            except BaseException:
                self.close()
                raise

    def host_buffer(self, unit: int) -> AlignedBuffer:
        buf = self._buffers[unit]
        assert buf is not None, f"{self.kind}: unit {unit} has no region here (or the regions are closed)"
        return buf

    def release(self, unit: int) -> None:
        """Free unit ``unit``'s region (its memory goes back to the system; nothing may use it again)."""
        buf, self._buffers[unit] = self._buffers[unit], None
        if buf is not None:
            buf.close()

    def close(self) -> None:
        for unit in range(len(self._buffers)):
            self.release(unit)


@dataclass
class _InFlight:
    lo: int
    hi: int
    write: bool
    done: Future[None]


class SSDRegions:
    tier = "ssd"

    def __init__(self, kind: str, region_bytes: list[int], engine: IOEngine, path: Path, stats: IOStats,
                 sparse: bool = False, read_only_from: list[int] | None = None) -> None:
        """``sparse``: only parts of each region are ever written (a rank's chunks of partitioned state):
        the file is not preallocated. ``read_only_from``: per region, where its read-only part starts (the
        weights' frozen parameters, past the trained prefix; the region's size: none): the bytes of every
        transfer that fall in it are counted apart (:meth:`IOStats.record_read_only`)."""
        self.kind = kind
        self._read_only_from = read_only_from
        if read_only_from is not None and any(a < b for a, b in zip(read_only_from, region_bytes, strict=True)):
            stats.track_read_only(kind, self.tier)
        self.layout = build_file_layout(region_bytes)
        self.path = path
        self._engine = engine
        self._stats = stats
        self.file: OffloadFile = engine.open(path, max(self.layout.total_bytes, 4096), preallocate=not sparse)
        self._inflight: dict[int, list[_InFlight]] = {}
        """Per unit: operations not known to have completed (failed writes stay, so waits raise them)."""
        self._lock = threading.Lock()

    def submit_read(
        self, unit: int, buf: AlignedBuffer, label: str | None = None, byte_range: tuple[int, int] | None = None
    ) -> Future[None]:
        """Read unit ``unit``'s region (or the ``byte_range`` of it, 4 KiB aligned) into the same offsets
        of ``buf``. ``label``: the kind to count the bytes under, when it differs from the region's
        (under 32-true the optimizer reads the weights region as its master copy)."""
        return self._submit("read", unit, buf, label, byte_range)

    def submit_write(
        self, unit: int, buf: AlignedBuffer, label: str | None = None, byte_range: tuple[int, int] | None = None,
        placing: bool = False,
    ) -> Future[None]:
        """``placing``: the write places a whole unit's values (initialization, a checkpoint's load), not
        training's: its read-only bytes are counted as placed."""
        return self._submit("write", unit, buf, label, byte_range, placing)

    def wait_all(self) -> None:
        """Block until every operation submitted so far has completed; raises the first failed write (a
        failed read was raised to whoever waited for it, and changed nothing)."""
        with self._lock:
            ops = [op for unit_ops in self._inflight.values() for op in unit_ops]
        for op in ops:
            if op.write:
                op.done.result()
            else:
                op.done.exception()

    def _submit(
        self, op: str, unit: int, buf: AlignedBuffer, label: str | None, byte_range: tuple[int, int] | None,
        placing: bool = False,
    ) -> Future[None]:
        size = self.layout.sizes[unit]
        lo, hi = byte_range if byte_range is not None else (0, size)
        assert 0 <= lo <= hi <= size and buf.nbytes >= hi, (lo, hi, size, buf.nbytes)
        nbytes = hi - lo
        read_only = max(0, hi - max(lo, self._read_only_from[unit])) if self._read_only_from is not None else 0
        write = op == "write"
        done: Future[None] = Future()
        with self._lock:
            # completed operations are forgotten, but for failed writes: the bytes on disk are not what
            # later operations expect, so they fail too, and so does every wait
            ops = [o for o in self._inflight.get(unit, ())
                   if not (o.done.done() and (o.done.exception() is None or not o.write))]
            # an earlier operation on overlapping bytes must complete first, unless both only read
            deps = [o.done for o in ops if o.lo < hi and lo < o.hi and (write or o.write)]
            ops.append(_InFlight(lo, hi, write, done))
            self._inflight[unit] = ops
        offset = self.layout.offsets[unit] + lo
        kind = label or self.kind

        def start() -> None:
            failed = next((d.exception() for d in deps if d.exception() is not None), None)
            if failed is not None:
                done.set_exception(failed)  # the region is not what this operation expects: same error
                return
            t0 = time.perf_counter()
            try:
                submit = self._engine.submit_write if write else self._engine.submit_read
                f = submit(self.file, offset, buf, lo, nbytes)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on this operation
                done.set_exception(e)
                return

            def finished(fut: Future[None]) -> None:
                error = fut.exception()
                if error is None:
                    self._stats.record(kind, self.tier, op, nbytes, time.perf_counter() - t0, t0,
                                       directory=str(self.path.parent))
                    if read_only:  # (under the region's own kind, whatever the label)
                        self._stats.record_read_only(self.kind, self.tier, op, read_only, placing)
                    done.set_result(None)
                else:
                    done.set_exception(error)

            f.add_done_callback(finished)

        when_all(deps, start)
        return done

    def close(self) -> None:
        try:
            self.wait_all()
        except OSError:
            pass  # already raised to whoever waited on it; closing must still release the file
        self.file.close()


class SSDScratch:
    """Space for saved activations on SSD: bump-allocated within a window, reset at its end; the
    file grows (preallocated) when a window needs more than any before. Its users order their own
    transfers (a saved activation is read only after its write completed); the scratch only makes sure no
    transfer outlives the file: :meth:`close` waits for every one still in flight."""

    tier = "ssd"

    def __init__(self, kind: str, engine: IOEngine, path: Path, stats: IOStats) -> None:
        self.kind = kind
        self.path = path
        self._engine = engine
        self._stats = stats
        self.file: OffloadFile = engine.open(path, 4096)
        self._next = 0
        self._inflight: set[Future[None]] = set()
        """Transfers submitted and not complete (guarded by ``_lock``; completions remove themselves)."""
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> int:
        nbytes = align_up(nbytes)
        offset = self._next
        self._next += nbytes
        if self._next > self.file.size_bytes:
            self.reserve(max(self._next, 2 * self.file.size_bytes))
        return offset

    def reserve(self, nbytes: int) -> None:
        """Make the file at least ``nbytes`` long, its blocks allocated now (a full disk fails here, with
        the fix, rather than in the middle of a window)."""
        new_size = align_up(nbytes)
        if new_size <= self.file.size_bytes:
            return
        assert self.file.fd is not None
        try:
            os.posix_fallocate(self.file.fd, 0, new_size)
        except OSError as e:
            raise OSError(
                e.errno,
                f"growing {self.path} to {new_size} bytes for saved activations failed: "
                f"{os.strerror(e.errno or 0)}. Fix: free space on the offload disk or keep saved activations "
                "in host memory (offload.activations=host).",
            ) from e
        self.file.size_bytes = new_size

    def reset(self) -> None:
        self._next = 0

    def submit(self, op: str, offset: int, buf: AlignedBuffer, nbytes: int) -> Future[None]:
        nbytes = align_up(nbytes)
        t0 = time.perf_counter()
        f = (self._engine.submit_read if op == "read" else self._engine.submit_write)(self.file, offset, buf, 0, nbytes)
        with self._lock:
            self._inflight.add(f)

        def finished(fut: Future[None]) -> None:  # on an I/O thread
            with self._lock:
                self._inflight.discard(fut)
            if fut.exception() is None:
                self._stats.record(self.kind, self.tier, op, nbytes, time.perf_counter() - t0, t0,
                                   directory=str(self.path.parent))

        f.add_done_callback(finished)
        return f

    def wait_all(self) -> None:
        """Block until every transfer submitted so far completed (errors stay with their futures)."""
        with self._lock:
            pending = list(self._inflight)
        for f in pending:
            f.exception()

    def close(self) -> None:
        """Close the file once no transfer is in flight on it (a dropped read-ahead may still be)."""
        self.wait_all()
        self.file.close()
