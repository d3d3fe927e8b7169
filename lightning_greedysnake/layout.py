"""Flat per-unit layouts: where each parameter of a unit sits inside the unit's flat buffers, where each
unit's region sits inside a kind's offload file, and which bytes of a region an element range (a part of
a step, a rank's chunk) covers. Pure arithmetic, no torch state: placement is data. Every component of
the tensor manager and the per-unit stepper read their sizes here, so they agree by construction.

Every unit's region starts on a 4 KiB boundary and has a 4 KiB-multiple length, so one O_DIRECT request
moves a whole unit; inside a region each parameter starts on a 64-element boundary (cache lines for the
optimizer's vector kernels).

A unit's trained parameters (those its optimizer steps) come first, its read-only ones (frozen, or not in
the optimizer: a LoRA base) after them: the trained ones are a prefix of the unit's flat buffers
(:attr:`UnitLayout.trained_numel`), and only that prefix has master weights, gradients and optimizer
state, is stepped and is written back. A read-only parameter may keep its own dtype (a bf16 base beside
fp32 adapters): it then takes the compute elements its bytes need (:attr:`ParamSlot.storage`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from lightning_greedysnake.config import Split, TensorKind, Tier
from lightning_greedysnake.io import align_up

PARAM_ALIGN_NUMEL = 64


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its unit's flat buffers."""

    name: str
    shape: tuple[int, ...]
    offset_numel: int
    group: int | None
    """Index of the optimizer param group that trains it; ``None``: read-only (frozen, or not in the
    optimizer: no gradient room, no state, never stepped, never written back)."""
    storage: tuple[str, int] | None = None
    """A read-only parameter kept in its own dtype, not the unit's compute dtype: ``(dtype name, itemsize)``
    (``("bfloat16", 2)`` for a bf16 base under ``32-true``). Its elements start at byte ``offset_numel x``
    the compute itemsize of the weights. None: the compute dtype."""
    span_numel: int = -1
    """Compute-dtype elements the parameter occupies (its numel, or what its own dtype's bytes need)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class UnitLayout:
    unit: int
    params: tuple[ParamSlot, ...]
    numel: int
    """Elements of the unit's flat compute weights, padding included."""
    trained_numel: int
    """Elements of the trained prefix, padding included (every parameter the optimizer steps lies in
    ``[0, trained_numel)``): the length of the unit's master weights, gradients and each state slot, and
    the most of its weights a step writes. 0: nothing of the unit is trained."""

    def nbytes(self, itemsize: int) -> int:
        """Bytes of one weights region of this unit holding elements of ``itemsize`` bytes (4 KiB aligned)."""
        return align_up(max(self.numel, 1) * itemsize)

    def trained_nbytes(self, itemsize: int) -> int:
        """Bytes of one region of the trained prefix (master weights, gradients) of ``itemsize``-byte
        elements (4 KiB aligned; 0 where nothing is trained)."""
        return align_up(self.trained_numel * itemsize) if self.trained_numel else 0

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.group is not None)


SPLIT_ALIGN_NUMEL = 2048
"""Element ranges that split a unit (a step's backward and forward parts, a rank's chunk) start on a
multiple of this many elements, so their bytes start on a 4 KiB boundary in every dtype (2-byte compute
weights, 4-byte master weights and state)."""


