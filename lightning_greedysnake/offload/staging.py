"""Staging: the budgeted pool of page-aligned host buffers, the handles through which a unit's region
(on its tier: :mod:`.regions`) is used and given back, and the arena that hands them out.

Ownership. A :class:`Staged` handle owns one buffer and every transfer in flight on it. It has one owner
at a time, the holder of the reference, and changes hands only in one of two ways, each named where it
happens: a lane job that captures it (the lane's queue lock orders the hand-over), or a table guarded by
a lock from which the next owner pops it. The buffer goes back only through :meth:`Staged.release`,
exactly once, on whatever path ends its use (success, failure, drop, teardown), and reaches the pool
only after every transfer on it completed (from the last one's completion callback if need be).

Budget. Work that must run (a unit in use, its gradient, the running steps' staging, two saved
activations on SSD) never needs more than :attr:`PoolBudget.minimum_bytes` at once. Work ahead of
need (prefetches, read-aheads) holds only the slack over that minimum, so a must-run acquisition only
ever waits for write-behind to return buffers, never for a prefetch to be used.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.config import REGION_KINDS, OffloadConfig, TensorKind
from lightning_greedysnake.io import AlignedBuffer, align_up, when_all
from lightning_greedysnake.layout import StateLayout
from lightning_greedysnake.offload.device import DeviceCopies
from lightning_greedysnake.offload.device_regions import DeviceRegions
from lightning_greedysnake.offload.pool import BufferBudgetError, BufferPool
from lightning_greedysnake.offload.regions import SLOTTED, RegionMap, SlotMap, placement_of
from lightning_greedysnake.offload.stats import IOStats
from lightning_greedysnake.offload.tiers import HostRegions
from lightning_greedysnake.planner.staging import StagingBudget, staging_budget, unit_staging


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
        pool.will_return()
        when_all(pending, lambda: pool.release(self.buf, returning=True))  # (on an I/O thread)


def staging_budget_of(state: StateLayout, config: OffloadConfig, lag: int, device_tier: bool = False) -> StagingBudget:
    """The staging rule (:func:`~lightning_greedysnake.planner.staging.staging_budget`) for ``state``
    placed as ``config`` says, at ``lag``, with ``config.prefetch_units`` prefetches. (Saved activations
    on SSD add two of them once their size is known: :meth:`PoolBudget.reserve_activations`.)"""
    tiers = placement_of(state, config, device_tier)
    units = [unit_staging({kind.value: state.region_bytes(kind, u) for kind in REGION_KINDS},
                          {kind.value: tiers[kind][u].value for kind in REGION_KINDS})
             for u in range(state.num_units)]
    return staging_budget(units, lag, config.prefetch_units)


WRITE_BEHIND_WAIT_S = 10.0
"""How long work ahead of need waits for buffers on their way back from a write (see
:meth:`PoolBudget.take_optional`) before it is refused."""


class PoolBudget:
    """The pool, its budget, the minimum the must-run work holds and the slack over it. Shared by the
    training thread, the optimizer lane and I/O completion callbacks: the pool locks itself, and ``_lock``
    guards the accounting below."""

    def __init__(self, state: StateLayout, config: OffloadConfig, lag: int, device_tier: bool,
                 pinner: tuple[Callable[[int, int], None], Callable[[int], None]] | None = None,
                 others_active: Callable[[], bool] | None = None, double_buffered: bool = False) -> None:
        """``device_tier``: units placed on ``device`` keep their regions there (see :func:`placement_of`);
        ``pinner``, ``others_active``: the pool's (see :class:`BufferPool`); ``double_buffered``: unless
        ``config`` gives a budget, the staging rule's double-buffered one, not the automatic one."""
        self.state = state
        self.config = config
        self.device_tier = device_tier
        self._lock = threading.Lock()
        """Guards the budget's accounting below; taken before the pool's own lock, never after it."""
        self._optional_bytes = 0
        """Bytes of staging held by work ahead of need. Written by whoever takes or gives back such work
        (the training thread, the lane), under ``_lock``."""
        self._staging_pending = 0
        """Bytes that submitted steps have yet to stage (their master and state buffers): with what is
        in use, the most they can still take before anything comes back. Raised by the training thread
        (:meth:`count_step_submitted`), lowered by the lane (:meth:`count_step_staged`), under ``_lock``."""
        self._activation_reserve = 0
        """Two saved activations on SSD, once known (:meth:`reserve_activations`; training thread,
        under ``_lock``)."""
        rule = staging_budget_of(state, config, lag, device_tier)
        self._min_bytes = rule.minimum_bytes
        """What the must-run work holds at once (the staging rule's minimum, plus the saved activations'
        reserve). Written by the training thread (:meth:`set_budget`, :meth:`reserve_activations`) under ``_lock``;
        read under it by every thread that takes work ahead of need."""
        budget = config.buffer_budget_bytes
        if budget is not None and budget < self._min_bytes:
            raise BufferBudgetError(
                f"offload.buffer_budget_bytes={budget} is below the {self._min_bytes} bytes one unit's "
                "weights, gradient, master weights and optimizer state need at once. Fix: raise it to at "
                f"least {self._min_bytes}, lower layers_per_unit, or leave it None (automatic)."
            )
        self.pool = BufferPool(budget if budget is not None else rule.of(double_buffered), pinner=pinner,
                               others_active=others_active)
        """Every staging buffer. Its budget is set by the training thread under ``_lock`` (:meth:`set_budget`,
        :meth:`reserve_activations`), and read under it by every thread that takes work ahead of need."""

    @property
    def minimum_bytes(self) -> int:
        """What the must-run work holds at once (see the module's docstring)."""
        with self._lock:
            return self._min_bytes

    def set_budget(self, budget_bytes: int, lag: int) -> None:
        """Between steps (the planner's choice; training thread): a new lag changes the minimum; the
        budget never goes below it."""
        rule = staging_budget_of(self.state, self.config, lag, self.device_tier)
        with self._lock:
            self._min_bytes = rule.minimum_bytes + self._activation_reserve
            self.pool.set_budget(max(budget_bytes, self._min_bytes))

    def reserve_activations(self, unit_input_bytes: int) -> None:
        """Saved activations on SSD: the must-run work holds two at once (one read back for the op
        in progress, one being written), known once the first one is saved (training thread). Raises
        the minimum (and an automatic budget with it); an explicit budget below the new minimum is a
        clear error."""
        reserve = 2 * align_up(unit_input_bytes)
        with self._lock:
            if reserve <= self._activation_reserve:
                return
            grow = reserve - self._activation_reserve
            self._activation_reserve = reserve
            self._min_bytes += grow
            minimum, budget = self._min_bytes, self.pool.budget_bytes
            if self.config.buffer_budget_bytes is None:
                self.pool.set_budget(budget + grow)
                return
        if budget < minimum:
            raise BufferBudgetError(
                f"offload.buffer_budget_bytes={budget} is below the {minimum} "
                f"bytes one unit's working set and two saved activations of {unit_input_bytes} bytes "
                f"(offload.activations='ssd') need at once. Fix: raise it to at least {minimum}, "
                "or leave it None (automatic)."
            )

    # -- work ahead of need (the training thread, the lane) -----------------------------------------------
    def take_optional(self, nbytes: int, what: str, within_slack: bool) -> AlignedBuffer | None:
        """A pool buffer of ``nbytes`` (aligned) counted as work ahead of need, or ``None`` (no room in the
        slack, if ``within_slack``, or in the pool). Its holder gives it back with :meth:`give_back`.

        The slack is counted against the minimum, but the must-run work can hold more for a moment: a
        step's buffers stay in use until their write-behind lands. So a request the slack allows waits
        for those (up to :data:`WRITE_BEHIND_WAIT_S`) rather than being refused by the timing of a
        write; it is taken from the slack first, so nothing else claims the room meanwhile."""
        with self._lock:
            if within_slack and not self._slack_allows(nbytes):
                return None
            self._optional_bytes += nbytes
        buf = None
        try:
            buf = self.pool.acquire(nbytes, block=False, what=what, returning_wait_s=WRITE_BEHIND_WAIT_S)
        finally:
            with self._lock:
                self._optional_bytes += (buf.nbytes if buf is not None else 0) - nbytes
        return buf

    def adopt_optional(self, nbytes: int) -> bool:
        """Count ``nbytes`` already held as work ahead of need, the slack permitting (False: no room)."""
        with self._lock:
            if not self._slack_allows(nbytes):
                return False
            self._optional_bytes += nbytes
        return True

    def give_back(self, nbytes: int) -> None:
        """Work ahead of need of ``nbytes`` was taken over or given back (any thread)."""
        with self._lock:
            self._optional_bytes -= nbytes

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


