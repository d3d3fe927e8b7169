"""Placing the kinds the user left unset between host memory and SSD, within a host budget. Pure
arithmetic over the tensor manager's region sizes and the roofline's traffic model (no torch).

Every byte of a kind kept in RAM saves the SSD traffic that byte causes each step: a unit's compute
weights are read twice (forward and the recomputing backward) and written once; master weights and
optimizer state are read and written once; a gradient region moves only what waits on it (the
deferred ``alpha`` range, every byte with norm clipping or the horizontal order). The plan keeps the
kinds in RAM in decreasing order of bytes saved per byte of RAM, each kind by whole units from the
first (the :class:`~lightning_greedysnake.config.Split` form: a prefix of units), until the next unit
no longer fits. Weights save the most per byte whatever the disk's read and write speeds (three
passes against two), so the order, and with it the plan, needs no bandwidth measurement; the
bandwidths (measured after the first step) only turn the bytes that remain into seconds.

On a GPU (``device_room``) the compute weights go first to device memory, by whole units from the
first, before any RAM is spent: a resident unit moves nothing over the disk nor over PCIe per use (only
each step's new weights, once), and takes no RAM. The units after them are placed as above.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from lightning_greedysnake.kinds import REGION_KIND_NAMES
from lightning_greedysnake.planner.roofline import ON_SSD, Traffic, UnitCost, traffic

KINDS = REGION_KIND_NAMES


@dataclass(frozen=True)
class KindPlacement:
    """One kind's plan: its first ``device_units`` units on the device (weights only), up to its first
    ``host_units`` in RAM after them, the rest on SSD."""

    host_units: int
    """Units off the SSD (on the device or in RAM), a prefix."""
    num_units: int
    host_bytes: int
    """RAM the kind's host units take (what the tensor manager keeps: every slot, this rank's chunk)."""
    total_bytes: int
    """RAM the whole kind would take."""
    planned: bool
    """False: the user's own setting, kept as given."""
    device_units: int = 0
    """Of ``host_units``, the first ones on the device."""
    device_bytes: int = 0
    """Device memory those units take."""


@dataclass(frozen=True)
class PlacementPlan:
    kinds: dict[str, KindPlacement]
    budget_bytes: int
    """The host budget, all of it."""
    reserved_bytes: int
    """What the budget keeps back for staging and saved activations."""
    traffic: Traffic
    """SSD bytes of a steady-state step with this placement."""
    all_ssd: Traffic
    """The same with every kind on SSD (ZeRO-Infinity's placement), for comparison."""
    device_room_bytes: int = 0
    """Device memory the plan could give the compute weights (0: no device tier, or not planned)."""
    units: list[UnitCost] = field(default_factory=list)
    """The units placed so (what the roofline scores the placement by)."""

    @property
    def host_bytes(self) -> int:
        """RAM the kinds kept in memory take, plus the reserve."""
        return self.reserved_bytes + sum(k.host_bytes for k in self.kinds.values())

    def table(self, notes: Mapping[str, str] | None = None) -> str:
        """The plan, a row per kind (``notes``: said instead of a kind's tier where it keeps no bytes there,
        and why: ``none: under 32-true the weights are the master copy``), then the budget and the traffic."""
        rows = []
        for name, k in self.kinds.items():
            if notes and name in notes:
                rows.append((f"{name}{'' if k.planned else ' (yours)'}", notes[name]))
                continue
            counts = {"device": k.device_units, "host": k.host_units - k.device_units,
                      "ssd": k.num_units - k.host_units}
            whole = [tier for tier, units in counts.items() if units == k.num_units]
            where = whole[0] if whole else ", ".join(f"{tier} {units}/{k.num_units} units"
                                                     for tier, units in counts.items() if units)
            on_device = f", {k.device_bytes:,} B on the device" if k.device_units else ""
            rows.append((f"{name}{'' if k.planned else ' (yours)'}", f"{where}, {k.host_bytes:,} B in RAM{on_device}"))
        moved = self.traffic.read_bytes + self.traffic.write_bytes
        before = self.all_ssd.read_bytes + self.all_ssd.write_bytes
        if self.device_room_bytes:
            rows.append(("device room for weights", f"{self.device_room_bytes:,}"))
        rows += [
            ("host budget (bytes)", f"{self.budget_bytes:,}"),
            ("  kept for staging etc.", f"{self.reserved_bytes:,}"),
            ("SSD bytes per step", f"{moved:,} (all on SSD: {before:,})"),
        ]
        return "\n".join(f"{name:<26}{value:>48}" for name, value in rows)


