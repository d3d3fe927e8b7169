"""Weights residency: which units' compute weights are in memory, bound to the user's parameters.

The parameters stay the user's ``nn.Parameter`` objects (the optimizer and LR schedulers keep pointing
at them). Between uses their ``data`` is a one-element NaN placeholder expanded to the right shape
(``numel`` and shapes answer correctly; any accidental compute on it is visibly NaN); :meth:`acquire`
binds them to views of the unit's staged compute weights.

Threads. The training thread acquires, releases and prefetches. The optimizer lane touches this object
in one place only: after unit 0's step it may keep the unit's new weights as the prefetch of its next
acquisition (:meth:`keep_as_prefetch`), before publishing the unit in the :class:`UpdateGate`; the
training thread reads the prefetch table for a unit only once the gate shows the unit current, and
``_lock`` guards the table itself.

Device tier (``copies``: a GPU, or the simulated device). The staged host weights stay the unit's host
handle exactly as above (the step job still takes it over); the compute weights the parameters are
bound to are a device copy of them, made on the H2D stream (:meth:`acquire`) or ahead of need
(:meth:`prefetch`, once the host bytes are in), into new memory of the H2D stream's, so the copy waits
for none of the ops queued on the compute stream (see :mod:`~lightning_greedysnake.offload.device`). The
host handle tracks that copy, so it is changed or given back only once the copy is done; the compute
stream waits for the copy's event before the unit's first op, and the memory goes back to the allocator
after the compute stream's uses (recorded on it); ``_device_prefetch`` belongs to the training thread.

Device-resident weights (``offload.weights='device'`` on a device tier): the unit's compute weights
live in device memory for the whole run (:class:`~lightning_greedysnake.offload.device_regions.
DeviceRegions`); acquiring binds the parameters to them once the gate shows the unit current and the
compute stream waits for the step's last H2D copy into them. Nothing is staged, prefetched or donated:
the step stages its own copy on the host. The hand-over the other way: before the unit's step is
submitted (:meth:`drop_prefetch`) the training thread records an event on the compute stream after its
last read of them, which the step's H2D writes wait for (and nothing queued after it); acquiring the unit
again forgets that event (compute reads them again).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
from torch import Tensor, nn

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.layout import ParamSlot, StateLayout
from lightning_greedysnake.offload.device import Copy, DeviceCopies
from lightning_greedysnake.offload.staging import Staged, StagingArena


def slot_view(flat: Tensor, slot: ParamSlot) -> Tensor:
    """The parameter ``slot`` inside a unit's flat buffer, in its own shape (a read-only one kept in its own
    dtype: its bytes there, viewed as that dtype)."""
    if slot.storage is None:
        return flat[slot.offset_numel : slot.offset_numel + slot.numel].view(slot.shape)
    own = flat[slot.offset_numel : slot.offset_numel + slot.span_numel].view(getattr(torch, slot.storage[0]))
    return own[: slot.numel].view(slot.shape)


class UpdateGate:
    """Per unit: whether its weights on their tier are current (no optimizer step of it in flight).

    The training thread clears a unit's event when it submits a step of it; whoever runs the step's
    last part (the lane, or the training thread itself when ``lag=0``) sets it after the new weights
    were handed to their tier. Every reader of a unit's weights waits for the event: it is the
    hand-over from the lane to the training thread."""

    def __init__(self, num_units: int) -> None:
        self._events = [threading.Event() for _ in range(num_units)]
        for event in self._events:
            event.set()

    def begin(self, unit: int) -> None:
        """A step of ``unit`` was submitted (training thread)."""
        self._events[unit].clear()

    def publish(self, unit: int) -> None:
        """``unit``'s step is complete: its weights may be read (the thread that ran it)."""
        self._events[unit].set()

    def is_current(self, unit: int) -> bool:
        return self._events[unit].is_set()

    def event(self, unit: int) -> threading.Event:
        return self._events[unit]


