"""Where every kind's per-unit regions live: each unit's tier, the offload directory its SSD region is
striped to, the files and the bytes each tier keeps (:class:`RegionMap`); and, with speculative steps,
which of a unit's two slots holds its current values (:class:`SlotMap`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from lightning_greedysnake.config import REGION_KINDS, OffloadConfig, TensorKind, Tier
from lightning_greedysnake.io import IOEngine, OffloadFile, align_up
from lightning_greedysnake.layout import StateLayout, unit_tiers
from lightning_greedysnake.offload.device import DeviceCopies
from lightning_greedysnake.offload.device_regions import DeviceRegions
from lightning_greedysnake.offload.stats import IOStats
from lightning_greedysnake.offload.tiers import HostRegions, SSDRegions

FILE_NAMES = {kind: f"{kind.value}.bin" for kind in TensorKind}
"""Each kind's file in an offload directory."""
SLOTTED = (TensorKind.WEIGHTS, TensorKind.MASTER_WEIGHTS, TensorKind.OPTIMIZER_STATES)
"""The kinds a step rewrites: with two slots (speculative steps) each unit has two regions of each."""


def placement_of(state: StateLayout, config: OffloadConfig, device_tier: bool = False) -> dict[TensorKind, list[Tier]]:
    """Every region kind's tier per unit (a split kind's first units in RAM; see ``Split``). Without a
    device tier (``device_tier``: a GPU, or the simulated device) the compute device's memory is host
    RAM: a unit placed on ``device`` is a host-tier unit."""
    def resolved(tier: Tier) -> Tier:
        return Tier.HOST if tier is Tier.DEVICE and not device_tier else tier

    return {kind: [resolved(t) for t in unit_tiers(state.all_region_bytes(kind), config.tier(kind))]
            for kind in REGION_KINDS}


class SlotMap:
    """Which slot holds each unit's current values of each :data:`SLOTTED` kind."""

    def __init__(self, num_units: int, count: int) -> None:
        self.num_units = num_units
        self.count = count
        """2: speculative steps (fp16 loss scaling) keep two regions per unit of each :data:`SLOTTED` kind,
        so a step can be undone: it writes the slot not in use and flips to it once complete."""
        self._slot: dict[TensorKind, list[int]] = {kind: [0] * num_units for kind in SLOTTED}
        """Per kind, which slot holds each unit's current values. Read by every thread that stages the unit;
        flipped by the thread that completes the unit's step, before it publishes the update (whoever
        reads the unit next waits for that publication), and flipped back by a rollback (training thread,
        the lane drained)."""

    def index(self, kind: TensorKind, u: int, next_slot: bool = False) -> int:
        """The region of unit ``u`` holding its current values of ``kind`` (``next_slot``: the other one)."""
        if self.count == 1 or kind not in SLOTTED:
            return u
        return u + (self._slot[kind][u] ^ int(next_slot)) * self.num_units

    def flip(self, u: int) -> None:
        """Unit ``u``'s step is complete (written to the other slots): they become its current values."""
        if self.count > 1:
            for kind in SLOTTED:
                self._slot[kind][u] ^= 1

    def of(self, u: int) -> tuple[int, ...]:
        return tuple(self._slot[kind][u] for kind in SLOTTED)

    def restore(self, u: int, slots: tuple[int, ...]) -> None:
        """Roll back: unit ``u``'s current values are where they were (training thread, nothing in flight
        writing them)."""
        for kind, slot in zip(SLOTTED, slots, strict=True):
            self._slot[kind][u] = slot


class RegionPlacement(Protocol):
    """Where each kind's regions of each unit live and their sizes, as placed (read-only: what reports
    and plans read of a :class:`RegionMap`)."""

    state: StateLayout
    unit_tiers: dict[TensorKind, list[Tier]]

    def ssd_bytes(self, directory: int | None = None) -> dict[str, int]: ...

    def host_bytes(self) -> int: ...

    def host_unit_bytes(self, u: int, kinds: tuple[TensorKind, ...] = REGION_KINDS) -> int: ...