def host_units_within(sizes: list[int], room: int) -> int:
    """How many of the first units fit in ``room`` bytes (a prefix)."""
    used = n = 0
    for size in sizes:
        if used + size > room:
            break
        used, n = used + size, n + 1
    return n


def _placed(units: list[UnitCost], host_units: Mapping[str, int], device_units: Mapping[str, int]) -> list[UnitCost]:
    """``units`` with each kind's first ``host_units[kind]`` units off the SSD, the first
    ``device_units[kind]`` of them on the device."""
    return [replace(u, on_ssd=frozenset(kind for kind in ON_SSD if i >= host_units.get(kind, 0)),
                    on_device=frozenset(kind for kind in ON_SSD if i < device_units.get(kind, 0)))
            for i, u in enumerate(units)]


def plan_placement(units: list[UnitCost], kept: Mapping[str, list[int]], planned: Collection[str],
                   budget_bytes: int, reserved_bytes: int, schedule: str, k: int,
                   clip_norm: bool = False, device_room: int = 0) -> PlacementPlan:
    """Plan the ``planned`` kinds; the others stay where ``units`` hold them (the user's: a prefix of
    units off the SSD, the first of them on the device, where they take no RAM).

    ``units``: each unit's region sizes (as the traffic model takes them; times are not used);
    ``kept``: per kind, each unit's RAM in the host tier; ``reserved_bytes``: the part of ``budget_bytes``
    kept back for staging and saved activations; ``device_room``: device memory for planned compute
    weights (``kept["weights"]`` is also what a unit of them takes there)."""
    n = len(units)
    planned, given = [kind for kind in KINDS if kind in planned], [kind for kind in KINDS if kind not in planned]
    host_units = {kind: sum(kind not in u.on_ssd for u in units) if kind in given else 0 for kind in KINDS}
    device_units = {kind: sum(kind in u.on_device for u in units) if kind in given else 0 for kind in KINDS}
    kept = {kind: [0] * device_units[kind] + list(kept[kind][device_units[kind]:]) for kind in KINDS}
    if "weights" in planned and device_room > 0:
        device_units["weights"] = host_units["weights"] = host_units_within(kept["weights"], device_room)

    def ssd_bytes(placement: Mapping[str, int]) -> int:
        t = traffic(_placed(units, placement, {}), schedule, k, clip_norm=clip_norm)
        return t.read_bytes + t.write_bytes

    room = budget_bytes - reserved_bytes - sum(sum(kept[kind][:host_units[kind]]) for kind in given)

    def in_ram(kind: str) -> int:
        return sum(kept[kind][device_units[kind]:host_units[kind]])
    base = ssd_bytes(host_units)

    def saved_per_byte(kind: str) -> float:
        total = sum(kept[kind][device_units[kind]:])
        return (base - ssd_bytes({**host_units, kind: n})) / total if total else float("inf")

    density = {kind: saved_per_byte(kind) for kind in planned}  # (each against the same base)
    for kind in sorted(planned, key=density.__getitem__, reverse=True):
        if not sum(kept[kind][device_units[kind]:]):
            host_units[kind] = n  # nothing to keep (master weights under 32-true, all on the device): no file
            continue
        if density[kind] <= 0:
            continue  # moves nothing (gradients with nothing waiting): RAM is better left alone
        start = device_units[kind]
        host_units[kind] = start + host_units_within(kept[kind][start:], max(room, 0))
        room -= in_ram(kind)
    kinds = {kind: KindPlacement(host_units[kind], n, in_ram(kind), sum(kept[kind]), kind in planned,
                                 device_units[kind], sum(kept[kind][:device_units[kind]])) for kind in KINDS}
    placed = _placed(units, host_units, device_units)
    return PlacementPlan(kinds, budget_bytes, reserved_bytes, traffic(placed, schedule, k, clip_norm=clip_norm),
                         traffic(_placed(units, {}, {}), schedule, k, clip_norm=clip_norm),
                         device_room if "weights" in planned else 0, placed)