class WeightsResidency:
    def __init__(self, arena: StagingArena, state: StateLayout, params: list[list[nn.Parameter]],
                 compute_dtype: torch.dtype, gate: UpdateGate,
                 wait_for: Callable[[threading.Event], None], copies: DeviceCopies | None = None) -> None:
        """``wait_for(event)`` blocks until a unit's step completed (the lane's wait: it raises the lane's
        error instead of hanging when a step failed). ``copies``: the device tier, if any."""
        self._copies = copies
        self._device_prefetch: dict[int, tuple[Tensor, Copy]] = {}
        """Device copies started ahead of acquisition, each from the host handle in ``_prefetched`` (which
        tracks the copy) (training thread only)."""
        self._arena = arena
        self._state = state
        self.params = params
        self.compute_dtype = compute_dtype
        self.gate = gate
        self._wait_for = wait_for
        self.dtypes = [[p.dtype for p in ps] for ps in params]
        """The parameters' own dtypes, given back at :meth:`restore`."""
        self._placeholders = [
            [torch.full((1,), math.nan, dtype=compute_dtype).expand(p.shape) for p in ps] for ps in params
        ]
        units_of: dict[int, list[int]] = {}
        for u, ps in enumerate(params):
            for p in ps:
                units_of.setdefault(id(p), []).append(u)
        self._shared_bound: dict[int, dict[int, Tensor]] = {i: {} for i, us in units_of.items() if len(us) > 1}
        """A read-only parameter several units use (a frozen embedding tied to the head): each of those units
        lays out a copy of it, and the units holding it now with their views (training thread only). It stays
        bound while any of them holds it: the copies are equal, none is ever written."""
        self.weight_loads: dict[int, int] = {u: 0 for u in range(len(params))}
        """Times each unit's compute weights were acquired, since construction."""
        self.prefetches_refused = 0
        """Weights prefetches of SSD units the budget's slack had no room for, since construction
        (training thread only): with the automatic budget, which holds room for ``prefetch_units`` of
        them, none should be."""
        self._held: dict[int, Staged | None] = {}
        """Units in use by the training thread, with their staged weights (None: device-resident)
        (training thread only)."""
        self._donated: set[int] = set()
        """Held units whose handle a step job took over: the job gives it back (training thread only)."""
        self._prefetched: dict[int, Staged] = {}
        """Weights read ahead of their acquisition (guarded by ``_lock``; see the module's docstring)."""
        self._lock = threading.Lock()

    # -- the training thread ---------------------------------------------------------------------------
    def acquire(self, unit: int) -> None:
        assert unit not in self._held, f"unit {unit} acquired twice"
        # the unit's last optimizer step (perhaps in the background, perhaps its deferred alpha part)
        # must be complete: no forward ever reads a stale or half-updated weight
        self._wait_for(self.gate.event(unit))
        self.weight_loads[unit] += 1
        if self._arena.regions.on_device(TensorKind.WEIGHTS, unit):
            assert self._copies is not None
            flat, last_write = self._arena.device_tensor(TensorKind.WEIGHTS, unit, self.compute_dtype)
            self._arena.device_readers(TensorKind.WEIGHTS, unit, done=False)  # compute reads them from now on
            if last_write is not None:
                self._copies.wait(last_write)  # hand-over: the step's H2D copy -> the compute stream
            self._held[unit] = None
            self.bind(unit, flat)
            return
        with self._lock:
            held = self._prefetched.pop(unit, None)
        on_device = self._device_prefetch.pop(unit, None)
        if held is not None:
            held.take_over()
            if held.reads_pending:  # (a host-tier region prefetched for its device copy has none)
                self._arena.await_reads(held, label=TensorKind.WEIGHTS.value)  # gives it back if the read failed
        else:
            held = self._arena.stage(TensorKind.WEIGHTS, unit, read=True)
        self._held[unit] = held
        if self._copies is None:
            self.bind(unit, held.view(self.compute_dtype, self._state.units[unit].numel))
            return
        flat, copy = on_device if on_device is not None else self._to_device(unit, held)
        self._copies.wait(copy)  # hand-over: the H2D stream -> the compute stream (the unit's first op)
        self.bind(unit, flat)

    def _to_device(self, unit: int, held: Staged) -> tuple[Tensor, Copy]:
        """Start copying ``held`` (unit ``unit``'s host compute weights, read in) to new device memory;
        ``held`` tracks the copy (its bytes must not change, nor it be given back, before it is done)."""
        assert self._copies is not None
        numel = self._state.units[unit].numel
        # new memory of the H2D stream's: a prefetch waits for none of the ops queued on the compute stream
        # (it overlaps them); the compute stream waits for the copy at acquisition
        flat, copy = self._copies.to_new_device(held.view(self.compute_dtype, numel))
        held.track_write(copy)
        return flat, copy

    def release(self, unit: int) -> None:
        held = self._held.pop(unit)
        # device memory goes back to the compute stream's allocator (with the parameters' views of it):
        # later work on it is stream-ordered
        self.unbind(unit)
        if unit in self._donated:
            self._donated.discard(unit)  # the step job owns the handle now and gives it back
        elif held is not None:
            held.release()

    def is_held(self, unit: int) -> bool:
        return unit in self._held

    def is_staged(self, unit: int) -> bool:
        """Held, prefetched or device-resident: acquiring it stages nothing more."""
        if self._arena.regions.on_device(TensorKind.WEIGHTS, unit):
            return True
        with self._lock:
            return unit in self._held or unit in self._prefetched

    def donate(self, unit: int) -> Staged | None:
        """Hand the held weights of ``unit`` to its step job (which gives them back); None if not held
        (or device-resident: the step stages its own).
        The unit stays bound until :meth:`release`: the job does not change them before it runs, and
        the training thread releases the unit before the job can (lag) or right after (synchronous)."""
        held = self._held.get(unit)
        if held is not None:
            self._donated.add(unit)
        return held

    def prefetch(self, unit: int) -> None:
        """Start reading ``unit``'s weights now if they live on SSD and the budget's slack allows; on a
        device tier, start their device copy once the host bytes are in (called again before every op,
        so the copy starts at the first op after the read landed)."""
        if unit in self._held or self._arena.regions.on_device(TensorKind.WEIGHTS, unit):
            return  # (device-resident weights are always in place)
        if not self.gate.is_current(unit):
            return  # its step is still running: the weights on their tier are about to change
        with self._lock:
            held = self._prefetched.get(unit)
        if held is None:
            held = self._start_host_prefetch(unit)
        if held is None or self._copies is None or unit in self._device_prefetch or not held.reads_landed:
            return
        self._device_prefetch[unit] = self._to_device(unit, held)

    def _start_host_prefetch(self, unit: int) -> Staged | None:
        if not self._arena.regions.on_ssd(TensorKind.WEIGHTS, unit):
            if self._copies is None:
                return None  # host-tier weights are used in place
            held = self._arena.stage(TensorKind.WEIGHTS, unit, read=False)  # the region itself
        else:
            held = self._arena.acquire_optional(self._state.region_bytes(TensorKind.WEIGHTS, unit),
                                                f"unit {unit} weights prefetch")
            if held is None:
                self.prefetches_refused += 1
                return None
            try:
                self._arena.read_into(TensorKind.WEIGHTS, unit, held)
            except BaseException:
                held.release()
                raise
        with self._lock:
            self._prefetched[unit] = held
        return held

    def drop_prefetch(self, unit: int) -> None:
        """Forget ``unit``'s prefetch (its step is about to change the weights); the buffer comes back
        once the read is done. Device-resident weights: every compute read of them in this window is
        enqueued by now (training thread, before the step is submitted): the event recorded here is what
        the step's H2D writes into them wait for, not the compute stream's later work."""
        if self._arena.regions.on_device(TensorKind.WEIGHTS, unit):
            self._arena.device_readers(TensorKind.WEIGHTS, unit, done=True)
            return
        with self._lock:
            held = self._prefetched.pop(unit, None)
        self._device_prefetch.pop(unit, None)  # (its copy is tracked by ``held``)
        if held is not None:
            held.release()

    # -- the optimizer lane -----------------------------------------------------------------------------
    def keep_as_prefetch(self, unit: int, held: Staged) -> bool:
        """After ``unit``'s complete step: keep its new compute weights in memory as the prefetch of its
        next acquisition, if the slack allows; True when this object took the handle over. Worth it for
        unit 0 only: the last unit of every backward is the first of the next forward, which would
        otherwise wait for the write of these very bytes and read them back. Called before the unit is
        published, so the training thread does not look for it yet."""
        if not held.pooled:
            return False  # host-tier weights: nothing to read back anyway
        with self._lock:
            if unit in self._prefetched or not self._arena.adopt_optional(held):
                return False
            self._prefetched[unit] = held
        return True

    # -- parameters ---------------------------------------------------------------------------------------
    def bind(self, unit: int, flat: Tensor) -> None:
        """Point unit ``unit``'s parameters at views of ``flat`` (its flat compute weights)."""
        for p, slot in zip(self.params[unit], self._state.units[unit].params, strict=True):
            p.data = slot_view(flat, slot)
            bound = self._shared_bound.get(id(p))
            if bound is not None:
                bound[unit] = p.data

    def unbind(self, unit: int) -> None:
        for p, placeholder in zip(self.params[unit], self._placeholders[unit], strict=True):
            bound = self._shared_bound.get(id(p))
            if bound is not None:
                bound.pop(unit, None)
                if bound:  # another unit holds its copy still
                    p.data = next(iter(bound.values()))
                    continue
            p.data = placeholder

    @property
    def shares_parameters(self) -> bool:
        """Whether a read-only parameter is laid out by several units."""
        return bool(self._shared_bound)

    def materialize(self, unit: int) -> None:
        """Give ``unit``'s parameters real (uninitialized) memory in their own dtypes (meta models)."""
        for p, dtype in zip(self.params[unit], self.dtypes[unit], strict=True):
            p.data = torch.empty(p.shape, dtype=dtype)

    def restore(self, unit: int, values: list[Tensor]) -> None:
        """Give the parameters real memory again, holding ``values`` (the end of a run)."""
        for p, value, dtype in zip(self.params[unit], values, self.dtypes[unit], strict=True):
            p.data = value.to(dtype) if value.dtype != dtype else value

    def close(self) -> None:
        """Give back every held and prefetched buffer (teardown)."""
        for unit in list(self._held):
            self.release(unit)
        with self._lock:
            prefetched, self._prefetched = list(self._prefetched.values()), {}
        self._device_prefetch.clear()
        for held in prefetched:
            held.release()
