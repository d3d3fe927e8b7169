"""The tensor manager: each unit's weights, master weights, optimizer state, waiting gradients and
saved activations on the tier the placement names, and the optimizer step that streams them.

It is a composition of components, each one owner of one concern (this module only wires them and
routes the :class:`~lightning_greedysnake.offload.TensorStore` protocol to them):

- :class:`~lightning_greedysnake.offload.staging.StagingArena`: the
  :class:`~lightning_greedysnake.offload.staging.Staged` handles that own a buffer and every transfer on
  it, over every kind's regions on their tiers (``offload.regions``), and the pool under its budget;
- :class:`~lightning_greedysnake.offload.residency.WeightsResidency`: compute weights bound to the
  parameters, prefetch, the :class:`~lightning_greedysnake.offload.residency.UpdateGate`;
- :class:`~lightning_greedysnake.offload.gradients.GradientAccumulator`: hooks, flat fp32 gradients,
  spill, norms;
- :class:`~lightning_greedysnake.offload.activations.ActivationStore`: saved activations;
- :class:`~lightning_greedysnake.optim.UnitStepper`: each unit's optimizer step on the lane, through
  the staging Protocols;
- :class:`~lightning_greedysnake.step_modes.StepMode`: how a window's units are stepped (in line,
  deferred for clipping, speculative for fp16), chosen once at construction;
- :class:`~lightning_greedysnake.unit_state.UnitValues` (:attr:`TieredTensorStore.values`): whole units'
  weights and optimizer state in and out of the tiers between windows (initialization, checkpoints, the
  end of a run).

Threads: the training thread calls everything here; the optimizer lane runs the stepper's jobs; I/O
threads complete transfers and give buffers back. Each component's docstring says what it shares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_greedysnake.config import OffloadConfig, TensorKind, Tier
from lightning_greedysnake.io import IOConfig, IOEngine, default_engine
from lightning_greedysnake.io.heap import trim_heap
from lightning_greedysnake.layout import (
    PARAM_ALIGN_NUMEL,
    StateLayout,
    UnitLayout,
    build_unit_layout,
    split_align_numel,
)
from lightning_greedysnake.models import Unit
from lightning_greedysnake.offload.activations import ActivationStore, ActivationTierPlan
from lightning_greedysnake.offload.device import DeviceCopies, named_sync
from lightning_greedysnake.offload.device_reduce import DeviceGradientReducer
from lightning_greedysnake.offload.gradients import GradientAccumulator
from lightning_greedysnake.offload.pool import BufferPool
from lightning_greedysnake.offload.regions import RegionPlacement
from lightning_greedysnake.offload.residency import UpdateGate, WeightsResidency
from lightning_greedysnake.offload.staging import StagingArena
from lightning_greedysnake.offload.stats import IOStats
from lightning_greedysnake.optim import ClipPolicy, UnitStepper
from lightning_greedysnake.optim.contract import OptimizerContract, optimizer_contract
from lightning_greedysnake.optim.lane import StepLane
from lightning_greedysnake.optim.protocols import StepCollectives
from lightning_greedysnake.optim.state_format import StateFormat, state_format_for
from lightning_greedysnake.step_modes import StepMode, step_mode
from lightning_greedysnake.unit_state import UnitValues

__all__ = ["ClipPolicy", "TieredTensorStore"]


def parameter_groups(optimizer: torch.optim.Optimizer | None) -> dict[int, int]:
    """Parameter id -> the index of the optimizer's param group that holds it."""
    return {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]} if optimizer else {}


def layout_order(unit: Unit, groups: dict[int, int]) -> list[tuple[nn.Parameter, int | None]]:
    """``unit``'s parameters in the order of its layout, each with the param group that trains it: the
    trained ones first, then the read-only ones (None: frozen, or not in the optimizer), each in the unit's
    own order. The one place that order is decided: the layout's slots and the tensor manager's
    parameters follow it index for index."""
    entries = [(p, groups.get(id(p)) if p.requires_grad else None) for p in unit.parameters()]
    return [e for e in entries if e[1] is not None] + [e for e in entries if e[1] is None]