def split_align_numel(state_codec: tuple[tuple[int, int], ...] = ()) -> int:
    """:attr:`StateLayout.split_align_numel` for state of ``state_codec``'s components."""
    return math.lcm(SPLIT_ALIGN_NUMEL, *(per * (4096 // math.gcd(4096, isz)) for per, isz in state_codec))


def build_unit_layout(unit: int, params: list[tuple], align: int = PARAM_ALIGN_NUMEL,
                      compute_itemsize: int = 4, prefix_align: int = SPLIT_ALIGN_NUMEL) -> UnitLayout:
    """Lay ``(name, shape, group)`` or ``(name, shape, group, storage)`` entries out one after another, each
    on an ``align``-element boundary (64; quantized optimizer state: a multiple of its block, so a
    parameter's blocks are the unit's). The trained entries (a group) must come before the read-only ones
    (None); the first read-only one starts on a ``prefix_align`` boundary (:func:`split_align_numel`: the
    trained prefix's bytes end on 4 KiB in every kind, so a step reads and writes it alone). A read-only
    entry's ``storage`` (:attr:`ParamSlot.storage`) takes the ``compute_itemsize``-byte elements its bytes
    need."""
    slots: list[ParamSlot] = []
    offset = trained = 0
    for name, shape, group, *rest in params:
        storage = rest[0] if rest else None
        if group is not None and slots and slots[-1].group is None:
            raise ValueError(f"unit {unit}: trained parameter {name!r} laid out after a read-only one")
        assert storage is None or group is None, f"{name}: only a read-only parameter keeps its own dtype"
        if group is None and trained and offset == trained:  # the first read-only one after the prefix
            offset = trained = align_up(trained, prefix_align)
        numel = math.prod(shape)
        span = numel if storage is None else -(-numel * storage[1] // compute_itemsize)
        slots.append(ParamSlot(name, tuple(shape), offset, group, storage, span))
        offset = align_up(offset + span, align)
        if group is not None:
            trained = offset
    return UnitLayout(unit, tuple(slots), offset, trained)


@dataclass(frozen=True)
class FileLayout:
    """Where each unit's region of one kind starts in that kind's file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return (self.offsets[-1] + self.sizes[-1]) if self.offsets else 0


def build_file_layout(region_bytes: list[int]) -> FileLayout:
    assert all(size % 4096 == 0 for size in region_bytes), region_bytes
    return FileLayout(tuple(itertools.accumulate(region_bytes[:-1], initial=0)) if region_bytes else (),
                      tuple(region_bytes))


def parameter_starts(layout: UnitLayout, lo: int, hi: int) -> list[int]:
    """The places ``[lo, hi)`` of a unit can be cut without cutting a parameter: its ends and every
    parameter's start inside it (a parameter's padding belongs to it)."""
    return [lo, *(s.offset_numel for s in layout.params if lo < s.offset_numel < hi), hi]


def _nearest_cut(cuts: list[int], target: float) -> int:
    return min(cuts, key=lambda c: (abs(c - target), c))


def split_numel(layout: UnitLayout, alpha: float, bounds: tuple[int, int] | None = None,
                align: int = SPLIT_ALIGN_NUMEL, parameter_cuts: bool = False, min_piece_numel: int = 0) -> int:
    """First element of the forward (alpha) part of a unit's flat buffers: ``[lo, split)`` is stepped when
    the unit's gradient completes, ``[split, hi)`` is deferred into the next iteration's forward.
    ``bounds``: the element range this process steps (its shard; default the whole unit); ``align``: the
    split falls on a multiple of it (:attr:`StateLayout.split_align_numel`); ``parameter_cuts``: on the
    parameter start nearest the share instead (:attr:`StateLayout.parameter_cuts`; such a layout puts
    every parameter on ``align``); ``min_piece_numel``: an aligned cut leaving fewer of a parameter's
    elements on one side moves to the nearest aligned cut that does not (none: nothing is deferred)."""
    lo, hi = bounds if bounds is not None else (0, layout.trained_numel)
    if alpha <= 0.0:
        return hi
    if alpha >= 1.0:
        return lo
    if parameter_cuts:
        return _nearest_cut(parameter_starts(layout, lo, hi), lo + (hi - lo) * (1.0 - alpha))
    cut = lo + int((hi - lo) * (1.0 - alpha)) // align * align
    cut = min(max(cut, lo), hi)
    def whole_enough(c: int) -> bool:
        return all(not s.offset_numel < c < s.offset_numel + s.numel
                   or min(c - s.offset_numel, s.offset_numel + s.numel - c) >= min_piece_numel for s in layout.params)

    if min_piece_numel and lo < cut < hi and not whole_enough(cut):
        options = sorted(range(lo + align, hi, align), key=lambda c: (abs(c - cut), c))
        return next((c for c in options if whole_enough(c)), hi)
    return cut


def shard_bounds(layout: UnitLayout, rank: int, world: int, parameter_cuts: bool = False) -> tuple[int, int]:
    """The element range of a unit's trained prefix that ``rank`` of ``world`` steps: equal chunks on a
    ``SPLIT_ALIGN_NUMEL`` boundary (so every chunk's bytes start on 4 KiB), the last one shorter.
    ``parameter_cuts``: each chunk boundary on the parameter start nearest the equal share instead (a
    parameter is never cut, so chunks may differ in length and a rank's may be empty)."""
    n = layout.trained_numel
    if parameter_cuts:
        cuts = parameter_starts(layout, 0, n)
        return (_nearest_cut(cuts, rank * n / world), _nearest_cut(cuts, (rank + 1) * n / world))
    chunk = -(-n // world)
    chunk = -(-chunk // SPLIT_ALIGN_NUMEL) * SPLIT_ALIGN_NUMEL
    return min(n, rank * chunk), min(n, (rank + 1) * chunk)


@dataclass(frozen=True)
class StateLayout:
    """Every unit's regions of every kind: their sizes, and the bytes an element range covers in each.

    Compute weights hold ``compute_itemsize``-byte elements, every optimizer-state slot
    ``state_itemsize``-byte ones (4: fp32; 2: bf16 state); master weights and gradients are fp32. Master weights exist only under a 16-bit compute dtype
    (``separate_master``); a unit without trainable parameters has no master, state or gradient region."""

    units: tuple[UnitLayout, ...]
    compute_itemsize: int
    num_slots: int
    """Per-element optimizer state tensors per parameter (Adam: 2, SGD with momentum: 1)."""
    separate_master: bool
    shard: tuple[int, int] | None = None
    """``(rank, world)`` with partitioned state: this rank keeps and steps only its chunk of every unit."""
    state_itemsize: int = 4
    """Bytes per element of every optimizer-state slot (``offload.optimizer_state_dtype``)."""
    parameter_cuts: bool = False
    """The step's split and the ranks' chunks fall on parameter starts (each on a ``split_align_numel``
    boundary): the optimizer is stepped on whole parameters
    (:attr:`~lightning_greedysnake.optim.contract.OptimizerContract.whole_parameters`)."""
    min_piece_numel: int = 0
    """A split through a parameter leaves at least this many of its elements on either side
    (:attr:`~lightning_greedysnake.optim.contract.OptimizerContract.min_piece_numel`)."""
    state_codec: tuple[tuple[int, int], ...] = ()
    """Quantized state (a tensor subclass, :mod:`~lightning_greedysnake.optim.subclass_state`): per
    component, ``(elements per entry, bytes per entry)``; each slot holds every component's entries for
    the whole unit, one 4 KiB-aligned run after another. Empty: one run of ``state_itemsize`` bytes per
    element."""

    @property
    def _components(self) -> tuple[tuple[int, int], ...]:
        return self.state_codec or ((1, self.state_itemsize),)

    def _component_bytes(self, lay: UnitLayout, per: int, isz: int) -> int:
        return align_up(max(-(-lay.trained_numel // per), 1) * isz)

    def _slot_bytes(self, lay: UnitLayout) -> int:
        return sum(self._component_bytes(lay, per, isz) for per, isz in self._components)

    def component_offset_bytes(self, u: int, k: int, c: int) -> int:
        """Where component ``c`` of optimizer-state slot ``k`` starts in unit ``u``'s state region."""
        lay = self.units[u]
        return self.slot_offset_bytes(u, k) + sum(self._component_bytes(lay, per, isz)
                                                  for per, isz in self._components[:c])

    @property
    def split_align_numel(self) -> int:
        """Element ranges that split a unit start on a multiple of this: ``SPLIT_ALIGN_NUMEL``, or where
        quantized state has fewer bytes per element, enough elements that every component's bytes
        start on 4 KiB."""
        return split_align_numel(self.state_codec)

    @property
    def num_units(self) -> int:
        return len(self.units)

    def region_bytes(self, kind: TensorKind, u: int) -> int:
        lay = self.units[u]
        if kind is TensorKind.WEIGHTS:
            return lay.nbytes(self.compute_itemsize)
        if kind is TensorKind.MASTER_WEIGHTS:
            return lay.trained_nbytes(4) if self.separate_master else 0
        if kind is TensorKind.OPTIMIZER_STATES:
            return self._slot_bytes(lay) * self.num_slots if lay.trained_numel else 0
        if kind is TensorKind.GRADIENTS:
            return lay.trained_nbytes(4)
        raise ValueError(f"{kind} has no per-unit region")

    def all_region_bytes(self, kind: TensorKind) -> list[int]:
        return [self.region_bytes(kind, u) for u in range(self.num_units)]

    def byte_ranges(self, kind: TensorKind, u: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Byte ranges of elements ``[lo, hi)`` of unit ``u`` in ``kind``'s region (one per state slot and
        component); a range reaching the region's last element runs to its (aligned) end (the weights: the
        unit's; every other kind: the trained prefix's)."""
        lay = self.units[u]
        if kind is TensorKind.OPTIMIZER_STATES:
            out = []
            for k in range(self.num_slots):
                at = self.slot_offset_bytes(u, k)
                for per, isz in self._components:
                    size = self._component_bytes(lay, per, isz)
                    out.append((at + lo // per * isz,
                                at + (size if hi >= lay.trained_numel else -(-hi // per) * isz)))
                    at += size
            return out
        if kind is TensorKind.WEIGHTS:
            isz = self.compute_itemsize
            return [(lo * isz, lay.nbytes(isz) if hi >= lay.numel else hi * isz)]
        return [(lo * 4, lay.trained_nbytes(4) if hi >= lay.trained_numel else hi * 4)]

    def written_weight_bytes(self, u: int) -> int:
        """Bytes of unit ``u``'s weights region that its steps write (and re-read as master): the trained
        prefix, every rank's chunk together; the rest of the region (:meth:`read_only_weight_bytes`) is
        written once, when the unit's values are placed. 0: nothing of the unit is trained. The one
        place the planner, the reports and the I/O counters take this split from."""
        n = self.units[u].trained_numel
        return sum(b - a for a, b in self.byte_ranges(TensorKind.WEIGHTS, u, 0, n)) if n else 0

    def read_only_weight_bytes(self, u: int) -> int:
        """Bytes of unit ``u``'s weights region past its trained prefix (frozen parameters and their
        padding): read with the unit, never written by a step."""
        return self.region_bytes(TensorKind.WEIGHTS, u) - self.written_weight_bytes(u)

    def trained_weight_ranges(self, u: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Byte ranges of unit ``u``'s compute weights that a step of elements ``[lo, hi)`` changes: each
        run of consecutive trained parameters (the padding between them included), clipped to the range;
        a frozen parameter ends a run."""
        runs: list[tuple[int, int]] = []
        start = end = None
        for slot in self.units[u].params:
            a, b = max(lo, slot.offset_numel), min(hi, slot.offset_numel + slot.numel)
            if slot.group is None or a >= b:
                if slot.group is None and start is not None:
                    runs.append((start, end))
                    start = None
                continue
            start, end = (a, b) if start is None else (start, b)
        if start is not None:
            runs.append((start, end))
        isz = self.compute_itemsize
        return [(a * isz, b * isz) for a, b in runs]

    def slot_offset_bytes(self, u: int, k: int) -> int:
        """Where optimizer-state slot ``k`` starts in unit ``u``'s state region."""
        return k * self._slot_bytes(self.units[u])

    def bounds(self, u: int, rank: int | None = None) -> tuple[int, int]:
        """The element range of unit ``u`` that ``rank`` (default: this process) steps (within its trained
        prefix)."""
        if self.shard is None:
            return 0, self.units[u].trained_numel
        return shard_bounds(self.units[u], self.shard[0] if rank is None else rank, self.shard[1],
                            self.parameter_cuts)

    def split(self, u: int, alpha: float, bounds: tuple[int, int] | None = None) -> int:
        """Where a step of unit ``u``'s ``bounds`` (default this rank's) defers its last ``alpha`` share:
        :func:`split_numel` on this layout's alignment, on a parameter start with ``parameter_cuts``."""
        return split_numel(self.units[u], alpha, self.bounds(u) if bounds is None else bounds,
                           self.split_align_numel, self.parameter_cuts, self.min_piece_numel)

    def sharded(self, kind: TensorKind) -> bool:
        """Kinds of which this rank keeps only its chunks (partitioned state)."""
        return self.shard is not None and kind in (TensorKind.MASTER_WEIGHTS, TensorKind.OPTIMIZER_STATES)

    def chunk_ranges(self, kind: TensorKind, u: int) -> list[tuple[int, int]] | None:
        """Byte ranges of unit ``u``'s region that this rank writes (None: all of it)."""
        if not self.sharded(kind):
            return None
        lo, hi = self.bounds(u)
        return self.byte_ranges(kind, u, lo, hi) if lo < hi else []

    def kept_unit_bytes(self, kind: TensorKind, u: int) -> int:
        """Bytes of unit ``u``'s region of ``kind`` this rank keeps (partitioned state: its chunk only)."""
        if not self.sharded(kind):
            return self.region_bytes(kind, u)
        return sum(b - a for a, b in (self.chunk_ranges(kind, u) or []))


def empty_shares(region_bytes: list[int], placement: Tier | Split) -> list[tuple[Tier, float, float]]:
    """The tiers of a :class:`Split` that have a share but get no unit from :func:`unit_tiers` (the unit
    reaching the tier is larger than its share), each with its share and the share that unit needs: what
    the user asked for and does not get."""
    if not isinstance(placement, Split):
        return []
    order = ((Tier.DEVICE, placement.device), (Tier.HOST, placement.host), (Tier.SSD, placement.ssd))
    rank = {tier: i for i, (tier, _) in enumerate(order)}
    tiers = unit_tiers(region_bytes, placement)
    total = sum(region_bytes) or 1
    empty = []
    for tier, share in order:
        if share > 0 and tier not in tiers:
            # the first unit placed past this tier: the one that did not fit its share
            reaching = next((size for size, t in zip(region_bytes, tiers, strict=True) if rank[t] > rank[tier]), 0)
            empty.append((tier, share, reaching / total))
    return empty


def unit_tiers(region_bytes: list[int], placement: Tier | Split) -> list[Tier]:
    """Each unit's tier for one kind: its placement, or for a :class:`Split` a prefix of units per tier in
    the order device, host, SSD: units stay on a tier while their bytes fit its share of the kind's total;
    the first that does not moves on, and no later unit comes back (the last tier with a share takes the
    rest)."""
    if not isinstance(placement, Split):
        return [placement] * len(region_bytes)
    total = sum(region_bytes)
    order = [(tier, share) for tier, share in ((Tier.DEVICE, placement.device), (Tier.HOST, placement.host),
                                               (Tier.SSD, placement.ssd)) if share > 0]
    tiers, at, used = [], 0, 0
    for size in region_bytes:
        while at < len(order) - 1 and used + size > order[at][1] * total:
            at, used = at + 1, 0
        tiers.append(order[at][0])
        used += size
    return tiers
