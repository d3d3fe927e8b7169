"""Whole units in and out of their tiers outside any window: initialization, checkpoints, the end of a
run. The training thread calls everything here, with pending optimizer steps drained first where they
would race (:class:`UnitValues`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_greedysnake.checkpoint import optimizer_state as opt_state
from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.io.aligned import ALIGN_BYTES
from lightning_greedysnake.offload.residency import WeightsResidency, slot_view
from lightning_greedysnake.offload.staging import StagingArena
from lightning_greedysnake.optim import UnitStepper
from lightning_greedysnake.optim.state_format import StateFormat

WEIGHT_KINDS = (TensorKind.WEIGHTS, TensorKind.MASTER_WEIGHTS)
"""The kinds a unit's weights come back from (its compute weights; master weights under 16-bit)."""


class UnitReader(Protocol):
    """Reads whole units: this process's :class:`UnitValues`, or a gather of every rank's chunks of them
    (data parallel with partitioned state)."""

    def unit_master_weights(self, u: int) -> list[Tensor]: ...

    def unit_optimizer_state(self, u: int) -> dict[int, dict[str, Any]]: ...


class UnitValues:
    """Each unit's weights and optimizer state as whole tensors, in and out of the tiers (the training
    thread, between windows). A read-ahead of a unit's optimizer step is dropped where its values are
    read out or replaced under it. Owns the end-of-fit hand-back (:meth:`hand_back`)."""

    def __init__(self, arena: StagingArena, stepper: UnitStepper, weights: WeightsResidency,
                 where: dict[int, tuple[int, int]], optimizer: torch.optim.Optimizer | None,
                 compute_dtype: torch.dtype, state_format: StateFormat, drain: Callable[[], None],
                 host_group: Any = None) -> None:
        """``where``: each parameter's unit and index in it (the gradient accumulator's); ``drain``: completes
        every pending optimizer step and write (the tensor manager's); ``host_group``: data parallel's
        process group for host tensors (None: the default group)."""
        self._arena = arena
        self._stepper = stepper
        self._weights = weights
        self._where = where
        self.optimizer = optimizer
        self._dtype = compute_dtype
        self._codec = state_format.codec
        self.drain = drain
        """Complete every pending optimizer step and write (before reading state from outside a window)."""
        self.flush = arena.flush
        """Wait for every write in flight (raises the first I/O error)."""
        self.host_group = host_group
        self.params = weights.params
        self.slots = stepper.slots
        state = arena.state
        self.layouts, self.num_units = state.units, state.num_units
        self.shard, self.bounds = state.shard, state.bounds
        regions = arena.regions
        self.staging_bytes = max((regions.staged_unit_bytes(u) for u in range(self.num_units)), default=0)
        """Pool bytes reading one whole unit out of its tiers stages at most (its weights, master weights
        and optimizer state off the host tier, as placed): what the hand-back holds, planned at setup."""

    def load_unit_weights(self, u: int, values: list[Tensor]) -> None:
        """Set unit ``u``'s weights (and master weights, under a 16-bit compute dtype) from full-precision
        tensors in layout order."""
        self._stepper.parts.drop_read_ahead(u)  # read before these new values
        arena, lay = self._arena, self.layouts[u]
        weights = arena.stage(TensorKind.WEIGHTS, u, read=False)
        flat = weights.view(self._dtype, lay.numel)
        for slot, value in zip(lay.params, values, strict=True):
            slot_view(flat, slot).copy_(value.detach())
        arena.put_back(TensorKind.WEIGHTS, u, weights, placing=True)
        if arena.state.region_bytes(TensorKind.MASTER_WEIGHTS, u):
            master = arena.stage(TensorKind.MASTER_WEIGHTS, u, read=False)
            mflat = master.view(torch.float32, lay.trained_numel)
            for slot, value in zip(lay.params, values, strict=True):
                if slot.group is not None:
                    slot_view(mflat, slot).copy_(value.detach())
            ranges = arena.state.chunk_ranges(TensorKind.MASTER_WEIGHTS, u)
            arena.put_back(TensorKind.MASTER_WEIGHTS, u, master, ranges)

    def unit_master_weights(self, u: int) -> list[Tensor]:
        """Unit ``u``'s full-precision weights as new tensors in layout order (for state dicts)."""
        self.drain()
        arena, lay = self._arena, self.layouts[u]
        has_master = bool(arena.state.region_bytes(TensorKind.MASTER_WEIGHTS, u))
        weights = arena.stage(TensorKind.WEIGHTS, u, read=True)
        try:
            flat = weights.view(self._dtype, lay.numel)
            dtype = torch.float32 if arena.state.separate_master else self._dtype
            # (a trained parameter's value comes from the master weights below: no copy of it made here; a
            # read-only one kept in its own dtype is given in it)
            out = [torch.empty(0) if has_master and slot.group is not None
                   else slot_view(flat, slot).clone() if slot.storage is not None
                   else slot_view(flat, slot).to(dtype, copy=True) for slot in lay.params]
        finally:
            weights.release()
        if has_master:
            master = arena.stage(TensorKind.MASTER_WEIGHTS, u, read=True)
            try:
                mflat = master.view(torch.float32, lay.trained_numel)
                for k, slot in enumerate(lay.params):
                    if slot.group is not None:
                        out[k] = slot_view(mflat, slot).clone()
            finally:
                master.release()
        return out

    def unit_optimizer_state(self, u: int) -> dict[int, dict[str, Any]]:
        """Unit ``u``'s optimizer state as new tensors, keyed by the parameter's index in the unit's layout
        (parameters the optimizer has not stepped yet are absent). Drains pending steps first."""
        assert self.optimizer is not None
        self.drain()
        self._stepper.parts.drop_read_ahead(u)  # read before this state is read out (and perhaps replaced)
        return opt_state.unit_optimizer_state(self._arena, self._stepper.unit_optimizers[u], self.slots, u,
                                              self._codec)

    def publish_calls(self) -> None:
        """The optimizer's per-call state as the units' steps left it (pytorch-optimizer's ``group['step']``:
        :class:`~lightning_greedysnake.optim.unit_optimizer.CallState`) written into the user's optimizer,
        where its own steps would have left it: its param groups (what a checkpoint saves) and attributes.
        Drains pending steps first."""
        assert self.optimizer is not None
        self.drain()
        groups, attributes = self._stepper.call_state()
        for gi, entries in groups.items():
            self.optimizer.param_groups[gi].update(entries)
        for name, value in attributes.items():
            if name.startswith("state:"):  # (an entry of its state under a key that is no parameter)
                self.optimizer.state[name.removeprefix("state:")] = value
            else:
                setattr(self.optimizer, name, value)

    def load_calls(self) -> None:
        """Inverse of :meth:`publish_calls`: every unit's per-call state from the user's optimizer (after a
        checkpoint's param groups were loaded into it)."""
        self.drain()
        self._stepper.load_calls()

    def load_unit_optimizer_state(self, u: int, entries: dict[int, dict[str, Any]]) -> None:
        """Inverse of :meth:`unit_optimizer_state` (entries keyed by layout index)."""
        assert self.optimizer is not None
        self.drain()
        self._stepper.parts.drop_read_ahead(u)  # read before this new state
        opt_state.load_unit_optimizer_state(self._arena, self._stepper.unit_optimizers[u], self.slots, u,
                                            entries, self._codec)

    def optimizer_state(self, per_unit: Callable[[int], dict[int, dict[str, Any]]] | None = None
                        ) -> dict[int, dict[str, Any]]:
        """The optimizer's per-parameter state in ``torch.optim`` form (the ``state`` entry of
        ``optimizer.state_dict()``), from ``per_unit(u)`` (default: :meth:`unit_optimizer_state`). Holds it
        all in memory: checkpoints stream it unit by unit."""
        assert self.optimizer is not None
        return opt_state.optimizer_state(self.optimizer, self._where, self.num_units,
                                         per_unit or self.unit_optimizer_state)

    def load_optimizer_state(self, state: dict[int, dict[str, Any]]) -> None:
        """Inverse of :meth:`optimizer_state`: scatter a ``torch.optim`` state into the units."""
        assert self.optimizer is not None
        self.drain()
        for u, entries in opt_state.split_optimizer_state(self.optimizer, self._where, state).items():
            self.load_unit_optimizer_state(u, entries)
        self.flush()

    def hand_back(self, reader: UnitReader, *, with_state: bool, staging_bytes: int | None,
                  wait_timeout_s: float | None = None) -> None:
        """Give the parameters their trained values back, unit by unit, freeing each unit's RAM regions
        once it is back (what comes back takes the place of what is freed, as planned at setup), and with
        ``with_state`` the user's optimizer its state, as ``torch.optim`` keeps it (quantized state comes
        back dequantized, as plain tensors, not its codes). ``reader`` reads each whole unit.

        Every pending step completes first (the last complete update). ``staging_bytes``: the staging the
        hand-back may hold from here on (None: the run's, unchanged), at least one unit's of this process
        (:attr:`staging_bytes`: a rank whose chunk of a unit is larger than rank 0's keeps room for its own)
        and what an interrupted step still holds. ``wait_timeout_s``: after a failure, the longest a pending
        step waits for staging memory (a buffer an interrupted thread never gave back must not hold teardown
        for minutes)."""
        pool, regions = self._arena.budget.pool, self._arena.regions
        if wait_timeout_s is not None:
            pool.wait_timeout_s = min(pool.wait_timeout_s, wait_timeout_s)
        self.drain()
        if staging_bytes is not None:
            pool.shrink(max(staging_bytes, self.staging_bytes, ALIGN_BYTES) + pool.in_use_bytes)
        per_unit = {}
        for u in range(self.num_units):
            regions.release_host(u, (TensorKind.GRADIENTS,))
            self._weights.restore(u, reader.unit_master_weights(u))
            regions.release_host(u, WEIGHT_KINDS)
            if with_state:
                per_unit[u] = reader.unit_optimizer_state(u)
            regions.release_host(u, (TensorKind.OPTIMIZER_STATES,))
        if with_state:
            assert self.optimizer is not None
            state = self.optimizer_state(per_unit.__getitem__)
            for entry in state.values():
                for key in [k for k in entry if k.partition(".")[0] in self.slots and "." in k]:
                    del entry[key]
            self.publish_calls()
            groups = self.optimizer.state_dict()["param_groups"]
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