def read_only_storage(p: Tensor, compute_dtype: torch.dtype) -> tuple[str, int] | None:
    """How a read-only parameter is kept (:attr:`~lightning_greedysnake.layout.ParamSlot.storage`): in its
    own dtype, where that is neither float32 (held in the compute dtype under the precision policy, as a
    trained parameter's compute weights are) nor the compute dtype already. A dtype wider than the compute
    dtype is refused before this (:func:`~lightning_greedysnake.strategy.checks.check_parameter_dtypes`)."""
    if p.dtype in (torch.float32, compute_dtype):
        return None
    return str(p.dtype).removeprefix("torch."), p.dtype.itemsize


def state_layout(units: list[Unit], param_names: dict[int, str], optimizer: torch.optim.Optimizer | None,
                 config: OffloadConfig, compute_dtype: torch.dtype, shard: tuple[int, int] | None = None,
                 contract: OptimizerContract | None = None, state_format: StateFormat | None = None) -> StateLayout:
    """How :class:`TieredTensorStore` lays ``units`` out (every region's size), without building one: what
    the placement plan is computed from. ``contract``/``state_format``: the optimizer's, if already known
    (the contract decides the slots, and whether every parameter starts where a unit may be cut)."""
    if contract is None:
        contract = optimizer_contract(optimizer)
    slots = contract.slots
    if state_format is None:
        state_format = state_format_for(optimizer, slots, config.optimizer_state_dtype, shard, contract.whole_parameters)
    codec = state_format.codec
    align = PARAM_ALIGN_NUMEL if codec is None else max(PARAM_ALIGN_NUMEL, codec.align_numel)
    if contract.whole_parameters:  # every parameter start a legal cut: 4 KiB-aligned bytes in every dtype
        align = math.lcm(align, split_align_numel(codec.layout if codec else ()))
    groups = parameter_groups(optimizer)
    layouts = [
        build_unit_layout(unit.index, [
            (param_names.get(id(p), f"unit{unit.index}.{i}"), tuple(p.shape), group,
             read_only_storage(p, compute_dtype) if group is None else None)
            for i, (p, group) in enumerate(layout_order(unit, groups))
        ], align, compute_dtype.itemsize, split_align_numel(codec.layout if codec else ()))
        for unit in units
    ]
    return StateLayout(tuple(layouts), compute_dtype.itemsize, len(slots),
                       separate_master=compute_dtype != torch.float32, shard=shard,
                       parameter_cuts=contract.whole_parameters, min_piece_numel=contract.min_piece_numel,
                       state_itemsize=state_format.dtype.itemsize, state_codec=codec.layout if codec else ())


@dataclass(frozen=True)
class DataParallelHooks:
    """The ranks' collectives, as the tensor manager is built with them (None: one process)."""

    steps: StepCollectives
    """The optimizer lane's: gradient averaging on the host, the partitioned weights gather."""
    host_group: Any = None
    """The process group for host tensors (gloo beside NCCL; None: the default group)."""
    device_reducer: DeviceGradientReducer | None = None
    """On a device tier: averages each unit's gradient on the device before its copy to the host."""


def gradients_from(state: StateLayout, alpha_max: float | None) -> list[int] | None:
    """Per unit, the first element a deferred part at alpha up to ``alpha_max`` starts at (unit 0 is never
    deferred: its numel), the range its gradient region can be written from; None where ``alpha_max`` is
    None or each rank steps its own chunk (partitioned state: its deferred part is within its chunk)."""
    if alpha_max is None or state.shard is not None:
        return None
    return [lay.trained_numel if u == 0 else state.split(u, alpha_max) for u, lay in enumerate(state.units)]