class StagingArena:
    """Stages units' regions of each kind in and out of their tiers as :class:`Staged` handles, through
    the pool under its budget: ``regions`` (:class:`RegionMap`), ``slots`` (:class:`SlotMap`) and ``budget``
    (:class:`PoolBudget`, which holds the pool), each documenting who writes and reads it. Any thread
    stages (each handle then belongs to the caller): the regions order their own transfers, the pool and
    the budget lock themselves."""

    def __init__(self, state: StateLayout, config: OffloadConfig, stats: IOStats, lag: int, slots: int = 1,
                 copies: DeviceCopies | None = None, others_active: Callable[[], bool] | None = None,
                 gradients_from: list[int] | None = None, double_buffered: bool = False) -> None:
        """``copies``: the device tier (a GPU, or the simulated device), where units placed on ``device``
        keep their regions (:class:`DeviceRegions`); None: the CPU computes, ``device`` is host RAM.
        ``others_active``: whether another thread (the optimizer lane) holds buffers it will give back
        (see :class:`BufferPool`); ``gradients_from``: see :class:`RegionMap`; ``double_buffered``: see
        :class:`PoolBudget`."""
        pinner = (copies.pin, copies.unpin) if copies is not None else None
        self.state = state
        self.stats = stats
        self.slots = SlotMap(state.num_units, slots)
        self.regions = RegionMap(state, config, stats, slots, copies, pinner, gradients_from)
        self.budget = PoolBudget(state, config, lag, copies is not None, pinner, others_active, double_buffered)

    def flush(self) -> None:
        """Wait for every transfer in flight on the regions (raises the first I/O error; training thread)."""
        self.regions.wait_all()
        self.budget.pool.wait_returned()  # (buffers given back by those transfers' callbacks: in the pool now)

    def close(self) -> None:
        """Close the regions (each waits for its transfers first) and the pool; buffers still held come
        back to a closed pool and are freed there (training thread)."""
        self.regions.close()
        self.budget.pool.close()

    def device_tensor(self, kind: TensorKind, u: int, dtype: torch.dtype) -> tuple[Tensor, Any]:
        """Unit ``u``'s device-resident region of ``kind`` (its current slot) as ``dtype``, and the latest
        copy into it (None: none), which the compute stream must wait for before reading it."""
        regions = self.regions.of(kind, u)
        assert isinstance(regions, DeviceRegions)
        index = self.slots.index(kind, u)
        return regions.tensor(index, dtype, self.state.units[u].numel), regions.last_write(index)

    def device_readers(self, kind: TensorKind, u: int, *, done: bool) -> None:
        """Unit ``u``'s device-resident regions of ``kind`` (every slot): the compute stream starts
        reading them (``done=False``, at acquisition), or every read of them is enqueued (``done=True``,
        before the unit's step is submitted; the event recorded now is what the step's H2D writes into
        them wait for). Training thread."""
        regions = self.regions.of(kind, u)
        assert isinstance(regions, DeviceRegions)
        indices = {self.slots.index(kind, u), self.slots.index(kind, u, next_slot=True)}
        regions.readers(indices, done)

    # -- staging (any thread; each handle then belongs to the caller) ---------------------------------
    def stage(self, kind: TensorKind, u: int, *, read: bool, label: str | None = None,
              ranges: list[tuple[int, int]] | None = None, wait: bool = True) -> Staged:
        """A handle on unit ``u``'s region of ``kind``: the region itself on the host tier; a pool buffer
        on the SSD tier, filled from the SSD when ``read`` (only ``ranges``, byte ranges of the region, if
        given; counted under ``label`` if given), and likewise on the device tier (a D2H copy).
        ``wait=False``: return with the reads in flight, for :meth:`await_reads` (so several regions load
        at once). On a failure the buffer is given back."""
        regions = self.regions.of(kind, u)
        what = f"unit {u} {kind.value}"
        if isinstance(regions, HostRegions):
            return Staged(regions.host_buffer(self.slots.index(kind, u)), None, what)
        held = self.acquire(self.state.region_bytes(kind, u), what)
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
        regions = self.regions.of(kind, u)
        if self.slots.count == 1 or kind not in SLOTTED or not isinstance(regions, HostRegions):
            return self.stage(kind, u, read=read, label=label, ranges=ranges, wait=wait)
        src = regions.host_buffer(self.slots.index(kind, u)).tensor
        dst = regions.host_buffer(self.slots.index(kind, u, next_slot=True))
        assert src is not None and dst.tensor is not None
        if read:
            for a, b in ranges if ranges is not None else [(0, self.state.region_bytes(kind, u))]:
                dst.tensor[a:b].copy_(src[a:b])
        return Staged(dst, None, f"unit {u} {kind.value} (next slot)")

    def acquire(self, nbytes: int, what: str) -> Staged:
        """A handle on a pool buffer of ``nbytes`` for must-run work (waits for write-behind if need be)."""
        buf = self.budget.pool.acquire(nbytes, what=what)
        assert buf is not None
        return Staged(buf, self.budget.pool, what)

    def read_into(self, kind: TensorKind, u: int, held: Staged, ranges: list[tuple[int, int]] | None = None,
                  label: str | None = None) -> None:
        """Submit reads of unit ``u``'s region (or its byte ``ranges``) into ``held``; they are ``held``'s."""
        regions = self.regions.of(kind, u)
        assert not isinstance(regions, HostRegions)
        index = self.slots.index(kind, u)
        for r in ranges if ranges is not None else [None]:  # type: ignore[list-item]
            held.track_read(regions.submit_read(index, held.buf, label, r))

    def await_reads(self, *helds: Staged | None, label: str = "optimizer") -> None:
        """Wait for the reads of ``helds``; if one failed, give every one of ``helds`` back (each waits
        for what is still in flight on it) and raise."""
        t0 = time.perf_counter()
        reading = any(held is not None and held.reads_pending for held in helds)
        try:
            for held in helds:
                if held is not None:
                    held.wait_reads()
        except BaseException:
            for held in helds:
                if held is not None:
                    held.release()
            raise
        if reading and threading.current_thread() is threading.main_thread():  # (a synchronous step's)
            self.stats.record_wait(label, "ssd", time.perf_counter() - t0)
        elif reading:  # an optimizer job waiting: its lane's time, apart from its CPU
            self.stats.lanes.add("optimizer_wait", t0, time.perf_counter(), label)

    def put_back(self, kind: TensorKind, u: int, held: Staged, ranges: list[tuple[int, int]] | None = None, *,
                 release: bool = True, label: str | None = None, next_slot: bool = False,
                 placing: bool = False) -> None:
        """Write ``held`` (or its byte ``ranges``) to unit ``u``'s region of ``kind`` (write-behind) and,
        with ``release``, give it back (the buffer returns once written). Host-tier regions were changed
        in place: nothing to write. ``next_slot``: a speculative step's write, to the slot not in use;
        ``placing``: the write places the unit's values (initialization, a checkpoint's load), not
        training's (the I/O counters keep its frozen bytes apart)."""
        if held.pooled:
            # a device copy still filling the buffer (a gradient coming back) must land before the
            # write reads it
            held.wait_reads()
            regions = self.regions.of(kind, u)
            assert not isinstance(regions, HostRegions)
            index = self.slots.index(kind, u, next_slot)
            for r in ranges if ranges is not None else [None]:  # type: ignore[list-item]
                held.track_write(regions.submit_write(index, held.buf, label, r, placing=placing))
        if release:
            held.release()

    # -- work ahead of need (counted by the budget) -----------------------------------------------------
    def acquire_optional(self, nbytes: int, what: str, within_slack: bool = True) -> Staged | None:
        """A handle for work ahead of need, or ``None``. It counts against the slack until the work it
        was read for takes it over (:meth:`Staged.take_over`) or it is released. ``within_slack=False``:
        the caller made sure otherwise (:meth:`PoolBudget.read_ahead_fits`)."""
        buf = self.budget.take_optional(align_up(nbytes), what, within_slack)
        return None if buf is None else Staged(buf, self.budget.pool, what, slack=self.budget.give_back)

    def adopt_optional(self, held: Staged) -> bool:
        """Make an owned handle count as work ahead of need (the slack permitting): unit 0's new weights
        kept for the next forward. False: no room; the caller keeps it."""
        if not self.budget.adopt_optional(held.buf.nbytes):
            return False
        held.count_as_slack(self.budget.give_back)
        return True
