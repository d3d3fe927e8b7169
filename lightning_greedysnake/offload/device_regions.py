"""Per-unit regions of one kind resident in device memory: the compute weights of the units placed on
``device`` (``offload.weights='device'``) beside an offloaded optimizer.

A unit's region is one flat block of device memory for the whole run; its parameters are bound to
views of it (no staging, no copy per use). Only the optimizer's step changes it: the step's new
compute weights (cast on the host from the fp32 master weights, or under ``32-true`` the stepped
weights themselves) go in with an H2D copy from a pinned staging buffer (:meth:`submit_write`); a step
that needs the current values on the host (``32-true``'s master copy, a speculative step's other slot,
partitioned state's gather, checkpoints) brings them out with a D2H copy (:meth:`submit_read`). Each
copy is a :class:`~lightning_greedysnake.offload.device.Copy` future, which the staging handle on the
host side tracks like any transfer on its buffer (so the buffer is given back only once it landed).

Ordering, written at each hand-over:

- write -> compute: the thread that ran the step records the unit's last write (``_last_write``) before
  it publishes the unit in the :class:`~lightning_greedysnake.offload.residency.UpdateGate`; the
  training thread reads it only after the gate showed the unit current, and the compute stream waits
  for that copy before the unit's first op (:meth:`last_write`). The H2D stream runs its copies in
  order, so waiting for the last one waits for every earlier one of the unit.
- compute -> write: before a unit's step is submitted, the training thread records an event on the
  compute stream after its last read of the unit's weights (:meth:`readers`, ``done=True``: kept in
  ``_readers_done``); the step's H2D copies into the region wait for that event only, so the copy never
  overwrites weights a queued kernel still reads, and runs beside the ops queued after it (the rest of
  backward, the next forward's other units). Acquiring the unit forgets the event (``done=False``); a
  write with none kept (setup, a checkpoint's restore) waits for the compute stream's point at its issue.
- write -> read: a D2H copy out of a region waits for the event of the unit's last H2D copy into it (what
  produced those bytes), on the device; not for the compute stream, which never writes them.
- read -> write: a write of a unit waits (on the host) for the unit's reads still in flight; in the
  steady state they are long done (a step reads and writes a unit once, in that order, waiting for the
  read between).

Threads: the training thread (acquisition, between windows) and the thread running a step (the
optimizer lane) call in; ``_lock`` guards the tables of copies in flight.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from lightning_greedysnake.io import AlignedBuffer
from lightning_greedysnake.layout import FileLayout, build_file_layout
from lightning_greedysnake.offload.device import Copy, DeviceCopies


class DeviceRegions:
    def __init__(self, kind: str, region_bytes: list[int], copies: DeviceCopies) -> None:
        """``region_bytes``: per region (0: none on the device); the memory is taken now, for the run."""
        self.kind = kind
        self.layout: FileLayout = build_file_layout(region_bytes)
        self._copies = copies
        self._memory: list[Tensor | None] = [copies.empty(size, torch.uint8) if size else None
                                              for size in region_bytes]
        """Per region: its device memory (the compute stream's, see ``CudaCopies.empty``)."""
        self._last_write: dict[int, Copy] = {}
        """Per region: the latest H2D copy into it (see the module's docstring: the gate hands it over)."""
        self._reads: dict[int, list[Copy]] = {}
        """Per region: D2H copies out of it not known to have completed."""
        self._readers_done: dict[int, object] = {}
        """Per region: the compute stream's event after its last read of the region (set by the training
        thread before the unit's step is submitted, cleared when it acquires the unit again; read by the
        thread that runs the step; see the module's docstring)."""
        self._lock = threading.Lock()

    def tensor(self, unit: int, dtype: torch.dtype, numel: int) -> Tensor:
        """Region ``unit``'s first ``numel`` elements as ``dtype``: what the parameters are bound to."""
        memory = self._memory[unit]
        assert memory is not None, f"{self.kind}: region {unit} is not on the device (or the regions are closed)"
        return memory[: numel * dtype.itemsize].view(dtype)

    def last_write(self, unit: int) -> Copy | None:
        """The latest copy into region ``unit`` (None: none since the regions were made)."""
        with self._lock:
            return self._last_write.get(unit)

    def readers(self, units: set[int], done: bool) -> None:
        """Regions ``units``: the compute stream reads them from now on (``done=False``), or its every read
        of them is enqueued (``done=True``: an event recorded now, which later writes wait for). Training
        thread."""
        event = self._copies.compute_event() if done else None
        with self._lock:
            for unit in units:
                if event is None:
                    self._readers_done.pop(unit, None)
                else:
                    self._readers_done[unit] = event

    def submit_write(self, unit: int, buf: AlignedBuffer, label: str | None = None,
                     byte_range: tuple[int, int] | None = None, placing: bool = False) -> Copy:
        """Copy ``buf``'s bytes ``byte_range`` (default: the whole region) into the same bytes of region
        ``unit`` on the H2D stream. ``buf`` must stay unchanged until the copy is done (its handle
        tracks the returned copy). ``placing``: as :meth:`SSDRegions.submit_write`'s (nothing counts it
        here: the device copies are counted apart)."""
        device, lo, hi = self._range(unit, buf, byte_range)
        self._finish_reads(unit)  # a D2H copy still reading these bytes finishes first
        with self._lock:
            freed = self._readers_done.get(unit)
        # ordering: after the compute stream's last read of the region (the event the training thread
        # recorded before submitting the step), not its later work; none recorded: its point now
        copy = self._copies.to_device(buf.view(torch.uint8, hi - lo, lo), device, after=freed)
        with self._lock:
            self._last_write[unit] = copy
        return copy

    def submit_read(self, unit: int, buf: AlignedBuffer, label: str | None = None,
                    byte_range: tuple[int, int] | None = None) -> Copy:
        """Copy region ``unit``'s bytes ``byte_range`` into the same bytes of ``buf`` on the D2H stream."""
        device, lo, hi = self._range(unit, buf, byte_range)
        last = self.last_write(unit)
        # ordering: after the H2D copy that produced these bytes (the unit's last write: the H2D stream
        # runs in order), on the device; none yet: the compute stream's point now
        copy = self._copies.to_host(device, buf.view(torch.uint8, hi - lo, lo), after=last)
        with self._lock:
            self._reads.setdefault(unit, []).append(copy)
        return copy

    def _range(self, unit: int, buf: AlignedBuffer,
               byte_range: tuple[int, int] | None) -> tuple[Tensor, int, int]:
        size = self.layout.sizes[unit]
        lo, hi = byte_range if byte_range is not None else (0, size)
        assert 0 <= lo <= hi <= size and buf.nbytes >= hi, (lo, hi, size, buf.nbytes)
        return self.tensor(unit, torch.uint8, hi)[lo:], lo, hi

    def _finish_reads(self, unit: int) -> None:
        """Wait for region ``unit``'s D2H copies in flight (taken under the lock, waited for outside it)."""
        with self._lock:
            copies = self._reads.pop(unit, [])
        for copy in copies:
            copy.exception()  # (a failed read was raised to whoever waited for it)

    def wait_all(self) -> None:
        """Block until every copy into and out of the regions completed; raises a failed write."""
        with self._lock:
            units = set(self._reads) | set(self._last_write)
        for unit in units:
            self._finish_reads(unit)
            last = self.last_write(unit)
            if last is not None:
                last.result()

    def close(self) -> None:
        """Wait for every copy in flight, then give the device memory back (to the compute stream's
        allocator: later work on it is stream-ordered)."""
        try:
            self.wait_all()
        except Exception:  # noqa: BLE001 - already raised to whoever waited on it; closing must still free
            pass
        self._memory = [None] * len(self._memory)
        with self._lock:
            self._last_write.clear()
            self._reads.clear()
            self._readers_done.clear()