class TieredTensorStore:
    """The SSD/host tensor manager behind the :class:`TensorStore` protocol, plus the optimizer step."""

    def __init__(self, units: list[Unit], param_names: dict[int, str], optimizer: torch.optim.Optimizer | None,
                 config: OffloadConfig, compute_dtype: torch.dtype = torch.float32, clip: ClipPolicy | None = None,
                 alpha: float = 0.0, lag: int = 0, shard: tuple[int, int] | None = None,
                 copies: DeviceCopies | None = None, loss_scaler: Any = None,
                 data_parallel: DataParallelHooks | None = None,
                 gradient_observer: Callable[[int, Tensor], None] | None = None, optimizer_threads: int = 1,
                 activation_plan: ActivationTierPlan | None = None,
                 deferred_gradients_only: float | None = None, contract: OptimizerContract | None = None,
                 double_buffered: bool = False) -> None:
        """Lays the units out; touches no file (see :meth:`open`), so sizes are known for preflight.

        ``alpha``: the fraction of each unit's update deferred into the next iteration's forward;
        ``lag``: how many units the background optimizer may trail backward by (0: synchronous);
        ``shard``: ``(rank, world)`` of data parallel with partitioned state: this process steps only its
        chunk of every unit, and ``data_parallel``'s gather brings the other chunks' weights.
        ``copies``: the device tier (a GPU's copy streams, or the simulated device), which this store
        closes; None: the CPU computes on the host tier's memory. ``loss_scaler`` (fp16): where no
        clipping defers the steps, each unit is stepped speculatively as its gradient completes, into
        a second slot of its regions, and a window found to hold an inf or NaN is undone
        (:meth:`finish_step`). ``data_parallel``: the ranks' collectives (None: one process).
        ``gradient_observer``: see :class:`~lightning_greedysnake.optim.stepper.UnitStepper`.
        ``optimizer_threads``: the optimizer lane's intra-op threads (planned by the strategy).
        ``double_buffered``: unless ``config`` gives a staging budget, the staging rule's double-buffered
        one (:mod:`~lightning_greedysnake.planner.staging`; ``auto=False``'s), not the automatic one.
        ``activation_plan``: the saved activations' tier, planned at their first save (see
        :class:`~lightning_greedysnake.offload.activations.ActivationStore`).
        ``contract``: how the optimizer is stepped (:func:`~lightning_greedysnake.optim.contract.
        optimizer_contract`, decided once per run; default: decided here, ``optimizer_path='auto'``).
        ``deferred_gradients_only``: the largest alpha any step of the run may take, where only the deferred
        parts of gradients ever wait on their tier (the vertical order, no clipping by the global norm):
        a gradients file on SSD holds only those (:class:`~lightning_greedysnake.offload.regions.RegionMap`);
        None: whole gradients may wait there."""
        if config.unset():
            raise ValueError(f"the tensor manager needs every kind placed (OffloadConfig.placed()), not {config}")
        self.config = config
        self.optimizer = optimizer
        self.compute_dtype = compute_dtype
        self.clip = clip or ClipPolicy()
        self.stats = IOStats()
        self._engines: list[IOEngine] = []
        self.offload_dirs: list[Path] = []
        """The offload directories, one per SSD (set by :meth:`open`; empty: none)."""
        self._closed = False
        groups = parameter_groups(optimizer)
        self.params: list[list[nn.Parameter]] = [[p for p, _ in layout_order(unit, groups)] for unit in units]
        """Each unit's parameters in its layout's order (the trained ones first)."""
        self.contract = contract if contract is not None else optimizer_contract(optimizer)
        """How the optimizer is stepped: element-wise on flat slices, or on whole parameters."""
        self.slots: tuple[str, ...] = self.contract.slots
        self.state_format = state_format_for(optimizer, self.slots, config.optimizer_state_dtype, shard,
                                             self.contract.whole_parameters)
        self.state = state_layout(units, param_names, optimizer, config, compute_dtype, shard, self.contract,
                                  self.state_format)
        mode = step_mode(self.clip, loss_scaled=loss_scaler is not None)
        self.speculative = mode.speculative
        self.copies = copies
        self.trims_heap = config.uses_ssd or copies is not None
        """Whether each optimizer part's step gives the heap's free pages back to the OS (a part's first
        step always does: :meth:`PartStepper.step_part`). A run with every kind in host memory, as
        Lightning, leaves the heap to the allocator: a trim after every unit's step gave back the pages the
        next micro-batch faulted in again, a few percent of a step (``benchmarks/memory.py``; results
        ``memory_defaults_fp32_trim.json``). Where state streams from SSD (or computes on a device) the trim
        keeps host memory from creeping up by several units' worth of freed gradients."""
        self.host_group: Any = data_parallel.host_group if data_parallel is not None else None
        """Data parallel: the process group for host tensors (gloo beside NCCL; None: the default group)."""
        # built in dependency order, each complete: the lane first (the pool asks it whether buffers are
        # on their way back; the weights wait on it), then the staging, the weights, the stepper
        lane = StepLane(lag, on_busy=self.stats.record_job, threads=optimizer_threads)
        self.arena = StagingArena(self.state, config, self.stats, lag, slots=2 if self.speculative else 1,
                                  copies=copies, others_active=lane.others_will_release,
                                  gradients_from=gradients_from(self.state, deferred_gradients_only),
                                  double_buffered=double_buffered)
        self.gate = UpdateGate(len(units))
        self.weights = WeightsResidency(self.arena, self.state, self.params, compute_dtype, self.gate,
                                        wait_for=lane.wait_for, copies=copies)
        self.stepper = UnitStepper(optimizer, self.state, self.slots, self.arena, self.gate, compute_dtype,
                                   self.clip, alpha, lane, state_format=self.state_format,
                                   keep_weights=self.weights.keep_as_prefetch,
                                   collectives=data_parallel.steps if data_parallel is not None else None,
                                   loss_scaler=loss_scaler, speculative=self.speculative,
                                   gradient_observer=gradient_observer, trim_heap=self.trims_heap,
                                   contract=self.contract)
        self.grads = GradientAccumulator(self.arena, self.state, self.params, copies,
                                         data_parallel.device_reducer if data_parallel is not None else None)
        self.activations = ActivationStore(self.arena, config, self.stats, copies, activation_plan)
        self.steps: StepMode = mode(self.stepper, self.grads, self.weights, self.host_group)
        """How the window's units are stepped (in line, deferred for clipping, speculative): chosen here, once."""
        self.values = UnitValues(self.arena, self.stepper, self.weights, self.grads.where, optimizer, compute_dtype,
                                 self.state_format, self.drain, self.host_group)
        """Whole units' weights and optimizer state in and out of the tiers (initialization, checkpoints,
        the end of a run)."""

    # -- views of the components (read-only) ------------------------------------------------------------
    @property
    def placement(self) -> RegionPlacement:
        """Where each kind's regions of each unit live, and their sizes."""
        return self.arena.regions

    @property
    def layouts(self) -> tuple[UnitLayout, ...]:
        return self.state.units

    @property
    def num_units(self) -> int:
        return self.state.num_units

    @property
    def pool(self) -> BufferPool:
        return self.arena.budget.pool

    @property
    def files(self) -> list[Path]:
        return [*self.arena.regions.files, *self.activations.files]

    @property
    def host_registrations(self) -> int:
        """Page-lock registrations of host memory by the device tier since construction (0 without one)."""
        return self.copies.counts.registrations if self.copies is not None else 0

    @property
    def optimizer_threads(self) -> int:
        """The optimizer lane's intra-op threads."""
        return self.stepper.lane.threads

    @property
    def unit_input_bytes(self) -> int:
        """The largest saved activation seen (one unit input of one micro-batch), for planning."""
        return self.activations.unit_input_bytes

    @property
    def optimizer_wait_seconds(self) -> float:
        """Seconds the training thread spent blocked on the optimizer lane, since construction."""
        return self.stepper.lane.wait_seconds

    def region_bytes(self, kind: TensorKind, u: int) -> int:
        return self.state.region_bytes(kind, u)

    def on_ssd(self, kind: TensorKind, u: int) -> bool:
        return self.arena.regions.on_ssd(kind, u)

    def on_device(self, kind: TensorKind, u: int) -> bool:
        return self.arena.regions.on_device(kind, u)

    def deferred_bytes(self, kind: TensorKind, u: int) -> int:
        """Bytes of unit ``u``'s region of ``kind`` that its deferred (alpha) part moves."""
        lo, hi = self.stepper.deferred_range(u)
        return sum(b - a for a, b in self.state.byte_ranges(kind, u, lo, hi)) if lo < hi else 0

    # -- lifetime -------------------------------------------------------------------------------------------
    def open(self, offload_dirs: Path | list[Path] | None, io_engine: IOEngine | None = None) -> None:
        """Create the host regions and the preallocated offload files (after preflight), in one offload
        directory or striped over several (one per SSD). ``io_engine``: the I/O backend for all of them
        (default: a threaded O_DIRECT engine of ``offload.io_threads`` threads per directory, so each SSD
        has its own queue, see :func:`~lightning_greedysnake.io.default_engine`); this store closes it."""
        config = self.config
        dirs = [offload_dirs] if isinstance(offload_dirs, Path) else list(offload_dirs or [])
        self.offload_dirs = dirs
        engines: list[IOEngine] = []
        assert dirs or not config.uses_ssd, "an SSD tier needs an offload directory"
        if dirs:  # (with nothing else there, a directory the user named may still take the saved activations)
            io = IOConfig(config.io_threads, config.io_chunk_bytes, config.direct_io)
            engines = [io_engine or default_engine(io, on_request=self.stats.record_request) for _ in dirs]
            self._engines = list({id(e): e for e in engines}.values())  # (a given engine serves every one)
        try:
            self.arena.regions.open(dirs, engines)
            self.activations.open(dirs, engines)
        except BaseException:
            self._close_files()
            raise

    def initialize_from_parameters(self) -> None:
        """Copy the parameters' current values into their tiers, then detach the parameters' memory.

        Called once, after the model exists (and after a checkpoint's weights were loaded into it)."""
        for u in range(self.num_units):
            self.values.load_unit_weights(u, [p.data for p in self.params[u]])
        for u in range(self.num_units):  # (after every unit's: a parameter several units lay out is read by each)
            self.weights.unbind(u)
        self.flush()
        self.grads.register_hooks()

    def initialize_unit_by_unit(self, init_unit: Callable[[int], None]) -> None:
        """For a model created on the meta device: give unit u's parameters real (uninitialized) memory,
        let ``init_unit(u)`` fill them in place, store them in their tiers and free the memory again,
        one unit at a time, so the whole model never exists in RAM at once."""
        if self.weights.shares_parameters:
            raise ValueError(
                "a frozen parameter is used by several units (a tied embedding and head) of a model created on "
                "the meta device: greedysnake initializes such a model unit by unit, which would give each unit's "
                "copy of it other values. Fix: create the model on the CPU (or load its weights before fit), or "
                "untie it (e.g. tie_word_embeddings=False).")
        for u in range(self.num_units):
            self.weights.materialize(u)
            init_unit(u)
            self.values.load_unit_weights(u, [p.data for p in self.params[u]])
            self.weights.unbind(u)
            trim_heap(self.layouts[u].numel * 4)
        self.flush()
        self.grads.register_hooks()

    def drain(self) -> None:
        """Complete every pending optimizer step, deferred forward parts included (before reading the
        weights or optimizer state from outside a window: checkpoints, evaluation, the end of the run)."""
        self.stepper.drain()
        self.flush()

    def flush(self) -> None:
        """Wait for every write in flight (raises the first I/O error)."""
        self.arena.flush()

    def reconfigure(self, alpha: float, lag: int, offload: OffloadConfig) -> None:
        """Change alpha, lag and the staging budget (``offload.buffer_budget_bytes``) between steps (the
        planner's choice): drains every pending step, re-splits each unit's optimizer keeping its state,
        resizes the lane and the pool. Nothing else of ``offload`` may change but ``activations`` to ``ssd``
        (kept graphs' saved tensors there: from the next window on)."""
        assert offload.buffer_budget_bytes is not None, "a plan names its staging budget"
        same = dataclasses.replace(offload, buffer_budget_bytes=self.config.buffer_budget_bytes,
                                   activations=self.config.activations)
        assert same == self.config, "the plan changes only the staging budget and the saved activations' tier"
        if offload.activations is Tier.SSD:
            self.activations.to_ssd()
        self.drain()
        self.stepper.reconfigure(alpha, lag)
        self.arena.budget.set_budget(offload.buffer_budget_bytes, lag)
        self.config = offload
        # once, with nothing in flight: the heap the steps before the plan freed (on the lane's thread
        # too, which a synchronous step no longer uses) goes back to the OS; without it a run with every
        # kind in RAM crept from step to step after the plan
        trim_heap()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for writes, stop the lane and the I/O threads, close files and buffers, remove hooks.
        Idempotent. The parameters keep their placeholders: the state lives in the tiers (and in
        checkpoints)."""
        if self._closed:
            return
        self._closed = True
        self.grads.remove_hooks()
        try:
            self.stepper.close()  # runs what is queued (a failed lane runs nothing more)
            self.weights.close()
            self.grads.discard()  # a window cut short by an error leaves its accumulators
            # a failed lane's error already reached the training thread: finish cleaning up regardless
            with contextlib.suppress(OSError) if self.stepper.lane.failed else contextlib.nullcontext():
                self.flush()
        finally:
            self._close_files()

    def _close_files(self) -> None:
        """Every transfer completes before its file closes: each region and the scratch wait for theirs,
        then the engine stops its threads."""
        try:
            self.activations.close()
            self.arena.close()
        finally:
            try:
                engines, self._engines = self._engines, []
                for engine in engines:
                    engine.close()
            finally:
                if self.copies is not None:
                    self.copies.close()  # (after every handle that tracked a copy was given back)

    # -- the TensorStore protocol (training thread) ----------------------------------------------------------
    def begin_window(self, num_microbatches: int) -> None:
        self.grads.check_requires_grad()
        self.activations.begin_window(num_microbatches, self.num_units)

    def acquire_unit(self, unit: int) -> None:
        self.weights.acquire(unit)

    def release_unit(self, unit: int) -> None:
        self.weights.release(unit)
        if self.grads.in_memory(unit):
            # an incomplete gradient (the horizontal order) or one waiting for the global norm goes to
            # its tier: host memory never holds more than the units in use
            self.grads.spill(unit)

    def prefetch(self, unit: int) -> None:
        self.weights.prefetch(unit)

    def prefetch_step(self, unit: int, last: bool = True) -> bool:
        return self.stepper.read_ahead(unit, lambda: self._unit_need_bytes(unit), last)

    def _unit_need_bytes(self, unit: int) -> int:
        """Pool bytes the training thread may still take for ``unit``'s backward and step: its weights if
        neither held nor prefetched, its gradient's host buffer if not yet in one (not started; or, on a
        device tier, accumulating in device memory: the step's host copy is staged when it is taken)."""
        regions = self.arena.regions
        need = 0 if self.weights.is_staged(unit) else regions.ssd_region_bytes(TensorKind.WEIGHTS, unit)
        if not self.grads.on_host(unit):
            need += regions.staged_region_bytes(TensorKind.GRADIENTS, unit)
        return need

    def save_activation(self, unit: int, microbatch: int, hidden: Tensor) -> None:
        self.activations.save(unit, microbatch, hidden)

    def load_activation(self, unit: int, microbatch: int) -> Tensor:
        return self.activations.load(unit, microbatch)

    def release_activation(self, unit: int, microbatch: int) -> None:
        self.activations.release(unit, microbatch)

    def prefetch_activation(self, unit: int, microbatch: int) -> None:
        self.activations.prefetch(unit, microbatch)

    def drop_activation(self, unit: int, microbatch: int) -> None:
        self.activations.drop(unit, microbatch)

    def gradient_ready(self, unit: int) -> None:
        """``unit``'s gradient for this window is complete: to the step mode (stepped now, or waiting on its
        tier for clipping until :meth:`finish_step`)."""
        self.stepper.lane.check()
        if not self.stepper.trains(unit) or not self.grads.has(unit):
            return  # (no gradient reached this unit in this window: torch skips such parameters too)
        self.steps.gradient_ready(unit)

    def clip_by_norm(self, max_norm: float, order: Iterable[nn.Parameter],
                     inv_scale: float | None = None) -> Tensor:
        """Deferred mode: scale every waiting gradient as ``clip_grad_norm_`` would (applied at step), by
        the norm of the unscaled gradients under loss scaling."""
        total = self.grads.global_norm(order) * (inv_scale if inv_scale is not None else 1.0)
        # the lane scales host gradients: on a device tier this reads the norm back (one wait per step,
        # in this mode only)
        with named_sync("clipping norm"):
            host_total = total.cpu()
        self.stepper.clip_by_norm(max_norm, host_total)
        return total

    def clip_by_value(self, value: float) -> None:
        self.stepper.clip_by_value(value)

    def finish_step(self, inv_scale: float | None = None) -> bool:
        """After clipping (Lightning's order): the window's remaining steps, as :attr:`steps` runs them (the
        forward parts, which overlap the next forward; deferred, every unit's whole step; speculative, the
        window's verdict). False: the window stepped nothing (under loss scaling, ``inv_scale``, a gradient
        was not finite) and its gradients went."""
        self.stepper.lane.check()
        self.stepper.lane.run_held()
        return self.steps.finish(inv_scale)

    def end_window(self, completed: bool = True) -> None:
        """Forget the window's saved activations; an abandoned window (``completed=False``) also loses its
        gradients, as Lightning's own ``zero_grad`` would drop them. A completed window's gradients are
        all stepped already, or (deferred mode) wait for :meth:`finish_step`."""
        self.activations.end_window()
        if not completed:
            self.discard_gradients()

    def discard_gradients(self) -> None:
        self.stepper.discard()
        self.grads.discard()
