"""Staging: the budgeted pool of page-aligned host buffers, every kind's per-unit regions on their tiers,
and the handles through which a staged buffer is used and given back.

Ownership. A :class:`Staged` handle owns one buffer and every transfer in flight on it. It has one owner
at a time, the holder of the reference, and changes hands only in one of two ways, each named where it
happens: a lane job that captures it (the lane's queue lock orders the hand-over), or a table guarded by
a lock from which the next owner pops it. The buffer goes back only through :meth:`Staged.release`,
exactly once, on whatever path ends its use (success, failure, drop, teardown), and reaches the pool
only after every transfer on it completed (from the last one's completion callback if need be).

Budget. Work that must run (a unit in use, its gradient, the running steps' staging, two activation
checkpoints on SSD) never needs more than :attr:`StagingArena.min_budget_bytes` at once. Work ahead of
need (prefetches, read-aheads) holds only the slack over that minimum, so a must-run acquisition only
ever waits for write-behind to return buffers, never for a prefetch to be used.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.config import REGION_KINDS, OffloadConfig, TensorKind, Tier
from lightning_greedysnake.io import AlignedBuffer, IOEngine, OffloadFile, align_up
from lightning_greedysnake.layout import StateLayout, unit_tiers
from lightning_greedysnake.offload.device import DeviceCopies
from lightning_greedysnake.offload.device_regions import DeviceRegions
from lightning_greedysnake.offload.pool import BufferBudgetError, BufferPool
from lightning_greedysnake.offload.stats import IOStats
from lightning_greedysnake.offload.tiers import HostRegions, SSDRegions
from lightning_greedysnake.planner.staging import StagingBudget, staging_budget, unit_staging

FILE_NAMES = {
    TensorKind.WEIGHTS: "weights.bin",
    TensorKind.MASTER_WEIGHTS: "master_weights.bin",
    TensorKind.OPTIMIZER_STATES: "optimizer_states.bin",
    TensorKind.GRADIENTS: "gradients.bin",
    TensorKind.CHECKPOINTS: "checkpoints.bin",
}
SLOTTED = (TensorKind.WEIGHTS, TensorKind.MASTER_WEIGHTS, TensorKind.OPTIMIZER_STATES)
"""The kinds a step rewrites: with two slots (speculative steps) each unit has two regions of each."""


class Staged:
    """A staging buffer and every transfer in flight on it (see the module's docstring)."""

    __slots__ = ("_io", "_pool", "_released", "_slack", "_unawaited", "buf", "what")

    def __init__(self, buf: AlignedBuffer, pool: BufferPool | None, what: str,
                 slack: Callable[[int], None] | None = None) -> None:
        self.buf = buf
        self.what = what
        self._pool = pool
        """None: a host-tier region, owned by its :class:`HostRegions`; nothing goes back anywhere."""
        self._io: list[Future[None]] = []
        """Every read and write submitted on the buffer and not known complete (completed ones are
        pruned as new ones come). Appended by the owner only."""
        self._unawaited: list[Future[None]] = []
        """Reads the owner has not waited for yet (a subset of ``_io``)."""
        self._released = False
        self._slack = slack
        """Taken ahead of need from the budget's slack: called with the byte count once the work it was
        taken for owns it (:meth:`take_over`) or it is given back."""

    @property
    def pooled(self) -> bool:
        return self._pool is not None

    def view(self, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> Tensor:
        assert not self._released, f"{self.what}: used after it was released"
        return self.buf.view(dtype, numel, offset_bytes)

    def track_read(self, fut: Future[None]) -> None:
        self._prune()
        self._io.append(fut)
        self._unawaited.append(fut)

    def track_write(self, fut: Future[None]) -> None:
        self._prune()
        self._io.append(fut)

    def _prune(self) -> None:
        if len(self._io) > 8:
            self._io = [f for f in self._io if not f.done()]

    @property
    def reads_pending(self) -> bool:
        return bool(self._unawaited)

    @property
    def reads_landed(self) -> bool:
        """Every read into the buffer completed (without waiting; a failed one counts: the owner's
        wait raises it)."""
        return all(f.done() for f in self._unawaited)

    def wait_reads(self) -> None:
        """Block until every read into the buffer landed; raises the first failure (the handle still
        owns the buffer then: release it)."""
        reads, self._unawaited = self._unawaited, []
        for f in reads:
            f.result()

    def wait_io(self) -> None:
        """Block until every transfer on the buffer completed, before the owner changes its bytes (a
        write still in flight reads them)."""
        for f in list(self._io):
            f.exception()

    def count_as_slack(self, give_back: Callable[[int], None]) -> None:
        """An owned buffer now counts as work ahead of need: ``give_back`` is called with its byte count
        once the work it is kept for takes it over or it is released (owner only)."""
        assert self._slack is None, f"{self.what}: already counted as slack"
        self._slack = give_back

    def take_over(self) -> None:
        """The work a prefetch was taken for owns this buffer now: it stops counting against the slack."""
        slack, self._slack = self._slack, None
        if slack is not None:
            slack(self.buf.nbytes)

    def release(self) -> None:
        """Give the buffer back, once every transfer on it completed. Exactly once per handle."""
        assert not self._released, f"{self.what}: released twice"
        self._released = True
        self.take_over()
        pool = self._pool
        pending = [f for f in self._io if not f.done()]
        self._io, self._unawaited = [], []
        if pool is None:
            # a host-tier region stays its tier's; a device copy still reading or filling it must land
            # before anyone else (the lane's step of the unit) changes or reads it
            for f in pending:
                f.exception()
            return
        if not pending:
            pool.release(self.buf)
            return
        remaining = [len(pending)]
        gate = threading.Lock()
        pool.will_return()

        def one_done(_: Future[None]) -> None:  # on an I/O thread
            with gate:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                pool.release(self.buf, returning=True)

        for f in pending:
            f.add_done_callback(one_done)


def placement_of(state: StateLayout, config: OffloadConfig, device_tier: bool = False) -> dict[TensorKind, list[Tier]]:
    """Every region kind's tier per unit (a split kind's first units in RAM; see ``Split``). Without a
    device tier (``device_tier``: a GPU, or the simulated device) the compute device's memory is host
    RAM: a unit placed on ``device`` is a host-tier unit."""
    def resolved(tier: Tier) -> Tier:
        return Tier.HOST if tier is Tier.DEVICE and not device_tier else tier

    return {kind: [resolved(t) for t in unit_tiers(state.all_region_bytes(kind), config.tier(kind))]
            for kind in REGION_KINDS}


def staging_budget_of(state: StateLayout, config: OffloadConfig, lag: int, device_tier: bool = False) -> StagingBudget:
    """The staging rule (:func:`~lightning_greedysnake.planner.staging.staging_budget`) for ``state``
    placed as ``config`` says, at ``lag``, with ``config.prefetch_units`` prefetches. (Activation
    checkpoints on SSD add two checkpoints once their size is known: :meth:`StagingArena.reserve_checkpoints`.)"""
    tiers = placement_of(state, config, device_tier)
    units = [unit_staging({kind.value: state.region_bytes(kind, u) for kind in REGION_KINDS},
                          {kind.value: tiers[kind][u].value for kind in REGION_KINDS})
             for u in range(state.num_units)]
    return staging_budget(units, lag, config.prefetch_units)


class StagingArena:
    """The pool, the budget and its slack, and every kind's per-unit regions (host buffers or an SSD
    file each). Shared by the training thread, the optimizer lane and I/O completion callbacks: the
    regions order their own transfers, the pool locks itself, and ``_lock`` guards the slack counters."""

    def __init__(self, state: StateLayout, config: OffloadConfig, stats: IOStats, lag: int, slots: int = 1,
                 copies: DeviceCopies | None = None, others_active: Callable[[], bool] | None = None) -> None:
        """``copies``: the device tier (a GPU, or the simulated device), where units placed on ``device``
        keep their regions (:class:`DeviceRegions`); None: the CPU computes, ``device`` is host RAM.
        ``others_active``: whether another thread (the optimizer lane) holds buffers it will give back
        (see :class:`BufferPool`)."""
        self.state = state
        self.config = config
        self.stats = stats
        self.copies = copies
        self.slots = slots
        """2: speculative steps (fp16 loss scaling) keep two regions per unit of each :data:`SLOTTED` kind,
        so a step can be undone: it writes the slot not in use and flips to it once complete."""
        self._slot: dict[TensorKind, list[int]] = {kind: [0] * state.num_units for kind in SLOTTED}
        """Per kind, which slot holds each unit's current values. Read by every thread that stages the unit;
        flipped by the thread that completes the unit's step, before it publishes the update (whoever
        reads the unit next waits for that publication), and flipped back by a rollback (training thread,
        the lane drained)."""
        self.unit_tiers = placement_of(state, config, copies is not None)
        """Per region kind, each unit's tier (whole kinds: the same for every unit)."""
        self._host: dict[TensorKind, HostRegions] = {}
        self._device: dict[TensorKind, DeviceRegions] = {}
        self._ssd: dict[TensorKind, dict[int, SSDRegions]] = {}
        """Per kind, per offload directory (index), the SSD regions of the units striped there."""
        self._directory: dict[TensorKind, list[int | None]] = {}
        """Per kind, each unit's offload directory (index), set by :meth:`stripe`."""
        self.stripe(1)
        self.files: list[Path] = []
        self._lock = threading.Lock()
        """Guards the budget's accounting below; taken before the pool's own lock, never after it."""
        self._optional_bytes = 0
        """Bytes of staging held by work ahead of need. Written by whoever takes or gives back such work
        (the training thread, the lane), under ``_lock``."""
        self._staging_pending = 0
        """Bytes that submitted steps have yet to stage (their master and state buffers): with what is
        in use, the most they can still take before anything comes back. Raised by the training thread
        (:meth:`count_step_submitted`), lowered by the lane (:meth:`count_step_staged`), under ``_lock``."""
        self._checkpoint_reserve = 0
        """Two activation checkpoints on SSD, once known (:meth:`reserve_checkpoints`; training thread,
        under ``_lock``)."""
        rule = staging_budget_of(state, config, lag, copies is not None)
        self._min_bytes = rule.minimum_bytes
        """What the must-run work holds at once (the staging rule's minimum, plus the checkpoint reserve).
        Written by the training thread (:meth:`set_budget`, :meth:`reserve_checkpoints`) under ``_lock``;
        read under it by every thread that takes work ahead of need."""
        budget = config.buffer_budget_bytes
        if budget is not None and budget < self._min_bytes:
            raise BufferBudgetError(
                f"offload.buffer_budget_bytes={budget} is below the {self._min_bytes} bytes one unit's "
                "weights, gradient, master weights and optimizer state need at once. Fix: raise it to at "
                f"least {self._min_bytes}, lower layers_per_unit, or leave it None (automatic)."
            )
        self.pool = BufferPool(budget if budget is not None else rule.automatic_bytes,
                               pinner=(copies.pin, copies.unpin) if copies is not None else None,
                               others_active=others_active)

    @property
    def min_budget_bytes(self) -> int:
        """What the must-run work holds at once (see the module's docstring)."""
        with self._lock:
            return self._min_bytes

    # -- lifetime (training thread) ----------------------------------------------------------------
    def open(self, offload_dirs: list[Path], engines: list[IOEngine]) -> None:
        """Create the host regions and the preallocated offload files (after preflight). A split kind has
        both: its host units' regions in RAM, its SSD units' in files. With several directories (one
        per SSD, each with its engine) a kind's SSD units are striped over them unit by unit: the i-th
        SSD unit in directory ``i % len(offload_dirs)``, one file of the kind in each."""
        n = self.state.num_units
        try:
            for kind in REGION_KINDS:
                copies = self.slots if kind in SLOTTED else 1  # (slot s of unit u: region u + s * n)
                sizes, tiers = self.state.all_region_bytes(kind), self.unit_tiers[kind]
                in_ram = [size if t is Tier.HOST else 0 for size, t in zip(sizes, tiers, strict=True)] * copies
                on_device = [size if t is Tier.DEVICE else 0 for size, t in zip(sizes, tiers, strict=True)] * copies
                for d, directory in enumerate(offload_dirs):
                    here = [size if self.directory_of(kind, u % n) == d else 0
                            for u, size in enumerate(sizes * copies)]
                    if sum(here):
                        path = directory / FILE_NAMES[kind]
                        self.files.append(path)
                        self._ssd.setdefault(kind, {})[d] = SSDRegions(
                            kind.value, here, engines[d], path, self.stats, sparse=self.state.sharded(kind))
                if sum(in_ram):
                    # only weights and gradients are copied to and from the device straight out of
                    # their host regions: only they are page-locked (the optimizer's stay pageable)
                    pinner = self.pool.pinner if kind in (TensorKind.WEIGHTS, TensorKind.GRADIENTS) else None
                    self._host[kind] = HostRegions(kind.value, in_ram, pinner)
                if sum(on_device):
                    assert self.copies is not None  # (without a device tier, placement_of made them host)
                    self._device[kind] = DeviceRegions(kind.value, on_device, self.copies)
        except BaseException:
            self.close()
            raise

    def directory_of(self, kind: TensorKind, u: int) -> int | None:
        """Which offload directory keeps unit ``u``'s region of ``kind`` (None: it is not on SSD)."""
        return self._directory[kind][u]

    def flush(self) -> None:
        """Wait for every transfer in flight on the regions (raises the first I/O error)."""
        for regions in [*self._all_ssd(), *self._device.values()]:
            regions.wait_all()
        self.pool.wait_returned()  # (buffers given back by those transfers' callbacks: in the pool now)

    def close(self) -> None:
        """Close the regions (each waits for its transfers first) and the pool; buffers still held come
        back to a closed pool and are freed there."""
        for regions in [*self._all_ssd(), *self._host.values(), *self._device.values()]:
            regions.close()
        self._ssd.clear()
        self._host.clear()
        self._device.clear()
        self.pool.close()

    # -- sizes ---------------------------------------------------------------------------------------
    def ssd_bytes(self, directory: int | None = None) -> dict[str, int]:
        """Bytes each SSD-resident kind keeps in offload directory ``directory`` (None: in all of them),
        for preflight."""
        kept = {kind.value: sum(self.state.kept_unit_bytes(kind, u) for u, d in enumerate(self._directory[kind])
                                if d is not None and (directory is None or d == directory))
                * (self.slots if kind in SLOTTED else 1) for kind in REGION_KINDS}
        return {kind: n for kind, n in kept.items() if n}

    def host_bytes(self) -> int:
        """RAM the host-tier regions take (every slot; this rank's chunk of partitioned kinds)."""
        return sum(self.state.kept_unit_bytes(kind, u) * (self.slots if kind in SLOTTED else 1)
                   for kind in REGION_KINDS for u, t in enumerate(self.unit_tiers[kind]) if t is Tier.HOST)

    def open_files(self) -> list[OffloadFile]:
        return [r.file for r in self._all_ssd()]

    def _all_ssd(self) -> list[SSDRegions]:
        return [r for per_dir in self._ssd.values() for r in per_dir.values()]

    def stripe(self, num_dirs: int) -> None:
        """Stripe every kind's SSD units over ``num_dirs`` offload directories (before :meth:`open`)."""
        for kind, tiers in self.unit_tiers.items():
            on_ssd = [u for u, t in enumerate(tiers) if t is Tier.SSD and self.state.region_bytes(kind, u)]
            where: list[int | None] = [None] * len(tiers)
            for i, u in enumerate(on_ssd):
                where[u] = i % num_dirs
            self._directory[kind] = where

    def on_ssd(self, kind: TensorKind, u: int) -> bool:
        """Whether unit ``u``'s region of ``kind`` lives on SSD (staged through the pool)."""
        return self.unit_tiers[kind][u] is Tier.SSD and kind in self._ssd

    def on_device(self, kind: TensorKind, u: int) -> bool:
        """Whether unit ``u``'s region of ``kind`` is resident in device memory (:class:`DeviceRegions`)."""
        return self.unit_tiers[kind][u] is Tier.DEVICE and kind in self._device

    def device_tensor(self, kind: TensorKind, u: int, dtype: torch.dtype) -> tuple[Tensor, Any]:
        """Unit ``u``'s device-resident region of ``kind`` (its current slot) as ``dtype``, and the latest
        copy into it (None: none), which the compute stream must wait for before reading it."""
        regions = self._device[kind]
        index = self._index(kind, u)
        return regions.tensor(index, dtype, self.state.units[u].numel), regions.last_write(index)

    def _index(self, kind: TensorKind, u: int, next_slot: bool = False) -> int:
        """The region of unit ``u`` holding its current values of ``kind`` (``next_slot``: the other one)."""
        if self.slots == 1 or kind not in SLOTTED:
            return u
        return u + (self._slot[kind][u] ^ int(next_slot)) * self.state.num_units

    def flip(self, u: int) -> None:
        """Unit ``u``'s step is complete (written to the other slots): they become its current values."""
        if self.slots > 1:
            for kind in SLOTTED:
                self._slot[kind][u] ^= 1

    def slots_of(self, u: int) -> tuple[int, ...]:
        return tuple(self._slot[kind][u] for kind in SLOTTED)

    def restore_slots(self, u: int, slots: tuple[int, ...]) -> None:
        """Roll back: unit ``u``'s current values are where they were (training thread, nothing in flight
        writing them)."""
        for kind, slot in zip(SLOTTED, slots, strict=True):
            self._slot[kind][u] = slot

    def _regions(self, kind: TensorKind, u: int) -> HostRegions | SSDRegions | DeviceRegions:
        d = self._directory[kind][u]
        if d is not None and self.on_ssd(kind, u):
            return self._ssd[kind][d]
        return self._device[kind] if self.on_device(kind, u) else self._host[kind]

    def ssd_region_bytes(self, kind: TensorKind, u: int) -> int:
        """Pool bytes reading unit ``u``'s region of ``kind`` ahead takes (0 where it is not on SSD)."""
        return align_up(self.state.region_bytes(kind, u)) if self.on_ssd(kind, u) else 0

    def staged_region_bytes(self, kind: TensorKind, u: int) -> int:
        """Pool bytes staging unit ``u``'s region of ``kind`` takes: on SSD, and on the device (a step's
        copy of it on the host); 0 on the host tier, which is used in place."""
        return align_up(self.state.region_bytes(kind, u)) if self.on_ssd(kind, u) or self.on_device(kind, u) else 0

    def set_budget(self, budget_bytes: int, lag: int) -> None:
        """Between steps (the planner's choice; training thread): a new lag changes the minimum; the
        budget never goes below it."""
        rule = staging_budget_of(self.state, self.config, lag, self.copies is not None)
        with self._lock:
            self._min_bytes = rule.minimum_bytes + self._checkpoint_reserve
            self.pool.set_budget(max(budget_bytes, self._min_bytes))

    def reserve_checkpoints(self, checkpoint_bytes: int) -> None:
        """Activation checkpoints on SSD: the must-run work holds two at once (one read back for the op
        in progress, one being written), known once the first one is saved (training thread). Raises
        the minimum (and an automatic budget with it); an explicit budget below the new minimum is a
        clear error."""
        reserve = 2 * align_up(checkpoint_bytes)
        with self._lock:
            if reserve <= self._checkpoint_reserve:
                return
            grow = reserve - self._checkpoint_reserve
            self._checkpoint_reserve = reserve
            self._min_bytes += grow
            minimum, budget = self._min_bytes, self.pool.budget_bytes
            if self.config.buffer_budget_bytes is None:
                self.pool.set_budget(budget + grow)
                return
        if budget < minimum:
            raise BufferBudgetError(
                f"offload.buffer_budget_bytes={budget} is below the {minimum} "
                f"bytes one unit's working set and two activation checkpoints of {checkpoint_bytes} bytes "
                f"(offload.checkpoints='ssd') need at once. Fix: raise it to at least {minimum}, "
                "or leave it None (automatic)."
            )

    # -- staging (any thread; each handle then belongs to the caller) ---------------------------------
    def stage(self, kind: TensorKind, u: int, *, read: bool, label: str | None = None,
              ranges: list[tuple[int, int]] | None = None, wait: bool = True) -> Staged:
        """A handle on unit ``u``'s region of ``kind``: the region itself on the host tier; a pool buffer
        on the SSD tier, filled from the SSD when ``read`` (only ``ranges``, byte ranges of the region, if
        given; counted under ``label`` if given), and likewise on the device tier (a D2H copy). ``wait=False``: return with the reads in flight, for
        :meth:`await_reads` (so several regions load at once). On a failure the buffer is given back."""
        regions = self._regions(kind, u)
        what = f"unit {u} {kind.value}"
        if isinstance(regions, HostRegions):
            return Staged(regions.host_buffer(self._index(kind, u)), None, what)
        buf = self.pool.acquire(regions.region_bytes(u), what=what)
        assert buf is not None
        held = Staged(buf, self.pool, what)
        if read:
            try:
                self.read_into(kind, u, held, ranges, label)
            except BaseException:
                held.release()
                raise
            if wait:
                self.await_reads(held, label=label or kind.value)
        return held

    def stage_update(self, kind: TensorKind, u: int, *, read: bool, label: str | None = None,
                     ranges: list[tuple[int, int]] | None = None, wait: bool = True) -> Staged:
        """:meth:`stage` for a step that will write its result with ``put_back(..., next_slot=True)``. With
        two slots, on the host tier: the other slot's region, with ``ranges`` of the current one copied in
        when ``read`` (the step changes it in place; the current values stay untouched for a rollback)."""
        regions = self._regions(kind, u)
        if self.slots == 1 or kind not in SLOTTED or not isinstance(regions, HostRegions):
            return self.stage(kind, u, read=read, label=label, ranges=ranges, wait=wait)
        src = regions.host_buffer(self._index(kind, u)).tensor
        dst = regions.host_buffer(self._index(kind, u, next_slot=True))
        assert src is not None and dst.tensor is not None
        if read:
            for a, b in ranges if ranges is not None else [(0, regions.region_bytes(u))]:
                dst.tensor[a:b].copy_(src[a:b])
        return Staged(dst, None, f"unit {u} {kind.value} (next slot)")

    def acquire(self, nbytes: int, what: str) -> Staged:
        """A handle on a pool buffer of ``nbytes`` for must-run work (waits for write-behind if need be)."""
        buf = self.pool.acquire(nbytes, what=what)
        assert buf is not None
        return Staged(buf, self.pool, what)

    def read_into(self, kind: TensorKind, u: int, held: Staged, ranges: list[tuple[int, int]] | None = None,
                  label: str | None = None) -> None:
        """Submit reads of unit ``u``'s region (or its byte ``ranges``) into ``held``; they are ``held``'s."""
        regions = self._regions(kind, u)
        assert not isinstance(regions, HostRegions)
        index = self._index(kind, u)
        for r in ranges if ranges is not None else [None]:  # type: ignore[list-item]
            held.track_read(regions.submit_read(index, held.buf, label, r))

    def await_reads(self, *helds: Staged | None, label: str = "optimizer") -> None:
        """Wait for the reads of ``helds``; if one failed, give every one of ``helds`` back (each waits
        for what is still in flight on it) and raise."""
        t0 = time.perf_counter()
        try:
            for held in helds:
                if held is not None:
                    held.wait_reads()
        except BaseException:
            for held in helds:
                if held is not None:
                    held.release()
            raise
        if threading.current_thread() is threading.main_thread():
            self.stats.record_wait(label, "ssd", time.perf_counter() - t0)

    def put_back(self, kind: TensorKind, u: int, held: Staged, ranges: list[tuple[int, int]] | None = None, *,
                 release: bool = True, label: str | None = None, next_slot: bool = False) -> None:
        """Write ``held`` (or its byte ``ranges``) to unit ``u``'s region of ``kind`` (write-behind) and,
        with ``release``, give it back (the buffer returns once written). Host-tier regions were changed
        in place: nothing to write. ``next_slot``: a speculative step's write, to the slot not in use."""
        if held.pooled:
            # a device copy still filling the buffer (a gradient coming back) must land before the
            # write reads it
            held.wait_reads()
            regions = self._regions(kind, u)
            assert not isinstance(regions, HostRegions)
            index = self._index(kind, u, next_slot)
            for r in ranges if ranges is not None else [None]:  # type: ignore[list-item]
                held.track_write(regions.submit_write(index, held.buf, label, r))
        if release:
            held.release()

    # -- work ahead of need -----------------------------------------------------------------------
    def acquire_optional(self, nbytes: int, what: str, within_slack: bool = True) -> Staged | None:
        """A handle for work ahead of need, or ``None``. It counts against the slack until the work it
        was read for takes it over (:meth:`Staged.take_over`) or it is released. ``within_slack=False``:
        the caller made sure otherwise (:meth:`read_ahead_fits`)."""
        size = align_up(nbytes)
        with self._lock:
            if within_slack and not self._slack_allows(size):
                return None
            buf = self.pool.acquire(size, block=False, what=what)
            if buf is None:
                return None
            self._optional_bytes += buf.nbytes
        return Staged(buf, self.pool, what, slack=self._give_back_slack)

    def adopt_optional(self, held: Staged) -> bool:
        """Make an owned handle count as work ahead of need (the slack permitting): unit 0's new weights
        kept for the next forward. False: no room; the caller keeps it."""
        size = held.buf.nbytes
        with self._lock:
            if not self._slack_allows(size):
                return False
            self._optional_bytes += size
        held.count_as_slack(self._give_back_slack)
        return True

    def read_ahead_fits(self, nbytes: int, unit_need_bytes: int | None) -> bool:
        """Whether a read-ahead of ``nbytes`` for the window's last step may be taken: from the slack, or
        from what the minimum reserves but this moment cannot use. Every other step of the window is
        submitted, so until this one runs the work can still take only the staging those steps have not
        taken yet and the unit's own weights and gradient (``unit_need_bytes``). If that fits beside
        everything held now and the read-ahead, nobody ever waits for it. (Not with partitioned state,
        whose weights gather stages more.) ``unit_need_bytes`` None: a step that is not the window's
        last, which only the slack may hold."""
        with self._lock:
            if self._slack_allows(nbytes):
                return True
            return unit_need_bytes is not None and self.state.shard is None and (
                self.pool.in_use_bytes + nbytes + self._staging_pending + unit_need_bytes <= self.pool.budget_bytes
            )

    def count_step_submitted(self, nbytes: int) -> None:
        """A step that will stage ``nbytes`` was submitted (training thread)."""
        with self._lock:
            self._staging_pending += nbytes

    def count_step_staged(self, nbytes: int) -> None:
        """That step has staged them (the lane)."""
        with self._lock:
            self._staging_pending -= nbytes

    def _slack_allows(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more of work ahead of need fit in the slack (call with ``_lock`` held)."""
        return self._min_bytes + self._optional_bytes + nbytes <= self.pool.budget_bytes

    def _give_back_slack(self, nbytes: int) -> None:
        with self._lock:
            self._optional_bytes -= nbytes
