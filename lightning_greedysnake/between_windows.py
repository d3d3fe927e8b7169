"""Weights and optimizer state as checkpoints, initialization and the end of a run see them: read out of
and written into the tiers unit by unit, by the training thread between windows (pending steps drained
first where they would race). A component of :class:`~lightning_greedysnake.tensor_manager.TieredTensorStore`,
which routes its public methods of the same names here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.checkpoint import optimizer_state as opt_state
from lightning_greedysnake.offload import unit_values
from lightning_greedysnake.offload.residency import WeightsResidency
from lightning_greedysnake.offload.staging import StagingArena
from lightning_greedysnake.optim import UnitStepper
from lightning_greedysnake.optim.state_format import StateFormat


class StateBetweenWindows:
    """Each unit's weights, master weights and optimizer state in and out of its tiers (training thread)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, arena: StagingArena, weights: WeightsResidency,
                 stepper: UnitStepper, where: dict[int, tuple[int, int]], slots: tuple[str, ...],
                 state_format: StateFormat, compute_dtype: torch.dtype, drain: Callable[[], None]) -> None:
        """``where``: each parameter's (by ``id``) unit and index in its layout; ``slots``: the optimizer's
        per-element state names; ``drain``: completes every pending step and write (the store's)."""
        self.optimizer = optimizer
        self.arena = arena
        self.weights = weights
        self.stepper = stepper
        self.where = where
        self.slots = slots
        self.state_format = state_format
        self.compute_dtype = compute_dtype
        self.drain = drain

    # -- weights -----------------------------------------------------------------------------------------
    def load_unit_weights(self, u: int, values: list[Tensor]) -> None:
        """Set unit ``u``'s weights (and master weights) from full-precision tensors in layout order."""
        self.stepper.parts.drop_read_ahead(u)  # read before these new values
        unit_values.write_unit(self.arena, u, values, self.compute_dtype)

    def unit_master_weights(self, u: int) -> list[Tensor]:
        """Unit ``u``'s full-precision weights as new tensors in layout order (for state dicts)."""
        self.drain()
        return unit_values.read_unit(self.arena, u, self.compute_dtype)

    def restore_parameters(self, master: Callable[[int], list[Tensor]] | None = None) -> None:
        """Give the parameters real memory again, holding the trained weights (end of a run).
        ``master``: where unit u's full-precision weights come from (partitioned state: gathered)."""
        for u in range(self.arena.state.num_units):
            self.weights.restore(u, (master or self.unit_master_weights)(u))

    # -- optimizer state ---------------------------------------------------------------------------------
    def unit_optimizer_state(self, u: int) -> dict[int, dict[str, Any]]:
        """Unit ``u``'s optimizer state as new tensors, keyed by the parameter's index in the unit's layout
        (parameters the optimizer has not stepped yet are absent). Drains pending steps first."""
        assert self.optimizer is not None
        self.drain()
        self.stepper.parts.drop_read_ahead(u)  # read before this state is read out (and perhaps replaced)
        return opt_state.unit_optimizer_state(self.arena, self.stepper.unit_optimizers[u], self.slots, u,
                                              self.state_format.codec)

    def load_unit_optimizer_state(self, u: int, entries: dict[int, dict[str, Any]]) -> None:
        """Inverse of :meth:`unit_optimizer_state` (entries keyed by layout index)."""
        assert self.optimizer is not None
        self.drain()
        self.stepper.parts.drop_read_ahead(u)  # read before this new state
        opt_state.load_unit_optimizer_state(self.arena, self.stepper.unit_optimizers[u], self.slots, u, entries,
                                            self.state_format.codec)

    def optimizer_state(self) -> dict[int, dict[str, Any]]:
        """The optimizer's per-parameter state in ``torch.optim`` form (the ``state`` entry of
        ``optimizer.state_dict()``). Holds it all in memory: checkpoints stream it unit by unit."""
        assert self.optimizer is not None
        return opt_state.optimizer_state(self.optimizer, self.where, self.arena.state.num_units,
                                         self.unit_optimizer_state)

    def load_optimizer_state(self, state: dict[int, dict[str, Any]]) -> None:
        """Inverse of :meth:`optimizer_state`: scatter a ``torch.optim`` state into the units."""
        assert self.optimizer is not None
        self.drain()
        for u, entries in opt_state.split_optimizer_state(self.optimizer, self.where, state).items():
            self.load_unit_optimizer_state(u, entries)
        self.arena.flush()
