"""Flat per-unit layouts: where each parameter of a unit sits inside the unit's flat buffers, and where
each unit's region sits inside a kind's offload file. Pure arithmetic, no torch state: placement is data.

Every unit's region starts on a 4 KiB boundary and has a 4 KiB-multiple length, so one O_DIRECT request
moves a whole unit; inside a region each parameter starts on a 64-element boundary (cache lines for the
optimizer's vector kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_greedysnake.io import align_up

PARAM_ALIGN_NUMEL = 64


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its unit's flat buffers."""

    name: str
    shape: tuple[int, ...]
    offset_numel: int
    group: int | None
    """Index of the optimizer param group that trains it; ``None``: frozen (no gradient, never stepped)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class UnitLayout:
    unit: int
    params: tuple[ParamSlot, ...]
    numel: int
    """Elements of the unit's flat buffer, padding included."""

    def nbytes(self, itemsize: int) -> int:
        """Bytes of one region of this unit holding elements of ``itemsize`` bytes (4 KiB aligned)."""
        return align_up(max(self.numel, 1) * itemsize)

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.params if p.group is not None)


def build_unit_layout(unit: int, params: list[tuple[str, tuple[int, ...], int | None]]) -> UnitLayout:
    """Lay ``(name, shape, group)`` entries out one after another, each on a 64-element boundary."""
    slots = []
    offset = 0
    for name, shape, group in params:
        slot = ParamSlot(name, tuple(shape), offset, group)
        slots.append(slot)
        offset = align_up(offset + slot.numel, PARAM_ALIGN_NUMEL)
    return UnitLayout(unit, tuple(slots), offset)


@dataclass(frozen=True)
class FileLayout:
    """Where each unit's region of one kind starts in that kind's file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return (self.offsets[-1] + self.sizes[-1]) if self.offsets else 0


def build_file_layout(region_bytes: list[int]) -> FileLayout:
    offsets = []
    offset = 0
    for size in region_bytes:
        assert size % 4096 == 0, size
        offsets.append(offset)
        offset += size
    return FileLayout(tuple(offsets), tuple(region_bytes))
