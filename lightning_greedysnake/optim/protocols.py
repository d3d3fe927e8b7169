"""What the per-unit stepper needs from the tensor manager, as Protocols: it stages buffers and publishes
new weights through these seams and imports nothing of ``offload``. (``offload.staging.StagingArena``
with its ``PoolBudget`` and ``offload.regions``' maps, ``offload.staging.Staged`` and
``offload.residency.UpdateGate`` implement them.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.layout import StateLayout


class StagedBuffer(Protocol):
    """One staging buffer and every transfer in flight on it; given back exactly once."""

    @property
    def pooled(self) -> bool: ...

    def view(self, dtype: torch.dtype, numel: int, offset_bytes: int = 0) -> Tensor: ...

    def take_over(self) -> None:
        """A buffer read ahead of need is now owned by the work it was read for."""

    def wait_reads(self) -> None:
        """Block until every transfer filling the buffer landed (a gradient's device-to-host copy)."""

    def wait_io(self) -> None:
        """Block until every transfer on the buffer completed (before changing its bytes)."""

    def release(self) -> None:
        """Give the buffer back once every transfer on it completed."""


class Regions(Protocol):
    """Where each unit's region of each kind lives, and what staging it takes."""

    def on_ssd(self, kind: TensorKind, u: int) -> bool: ...

    def on_device(self, kind: TensorKind, u: int) -> bool:
        """Resident in device memory (written with copies, no file)."""

    def ssd_region_bytes(self, kind: TensorKind, u: int) -> int:
        """Pool bytes reading the region ahead takes (0: not on SSD)."""

    def staged_region_bytes(self, kind: TensorKind, u: int) -> int:
        """Pool bytes staging the region takes (0: on the host tier, used in place)."""


class Slots(Protocol):
    """Which slot holds each unit's current values."""

    count: int
    """2 when steps are speculative: a step stages with :meth:`Staging.stage_update`, writes with
    ``put_back(..., next_slot=True)`` and completes with :meth:`flip`."""

    def flip(self, u: int) -> None: ...

    def of(self, u: int) -> tuple[int, ...]: ...

    def restore(self, u: int, slots: tuple[int, ...]) -> None: ...


class Budget(Protocol):
    """The staging budget's accounting of work ahead of need and of submitted steps."""

    def read_ahead_fits(self, nbytes: int, unit_need_bytes: int | None) -> bool:
        """Whether a read-ahead of ``nbytes`` may be taken (``unit_need_bytes`` None: only from the slack)."""

    def count_step_submitted(self, nbytes: int) -> None:
        """A submitted step will stage ``nbytes`` (training thread)."""

    def count_step_staged(self, nbytes: int) -> None:
        """That step has staged them (the thread that ran it)."""


class Staging(Protocol):
    """Stages units' regions of each kind in and out of their tiers, under the budget."""

    state: StateLayout

    @property
    def regions(self) -> Regions: ...

    @property
    def slots(self) -> Slots: ...

    @property
    def budget(self) -> Budget: ...

    def stage(self, kind: TensorKind, u: int, *, read: bool, label: str | None = None,
              ranges: list[tuple[int, int]] | None = None, wait: bool = True) -> StagedBuffer: ...

    def stage_update(self, kind: TensorKind, u: int, *, read: bool, label: str | None = None,
                     ranges: list[tuple[int, int]] | None = None, wait: bool = True) -> StagedBuffer: ...

    def read_into(self, kind: TensorKind, u: int, held: StagedBuffer, ranges: list[tuple[int, int]] | None = None,
                  label: str | None = None) -> None: ...

    def await_reads(self, *helds: StagedBuffer | None, label: str = "optimizer") -> None:
        """Wait for the reads into ``helds``; if one failed, give all of them back and raise."""

    def put_back(self, kind: TensorKind, u: int, held: StagedBuffer, ranges: list[tuple[int, int]] | None = None,
                 *, release: bool = True, label: str | None = None, next_slot: bool = False) -> None: ...

    def acquire_optional(self, nbytes: int, what: str, within_slack: bool = True) -> StagedBuffer | None: ...


class UpdateGate(Protocol):
    """Per unit: whether its weights on their tier are current (no step of it in flight)."""

    def begin(self, unit: int) -> None: ...

    def publish(self, unit: int) -> None: ...

    def is_current(self, unit: int) -> bool: ...


@dataclass(frozen=True)
class StepCollectives:
    """Data parallel's part in the steps (given at construction; None in one process). Both run on the
    optimizer lane, in unit order on every rank."""

    average_gradient: Callable[[Tensor], None]
    """Averages a unit's complete fp32 host gradient over the ranks, in place, before its step (not called
    when the device tier averaged it already)."""
    gather_weights: Callable[[Tensor, list[tuple[int, int]]], None]
    """Partitioned state: fills a unit's flat compute weights with every rank's chunk (given every rank's
    bounds), after this rank stepped its own."""
