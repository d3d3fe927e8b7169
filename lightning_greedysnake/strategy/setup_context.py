"""What setup reads once and what it plans, for the planner and the builders (never the strategy
itself): :class:`SetupContext` (the strategy's and the Trainer's settings, read at the start of setup) and
:class:`SetupPlan` (setup's plan). A leaf of the strategy's modules: it imports none of them, so the
modules that take these (the run, the planner, the tensor manager's setup) import it without a cycle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_greedysnake.config import GreedySnakeConfig, RunConfig
from lightning_greedysnake.models import Unit
from lightning_greedysnake.offload.activations import ActivationTierPlan
from lightning_greedysnake.offload.device import DeviceCopies
from lightning_greedysnake.offload.preflight import new_owner
from lightning_greedysnake.planner.measure import available_cores
from lightning_greedysnake.planner.placement import PlacementPlan
from lightning_greedysnake.planner.threads import optimizer_threads
from lightning_greedysnake.precision import GreedySnakePrecision
from lightning_greedysnake.tensor_manager import DataParallelHooks


@dataclass(frozen=True)
class SetupContext:
    """What setup needs of the strategy and the Trainer, read once at the start of setup."""

    settings: GreedySnakeConfig
    """What the user set (``None``: the planner's, with ``auto=True``)."""
    device: torch.device
    simulated: bool
    """The simulated device is on (units placed on ``device`` then live in a device tier on the CPU)."""
    global_rank: int
    local_rank: int
    world_size: int
    local_processes: int
    """Processes on this node (they share its host memory budget)."""
    accumulate: int
    """``accumulate_grad_batches``: the window's micro-batches, K."""
    default_root: Path
    fitting: bool
    precision: GreedySnakePrecision
    broadcast: Callable[[Any], Any]
    """Rank 0's object on every rank (identity in one process)."""
    broadcast_parameters: Callable[[list[nn.Parameter]], None]
    """Every rank's copy of these parameters becomes rank 0's (a no-op in one process)."""
    data_parallel: Callable[[DeviceCopies | None, bool], DataParallelHooks | None]
    """The ranks' collectives for a new tensor manager (None in one process)."""
    gradient_observer: Callable[[int, Tensor], None]
    """The strategy's gradient hooks (see ``GreedySnakeStrategy.register_gradient_hook``)."""
    warn: Callable[[str, str], None]
    """Warns once per key (rank 0)."""
    report: Callable[[str], None]
    """The planner's reports (rank 0's log)."""
    owner: str = field(default_factory=new_owner)
    """The strategy's mark in its offload directories' lock records: files its runs kept there
    (``offload.keep_files``) are its own to reuse in its next setup (validate after fit on one Trainer)."""

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device_tier(self) -> bool:
        """Units placed on the device live in device memory (a GPU, or the simulated device)."""
        return self.device.type == "cuda" or (self.device.type == "cpu" and self.simulated)

    @property
    def optimizer_threads(self) -> int:
        """The optimizer lane's intra-op threads: ``offload.optimizer_threads``, else planned from this
        machine's cores (:func:`~lightning_greedysnake.planner.threads.optimizer_threads`; the simulated
        device counts as the GPU it stands for)."""
        return optimizer_threads(available_cores(), device_tier=self.device_tier, local_processes=self.local_processes,
                                 given=self.settings.offload.optimizer_threads)


@dataclass(frozen=True)
class SetupPlan:
    """What setup planned: the settings in effect, the placement plan (None: nothing planned), the units of
    the planned size, and the saved activations' tier plan for the tensor manager (their share of the
    host budget and the report; None: ``offload.activations`` given, or ``auto=False``)."""

    config: RunConfig
    placement: PlacementPlan | None
    units: list[Unit]
    activations: ActivationTierPlan | None
    schedule_note: str | None = None
    """Why the schedule was planned horizontal (None: not planned), said after the placement table
    (:meth:`Planner.report_setup`)."""
