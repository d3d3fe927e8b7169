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
- compute -> write: every H2D copy follows the compute stream's work enqueued so far
  (:class:`~lightning_greedysnake.offload.device.CudaCopies`), and a unit's step is submitted only after
  its backward was enqueued, so the copy never overwrites weights a queued kernel still reads.
- write <-> read: the H2D and D2H streams are not ordered with each other, so a read of a unit waits (on
  the host) for the unit's writes still in flight, and a write for its reads; in the steady state both
  are long done (a step reads and writes a unit once, in that order, waiting for the read between).

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
    tier = "device"

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
        self._lock = threading.Lock()

    def region_bytes(self, unit: int) -> int:
        return self.layout.sizes[unit]

    def tensor(self, unit: int, dtype: torch.dtype, numel: int) -> Tensor:
        """Region ``unit``'s first ``numel`` elements as ``dtype``: what the parameters are bound to."""
        memory = self._memory[unit]
        assert memory is not None, f"{self.kind}: region {unit} is not on the device (or the regions are closed)"
        return memory[: numel * dtype.itemsize].view(dtype)

    def last_write(self, unit: int) -> Copy | None:
        """The latest copy into region ``unit`` (None: none since the regions were made)."""
        with self._lock:
            return self._last_write.get(unit)

    def submit_write(self, unit: int, buf: AlignedBuffer, label: str | None = None,
                     byte_range: tuple[int, int] | None = None) -> Copy:
        """Copy ``buf``'s bytes ``byte_range`` (default: the whole region) into the same bytes of region
        ``unit`` on the H2D stream. ``buf`` must stay unchanged until the copy is done (its handle
        tracks the returned copy)."""
        lo, hi = self._range(unit, buf, byte_range)
        self._wait(self._take_reads(unit))  # a D2H copy still reading these bytes finishes first
        memory = self._memory[unit]
        assert memory is not None
        copy = self._copies.to_device(buf.view(torch.uint8, hi - lo, lo), memory[lo:hi])
        with self._lock:
            self._last_write[unit] = copy
        return copy

    def submit_read(self, unit: int, buf: AlignedBuffer, label: str | None = None,
                    byte_range: tuple[int, int] | None = None) -> Copy:
        """Copy region ``unit``'s bytes ``byte_range`` into the same bytes of ``buf`` on the D2H stream."""
        lo, hi = self._range(unit, buf, byte_range)
        last = self.last_write(unit)
        if last is not None:
            last.result()  # the streams are not ordered with each other: the unit's last write lands first
        memory = self._memory[unit]
        assert memory is not None
        copy = self._copies.to_host(memory[lo:hi], buf.view(torch.uint8, hi - lo, lo))
        with self._lock:
            self._reads.setdefault(unit, []).append(copy)
        return copy

    def _range(self, unit: int, buf: AlignedBuffer, byte_range: tuple[int, int] | None) -> tuple[int, int]:
        size = self.layout.sizes[unit]
        lo, hi = byte_range if byte_range is not None else (0, size)
        assert 0 <= lo <= hi <= size and buf.nbytes >= hi, (lo, hi, size, buf.nbytes)
        return lo, hi

    def _take_reads(self, unit: int) -> list[Copy]:
        with self._lock:
            return self._reads.pop(unit, [])

    @staticmethod
    def _wait(copies: list[Copy]) -> None:
        for copy in copies:
            copy.exception()  # (a failed read was raised to whoever waited for it)

    def wait_all(self) -> None:
        """Block until every copy into and out of the regions completed; raises a failed write."""
        with self._lock:
            units = set(self._reads) | set(self._last_write)
        for unit in units:
            self._wait(self._take_reads(unit))
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