class RegionMap:
    """Every kind's per-unit regions (host buffers, device memory, or an SSD file per offload directory).
    Striped and opened by the training thread before training, read by every thread that stages; the
    regions order their own transfers."""

    def __init__(self, state: StateLayout, config: OffloadConfig, stats: IOStats, slots: int,
                 copies: DeviceCopies | None,
                 pinner: tuple[Callable[[int, int], None], Callable[[int], None]] | None,
                 gradients_from: list[int] | None = None) -> None:
        """``slots``: regions per unit of each :data:`SLOTTED` kind (the :class:`SlotMap`'s count);
        ``copies``: the device tier, where units placed on ``device`` keep their regions (None: the CPU
        computes, ``device`` is host RAM); ``pinner``: its page-locking of the host regions it copies from;
        ``gradients_from``: per unit, the first element its gradient region on SSD is ever written from
        (only deferred parts wait there), None: any of it. The file is then sparse, and preflight counts
        only what can be written (a whole gradient spilled anyway would allocate the rest as it writes)."""
        self.state = state
        self.gradients_from = gradients_from
        self.stats = stats
        self.slots = slots
        self.copies = copies
        self.pinner = pinner
        self.unit_tiers = placement_of(state, config, copies is not None)
        """Per region kind, each unit's tier (whole kinds: the same for every unit)."""
        self._host: dict[TensorKind, HostRegions] = {}
        self._device: dict[TensorKind, DeviceRegions] = {}
        self._ssd: dict[TensorKind, dict[int, SSDRegions]] = {}
        """Per kind, per offload directory (index), the SSD regions of the units striped there."""
        self.num_dirs = max(1, len(config.paths or ()))
        self._directory = self._stripe(self.num_dirs)
        """Per kind, each unit's offload directory (index): striped over the configuration's directories."""
        self.files: list[Path] = []

    def open(self, offload_dirs: list[Path], engines: list[IOEngine]) -> None:
        """Create the host regions and the preallocated offload files (after preflight). A split kind has
        both: its host units' regions in RAM, its SSD units' in files. With several directories (one
        per SSD, each with its engine) a kind's SSD units are striped over them unit by unit: the i-th
        SSD unit in directory ``i % len(offload_dirs)``, one file of the kind in each."""
        assert not offload_dirs or len(offload_dirs) == self.num_dirs, "opened in the directories it was striped over"
        n = self.state.num_units
        try:
            for kind in REGION_KINDS:
                copies = self._slots(kind)  # (slot s of unit u: region u + s * n)
                sizes, tiers = self.state.all_region_bytes(kind), self.unit_tiers[kind]
                # the weights' frozen parameters (past each unit's trained prefix): their I/O is counted apart
                read_only_from = ([self.state.written_weight_bytes(u % n) for u in range(n * copies)]
                                  if kind is TensorKind.WEIGHTS else None)
                in_ram, on_device = ([size if t is tier else 0 for size, t in zip(sizes, tiers, strict=True)] * copies
                                     for tier in (Tier.HOST, Tier.DEVICE))
                for d, directory in enumerate(offload_dirs):
                    here = [size if self._directory[kind][u % n] == d else 0
                            for u, size in enumerate(sizes * copies)]
                    if sum(here):
                        path = directory / FILE_NAMES[kind]
                        self.files.append(path)
                        sparse = self.state.sharded(kind) or (kind is TensorKind.GRADIENTS
                                                              and self.gradients_from is not None)
                        self._ssd.setdefault(kind, {})[d] = SSDRegions(kind.value, here, engines[d], path, self.stats,
                                                                       sparse=sparse, read_only_from=read_only_from)
                if sum(in_ram):
                    # only weights and gradients are copied to and from the device straight out of
                    # their host regions: only they are page-locked (the optimizer's stay pageable)
                    pinner = self.pinner if kind in (TensorKind.WEIGHTS, TensorKind.GRADIENTS) else None
                    self._host[kind] = HostRegions(kind.value, in_ram, pinner)
                if sum(on_device):
                    assert self.copies is not None  # (without a device tier, placement_of made them host)
                    self._device[kind] = DeviceRegions(kind.value, on_device, self.copies)
        except BaseException:
            self.close()
            raise

    def _stripe(self, num_dirs: int) -> dict[TensorKind, list[int | None]]:
        """Every kind's SSD units striped over ``num_dirs`` offload directories (the configuration's):
        each unit's directory (index), None off SSD."""
        out = {}
        for kind, tiers in self.unit_tiers.items():
            on_ssd = [u for u, t in enumerate(tiers) if t is Tier.SSD and self.state.region_bytes(kind, u)]
            where: list[int | None] = [None] * len(tiers)
            for i, u in enumerate(on_ssd):
                where[u] = i % num_dirs
            out[kind] = where
        return out

    def wait_all(self) -> None:
        """Wait for every transfer in flight on the regions (raises the first I/O error)."""
        for regions in [*self._all_ssd(), *self._device.values()]:
            regions.wait_all()

    def close(self) -> None:
        """Close the regions (each waits for its transfers first)."""
        for regions in [*self._all_ssd(), *self._host.values(), *self._device.values()]:
            regions.close()
        self._ssd.clear()
        self._host.clear()
        self._device.clear()

    def of(self, kind: TensorKind, u: int) -> HostRegions | SSDRegions | DeviceRegions:
        """The regions that hold unit ``u``'s region of ``kind``."""
        d = self._directory[kind][u]
        if d is not None and self.on_ssd(kind, u):
            return self._ssd[kind][d]
        return self._device[kind] if self.on_device(kind, u) else self._host[kind]

    def on_ssd(self, kind: TensorKind, u: int) -> bool:
        """Whether unit ``u``'s region of ``kind`` lives on SSD (staged through the pool)."""
        return self.unit_tiers[kind][u] is Tier.SSD and kind in self._ssd

    def on_device(self, kind: TensorKind, u: int) -> bool:
        """Whether unit ``u``'s region of ``kind`` is resident in device memory (:class:`DeviceRegions`)."""
        return self.unit_tiers[kind][u] is Tier.DEVICE and kind in self._device

    # -- sizes ---------------------------------------------------------------------------------------
    def ssd_bytes(self, directory: int | None = None) -> dict[str, int]:
        """Bytes each SSD-resident kind keeps in offload directory ``directory`` (None: in all of them),
        for preflight."""
        kept = {kind.value: sum(self._written_bytes(kind, u) for u, d in enumerate(self._directory[kind])
                                if d is not None and (directory is None or d == directory))
                * self._slots(kind) for kind in REGION_KINDS}
        return {kind: n for kind, n in kept.items() if n}

    def _written_bytes(self, kind: TensorKind, u: int) -> int:
        """Bytes of unit ``u``'s SSD region of ``kind`` that can be written (see ``gradients_from``)."""
        if kind is not TensorKind.GRADIENTS or self.gradients_from is None:
            return self.state.kept_unit_bytes(kind, u)
        lo, hi = self.gradients_from[u], self.state.units[u].trained_numel
        return sum(b - a for a, b in self.state.byte_ranges(kind, u, lo, hi)) if lo < hi else 0

    def host_bytes(self) -> int:
        """RAM the host-tier regions take (every slot; this rank's chunk of partitioned kinds)."""
        return sum(self.host_unit_bytes(u) for u in range(self.state.num_units))

    def host_unit_bytes(self, u: int, kinds: tuple[TensorKind, ...] = REGION_KINDS) -> int:
        """RAM unit ``u``'s host-tier regions of ``kinds`` take (every slot; this rank's chunk of
        partitioned kinds)."""
        return sum(self.state.kept_unit_bytes(kind, u) * self._slots(kind)
                   for kind in kinds if self.unit_tiers[kind][u] is Tier.HOST)

    def staged_unit_bytes(self, u: int) -> int:
        """Pool bytes reading all of unit ``u``'s weights, master weights and optimizer state out of
        their tiers takes at most (those off the host tier staged; as placed, before :meth:`open` too)."""
        return sum(align_up(self.state.region_bytes(kind, u)) for kind in SLOTTED
                   if self.unit_tiers[kind][u] is not Tier.HOST and self.state.region_bytes(kind, u))

    def release_host(self, u: int, kinds: tuple[TensorKind, ...] = REGION_KINDS) -> None:
        """Free unit ``u``'s host-tier regions of ``kinds`` (every slot): the end of a run, once they came
        back (nothing reads them again; the other regions stay)."""
        for kind, regions in self._host.items():
            for slot in range(self._slots(kind)) if kind in kinds else ():
                regions.release(u + slot * self.state.num_units)

    def ssd_region_bytes(self, kind: TensorKind, u: int) -> int:
        """Pool bytes reading unit ``u``'s region of ``kind`` ahead takes (0 where it is not on SSD)."""
        return align_up(self.state.region_bytes(kind, u)) if self.on_ssd(kind, u) else 0

    def staged_region_bytes(self, kind: TensorKind, u: int) -> int:
        """Pool bytes staging unit ``u``'s region of ``kind`` takes: on SSD, and on the device (a step's
        copy of it on the host); 0 on the host tier, which is used in place."""
        return align_up(self.state.region_bytes(kind, u)) if self.on_ssd(kind, u) or self.on_device(kind, u) else 0

    def _slots(self, kind: TensorKind) -> int:
        """Regions per unit of ``kind``."""
        return self.slots if kind in SLOTTED else 1

    def open_files(self) -> list[OffloadFile]:
        return [r.file for r in self._all_ssd()]

    def _all_ssd(self) -> list[SSDRegions]:
        return [r for per_dir in self._ssd.values() for r in per_dir.values()]
