"""One part (element range) of one unit's optimizer step, with its staging: read the range's master
weights and optimizer state (or take them from a read-ahead), step them with the unit's optimizer,
write them back, and refresh the compute weights.

Threads: :meth:`PartStepper.step_part` runs on whichever thread runs the step (the optimizer lane, or
the training thread with ``lag=0``). A read-ahead (:meth:`PartStepper.read_ahead`) is taken by the next
step of that unit and part. A backward part's (part 0) is started by the training thread before it submits
that step; a deferred part's (part 1) by the lane, for a job queued behind the one it is about to run (the
only thread that starts them, and the one that runs them: none starts while its part runs). The table
between them is guarded by ``_lock``, and the lane's queue orders the hand-over.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.errors import BufferBudgetError, ReadAheadGivenBackWarning
from lightning_greedysnake.io.heap import trim_heap
from lightning_greedysnake.optim.protocols import StagedBuffer, Staging
from lightning_greedysnake.optim.state_format import StateFormat, mix
from lightning_greedysnake.optim.unit_optimizer import UnitOptimizer


class PartStepper:
    def __init__(self, staging: Staging, unit_optimizers: list[UnitOptimizer | None], slots: tuple[str, ...],
                 compute_dtype: torch.dtype, state_format: StateFormat | None = None, trim: bool = True) -> None:
        """``unit_optimizers`` is the stepper's own list (re-split in place by a reconfiguration);
        ``state_format``: the dtype the state is kept in (default fp32); ``trim``: give the heap's free
        pages back to the OS after each part (:func:`~lightning_greedysnake.io.heap.trim_heap`); a part's
        first step, which creates the optimizer's state, gives them back either way."""
        self._staging = staging
        self._trim = trim
        self._format = state_format or StateFormat(torch.float32)
        self._state = staging.state
        self._unit_optimizers = unit_optimizers
        self._slots = slots
        self._compute_dtype = compute_dtype
        self._separate_master = self._state.separate_master
        self._ahead: dict[tuple[int, int], tuple[StagedBuffer | None, StagedBuffer | None]] = {}
        """Master weights and optimizer state read ahead for a unit's coming step, per (unit, part):
        (master, states), each None where not read ahead (guarded by ``_lock``). A part's byte ranges are
        its own: part 0's step leaves part 1's as the unit's last step wrote them, so part 1's may be read
        any time before its own step."""
        self._lock = threading.Lock()
        self.steps_read_ahead = 0
        """Steps (their first part) that found their master weights or state read ahead, since
        construction (written by the stepping thread; read after a drain)."""
        self.deferred_parts_read_ahead = 0
        """Likewise, deferred (alpha) parts."""
        self.read_ahead_by_unit: dict[int, int] = {}
        """Per unit, its steps (first parts) that found their reads done (likewise)."""
        self.read_aheads_given_back = 0
        """Read-aheads a step gave back for staging it must have (:class:`ReadAheadGivenBackWarning`;
        likewise)."""

    # -- read-ahead (training thread; the lane for part 1) ---------------------------------------------------
    def read_ahead(self, unit: int, unit_need_bytes: int, last: bool = True, part: int = 0) -> bool:
        """Read ``unit``'s master weights and optimizer state for its coming step of ``part`` (that part's
        range) where they live on SSD and the budget allows, all or nothing: half a read-ahead would
        still leave the step waiting for reads. The window's ``last`` step may also take what the
        minimum reserves but that moment cannot use (:meth:`Budget.read_ahead_fits`); any other only
        the slack over the minimum, so the steps queued before it always find their staging. Returns
        whether the reads are under way (or there are none to start); False where the budget refused them."""
        opt = self._unit_optimizers[unit]
        with self._lock:
            if opt is None or (unit, part) in self._ahead:
                return True
        if part >= len(opt.parts):
            return True
        lo, hi = opt.part_range(part)
        if lo >= hi or opt.parts[part].shadow is None:
            return True
        wanted: list[tuple[TensorKind, list[tuple[int, int]]]] = []
        if self._separate_master:
            wanted.append((TensorKind.MASTER_WEIGHTS, self._state.byte_ranges(TensorKind.MASTER_WEIGHTS, unit, lo, hi)))
        if self._slots and opt.part_initialized(part):
            wanted.append((TensorKind.OPTIMIZER_STATES,
                           self._state.byte_ranges(TensorKind.OPTIMIZER_STATES, unit, lo, hi)))
        wanted = [(kind, ranges) for kind, ranges in wanted if self._staging.regions.on_ssd(kind, unit)]
        if not wanted:
            return True
        total = sum(self._staging.regions.ssd_region_bytes(kind, unit) for kind, _ in wanted)
        if not self._staging.budget.read_ahead_fits(total, unit_need_bytes if last else None):
            return False
        staged: dict[TensorKind, StagedBuffer] = {}
        for kind, ranges in wanted:
            held = self._staging.acquire_optional(self._state.region_bytes(kind, unit),
                                                  f"unit {unit} {kind.value} read-ahead", within_slack=False)
            if held is None:
                for other in staged.values():
                    other.release()  # back once its read landed
                return False
            try:
                self._staging.read_into(kind, unit, held, ranges, label=kind.value)
            except BaseException:
                held.release()
                for other in staged.values():
                    other.release()
                raise
            staged[kind] = held
        with self._lock:
            self._ahead[(unit, part)] = (staged.get(TensorKind.MASTER_WEIGHTS),
                                         staged.get(TensorKind.OPTIMIZER_STATES))
        return True

    def has_read_ahead(self, unit: int, part: int = 0) -> bool:
        with self._lock:
            return (unit, part) in self._ahead

    def drop_read_ahead(self, unit: int) -> None:
        """Forget ``unit``'s read-aheads, every part's (what they read is about to change, or was read
        for another split)."""
        with self._lock:
            keys = [key for key in self._ahead if key[0] == unit]
            aheads = [self._ahead.pop(key) for key in keys]
        for ahead in aheads:
            for held in ahead:
                if held is not None:
                    held.release()

    def drop_all_read_aheads(self) -> None:
        with self._lock:
            units = {unit for unit, _ in self._ahead}
        for unit in units:
            self.drop_read_ahead(unit)

    def staging_bytes(self, unit: int, weights_held: bool) -> int:
        """Pool bytes a step of ``unit`` stages (its first part's buffers are whole regions), as
        :meth:`step_part` does: master weights (or the weights region as master under 32-true, when not
        held), optimizer state, and under a 16-bit compute dtype the compute weights when not held
        (device-resident ones included: the step casts them on the host on their way to the device)."""
        ssd = self._staging.regions.staged_region_bytes
        need = ssd(TensorKind.OPTIMIZER_STATES, unit) if self._slots else 0
        if self._separate_master:
            need += ssd(TensorKind.MASTER_WEIGHTS, unit) + (0 if weights_held else ssd(TensorKind.WEIGHTS, unit))
        elif not weights_held:
            need += ssd(TensorKind.WEIGHTS, unit)
        return need

    # -- stepping (the thread running the step) -------------------------------------------------------------
    def step_part(self, unit: int, part: int, grad: Tensor, weights_held: StagedBuffer | None,
                  hyper: list[dict[str, Any]], has_grad: list[bool],
                  reads_out: Callable[[], None] | None = None, grad_reads: StagedBuffer | None = None) -> None:
        """Step part ``part`` of ``unit``. ``grad``: the unit's flat fp32 gradient; ``weights_held``: its
        compute weights still in memory (the acquired buffer; its owner gives it back), if any;
        ``reads_out``: called once this part's reads are under way and its read-ahead taken over, before
        it waits for them (the lane starts the reads of the jobs queued behind it:
        :meth:`~lightning_greedysnake.optim.lane.StepLane.start_aheads`); ``grad_reads``: the handle ``grad``
        views, its read still in flight (a deferred part's gradient from its tier): awaited with this part's
        own reads, given back by its owner (the caller), whatever happens here."""
        opt = self._unit_optimizers[unit]
        assert opt is not None
        lo, hi = opt.part_range(part)
        if lo >= hi or opt.parts[part].shadow is None:
            return
        if self._staging.slots.count > 1 and weights_held is not None and not weights_held.pooled:
            weights_held = None  # host-tier weights: stepped in the other slot (its owner gives it back)
        stage = self._stage_must_run
        state = self._state
        lay = state.units[unit]
        w_ranges = state.byte_ranges(TensorKind.WEIGHTS, unit, lo, hi)
        with self._lock:
            ahead_master, ahead_states = self._ahead.pop((unit, part), (None, None))
        # the handles this part staged or took from the read-ahead: given back on every path
        owned = [held for held in (ahead_master, ahead_states) if held is not None]
        for held in owned:
            held.take_over()
        if owned and part:
            self.deferred_parts_read_ahead += 1
        elif owned:
            self.steps_read_ahead += 1
            self.read_ahead_by_unit[unit] = self.read_ahead_by_unit.get(unit, 0) + 1
        try:
            # every read this part needs goes out at once, then one wait
            if ahead_master is not None:
                master = ahead_master
            elif self._separate_master:
                master = stage(TensorKind.MASTER_WEIGHTS, unit, read=True, wait=False,
                               ranges=state.byte_ranges(TensorKind.MASTER_WEIGHTS, unit, lo, hi))
                owned.append(master)
            elif weights_held is not None:
                master = weights_held  # 32-true: the compute weights in memory are the master copy
            else:
                master = stage(TensorKind.WEIGHTS, unit, read=True, wait=False, ranges=w_ranges,
                               label=TensorKind.MASTER_WEIGHTS.value)
                owned.append(master)
            states = ahead_states
            if self._slots and states is None:
                states = stage(TensorKind.OPTIMIZER_STATES, unit, read=opt.part_initialized(part), wait=False,
                               ranges=state.byte_ranges(TensorKind.OPTIMIZER_STATES, unit, lo, hi))
                owned.append(states)
            compute, compute_ranges = None, w_ranges
            if self._separate_master:
                compute = weights_held
                if compute is None:
                    # device-resident weights with one slot: only the stepped parameters' bytes go back,
                    # so nothing is read first (a D2H copy would wait for the GPU's queue of compute)
                    write_only = (self._staging.slots.count == 1
                                  and self._staging.regions.on_device(TensorKind.WEIGHTS, unit))
                    if write_only:
                        compute_ranges = state.trained_weight_ranges(unit, lo, hi)
                    compute = stage(TensorKind.WEIGHTS, unit, read=not write_only, ranges=w_ranges, wait=False)
                    owned.append(compute)
            if reads_out is not None:
                reads_out()
        except BaseException:
            for held in owned:
                held.release()
            raise
        self._staging.await_reads(*owned)  # (all of them given back if a read failed)
        try:
            if grad_reads is not None:
                grad_reads.wait_reads()  # (issued before this part's: landed by now, as a rule)
            if weights_held is not None:
                weights_held.wait_io()  # changed in place below: its last write-behind must be done
            mflat = master.view(torch.float32, lay.trained_numel)
            access = self._format.open(states, state, unit, self._slots, lo, hi)
            created = opt.step(mflat, grad, access, has_grad, part, hyper)
            self._format.close(access, seed=mix(unit, opt.step_number(part)))
            del access
        except BaseException:
            for held in owned:
                held.release()
            raise
        self._write_back(unit, lo, hi, master, states, compute, weights_held, mflat, compute_ranges)
        if self._trim or created:
            # a first step's new state was allocated on this thread's heap, copied and freed: its pages go
            # back to the OS once, whatever ``trim`` says. Kept, they stay free memory of the lane thread's
            # own glibc arena, which the training thread's allocations never reuse
            trim_heap((hi - lo) * 4)

    def _stage_must_run(self, kind: TensorKind, unit: int, **kwargs: Any) -> StagedBuffer:
        """Stage what the step must have (a step writes the unit's next slot: the same one with one slot).
        Where the budget has no room and nothing but this thread's own going on would make it, the
        read-aheads of later steps (which only this step's end would use) go back first, their reads
        landed, and it asks again: a read-ahead never stops a step (:class:`ReadAheadGivenBackWarning`)."""
        while True:
            try:
                return self._staging.stage_update(kind, unit, **kwargs)
            except BufferBudgetError:
                with self._lock:
                    held = len(self._ahead)
                if not held:
                    raise
                self.drop_all_read_aheads()  # (each comes back to the pool once its read landed)
                self.read_aheads_given_back += held
                warnings.warn(
                    f"greedysnake: unit {unit}'s optimizer step found no staging room for {kind.value} and gave "
                    f"back {held} read-ahead(s) of later steps to go on (they are read again). The result is "
                    "unchanged; this is a bug in greedysnake's staging budget, please report it.",
                    ReadAheadGivenBackWarning, stacklevel=2)

    def _write_back(self, unit: int, lo: int, hi: int, master: StagedBuffer, states: StagedBuffer | None,
                    compute: StagedBuffer | None, weights_held: StagedBuffer | None, mflat: Tensor,
                    compute_ranges: list[tuple[int, int]]) -> None:
        """``compute_ranges``: the compute weights' byte ranges to write (16-bit compute dtype)."""
        state = self._state
        w_ranges = state.byte_ranges(TensorKind.WEIGHTS, unit, lo, hi)
        # every write goes to the unit's next slot, which the step's end flips to (with one slot: the only one)
        if states is not None:
            self._staging.put_back(TensorKind.OPTIMIZER_STATES, unit, states,
                                   state.byte_ranges(TensorKind.OPTIMIZER_STATES, unit, lo, hi), next_slot=True)
        if self._separate_master:
            assert compute is not None
            lay = state.units[unit]
            cflat = compute.view(self._compute_dtype, lay.numel)
            for slot in lay.params:
                a, b = max(lo, slot.offset_numel), min(hi, slot.offset_numel + slot.numel)
                if slot.group is not None and a < b:
                    cflat[a:b].copy_(mflat[a:b])
            # only now may the master buffer go back: once its write completes the pool can hand it to
            # the training thread (a gradient accumulator of the same size is zeroed at once), so reading
            # it for the cast after put_back raced with that (found by benchmarks/stress_bf16_lane.py)
            self._staging.put_back(TensorKind.MASTER_WEIGHTS, unit, master,
                                   state.byte_ranges(TensorKind.MASTER_WEIGHTS, unit, lo, hi), next_slot=True)
            self._staging.put_back(TensorKind.WEIGHTS, unit, compute, compute_ranges, release=weights_held is None,
                                   next_slot=True)
        else:
            # the updated fp32 weights are the new compute weights; an acquired buffer is given back by
            # its owner once this write is done
            self._staging.put_back(TensorKind.WEIGHTS, unit, master, w_ranges, release=weights_held is None,
                                   next_slot=True)
