"""A run's parts, built complete at setup from what setup reads of the strategy and the Trainer, and
closed together.

:class:`SetupContext` is everything the planner and the builders take (never the strategy itself); from
it the device plan and the host budget are planned first (:func:`~lightning_greedysnake.strategy.planning.
plan_before_setup`); :func:`cut_model` finds the layered model and cuts it into units (before Lightning moves
the model); :func:`open_run` builds the run's one :class:`~lightning_greedysnake.strategy.planning.Planner`
and plans the run (its setup plan, with ``auto=True``), builds the tensor manager, the engine and the
window's helpers, and returns them as one :class:`Run`, whose ``config`` is
the one resolved configuration every part was built from (a new one after the warm-step plan,
:meth:`Run.apply`).

Threads: all of it runs on the training thread, at setup, between windows and at teardown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lightning_greedysnake.checkpoint.streamed import parameter_aliases
from lightning_greedysnake.config import RunConfig
from lightning_greedysnake.engine import WindowEngine
from lightning_greedysnake.engine.timing import ComputeTimer, compute_timer_for
from lightning_greedysnake.models import (
    LayerChain,
    Unit,
    check_parameter_ownership,
    check_tied_weights,
    find_layered_model,
    make_units,
    model_name,
)
from lightning_greedysnake.offload import InMemoryTensorStore
from lightning_greedysnake.optim import ClipPolicy
from lightning_greedysnake.optim.contract import optimizer_contract
from lightning_greedysnake.rng import TrainingRng
from lightning_greedysnake.step_modes import step_mode
from lightning_greedysnake.strategy import checks
from lightning_greedysnake.strategy.checkpoints import LIGHTNING, CheckpointSeam, StreamedCheckpoints
from lightning_greedysnake.strategy.host_memory import HandBack, HostMemory, process_rss_bytes
from lightning_greedysnake.strategy.inputs import WindowInputs
from lightning_greedysnake.strategy.manager_setup import (
    check_device,
    new_tensor_manager,
    open_tensor_manager,
    stand_in_for_meta_parameters,
)
from lightning_greedysnake.strategy.nonfinite import NonFiniteGuard
from lightning_greedysnake.strategy.offload_dir import OffloadDirectories
from lightning_greedysnake.strategy.planning import BeforeSetup, Planner, measurements_for
from lightning_greedysnake.strategy.planning.placement import PlacementPlan, empty_path_note
from lightning_greedysnake.strategy.report import kinds_without_bytes
from lightning_greedysnake.strategy.setup_context import SetupContext
from lightning_greedysnake.telemetry import StepRecorder
from lightning_greedysnake.tensor_manager import TieredTensorStore


@dataclass(frozen=True)
class ModelCut:
    """The layered model found in the LightningModule and cut into units, with the settings in effect
    before the tensor manager's plan (the device plan's: every kind on the GPU where it all fits)."""

    config: RunConfig
    layered: nn.Module
    path: str
    name: str
    """The layered model as messages name it: the user's LightningModule class and the path (``MyModule.net``)."""
    chain: LayerChain
    units: list[Unit]
    on_meta: bool
    """The layered model was built on the meta device: the tensor manager materializes it."""


def cut_model(ctx: SetupContext, config: RunConfig, module: nn.Module) -> ModelCut:
    """Find the layered model and cut it into units of ``config``'s size (the device plan's settings,
    :attr:`BeforeSetup.config`; the unit plan may choose another size at :func:`open_run`); refuse what
    cannot train, before any work."""
    if ctx.fitting:
        checks.check_module_for_training(module, ctx.warn)
    path, layered, chain = find_layered_model(module, config.layered_module)
    config = units_in_effect(ctx, config, len(chain.blocks))
    units = make_units(chain, config.layers_per_unit)
    if ctx.fitting:
        check_parameter_ownership(module, path, units)
    else:  # a parameter outside the chain is the evaluation's own business; one in two units is not
        check_tied_weights(module, path, units)
    if config.offload.uses_tensor_manager:
        checks.check_parameter_dtypes(module, units, ctx.precision.compute_dtype, ctx.precision.precision)
    on_meta = stand_in_for_meta_parameters(module, units, config.offload.uses_tensor_manager)
    if config.offload.uses_tensor_manager:
        check_device(config, ctx.device, ctx.is_distributed)
    return ModelCut(config, layered, path, model_name(module, path), chain, units, on_meta)


def units_in_effect(ctx: SetupContext, config: RunConfig, blocks: int) -> RunConfig:
    """``config`` with ``layers_per_unit`` at most ``blocks`` (the model's): more cuts the same one unit of
    every block, so the number in effect is the one every later part of the run (the plans, their
    reports, the checkpoints) is given; said once here where the user's number is clamped."""
    if blocks < 1 or config.layers_per_unit <= blocks:
        return config
    ctx.report(f"greedysnake: layers_per_unit={config.layers_per_unit} on {blocks} block"
               f"{'s' if blocks != 1 else ''}: {blocks} in effect (one unit of all {blocks} block"
               f"{'s' if blocks != 1 else ''}; a unit cannot hold more blocks than the model has)")
    return dataclasses.replace(config, layers_per_unit=blocks)


class Run:
    """One fit's (or evaluation's) parts, built complete by :func:`open_run`, closed together by
    :meth:`close`. Owned by the training thread."""

    def __init__(self, cut: ModelCut, engine: WindowEngine, guard: NonFiniteGuard, planner: Planner | None,
                 directories: OffloadDirectories, *, checkpoints: CheckpointSeam = LIGHTNING,
                 placement: PlacementPlan | None = None, telemetry: StepRecorder | None = None,
                 timer: ComputeTimer | None = None, hand_back: HandBack | None = None) -> None:
        self.config = engine.config
        """The settings in effect: resolved once, at setup (a new one after the warm-step plan); the
        engine and the tensor manager were built from this object."""
        self.layered = cut.layered
        self.name = cut.name
        """The layered model as messages name it (:attr:`ModelCut.name`)."""
        self.store = engine.store
        self.engine = engine
        self.inputs = WindowInputs(cut.layered, cut.name)
        self.guard = guard
        self.checkpoints = checkpoints
        """How Lightning's checkpoint hooks save and load this run's state."""
        self.placement = placement
        """The placement planned at setup (``auto=True`` and a kind left unset; else None)."""
        self.telemetry = telemetry
        self.planner = planner
        """The run's planner, whose warm-step plan runs after the warm step (with the tensor manager; else
        None)."""
        self.directories = directories
        self.hand_back = hand_back
        """What the end of fit gives back (with the tensor manager; planned at setup)."""
        self.timer = timer
        """Times the compute ops into the tensor manager's compute lane (with the tensor manager; the
        engine's and the fused ops'), read once per window."""
        self.closed = False

    @property
    def tensor_manager(self) -> TieredTensorStore | None:
        return self.store if isinstance(self.store, TieredTensorStore) else None

    def apply(self, config: RunConfig) -> None:
        """The warm-step plan's settings, from the next window on (between windows): every part of the run
        takes them from this one object, the tensor manager (alpha, lag, the staging budget), the engine
        (recompute) and :attr:`config`."""
        if config is self.config:
            return
        manager = self.tensor_manager
        if manager is not None:
            manager.reconfigure(config.alpha, config.lag, config.offload)
        self.engine.replan(config)
        self.config = config

    def close(self, before_store: Callable[[TieredTensorStore], None] | None = None) -> None:
        """Close the engine, then (``before_store``: the hand-back of the trained state) the store, then
        clean up the offload directories; each step runs even when an earlier one raised. Idempotent."""
        if self.closed:
            return
        self.closed = True
        manager = self.tensor_manager
        try:
            self.engine.close()
            if before_store is not None and manager is not None and not manager.closed:
                before_store(manager)
        finally:
            try:
                self.store.close()
            finally:
                self.directories.cleanup(manager.files if manager is not None else [])


def open_run(ctx: SetupContext, before: BeforeSetup, module: nn.Module, cut: ModelCut,
             optimizer: torch.optim.Optimizer | None, clip: ClipPolicy) -> Run:
    """Plan (the run's :class:`Planner`, over what was planned ``before`` Lightning's setup), build and open
    the run over ``cut`` (after Lightning's own setup: ``optimizer`` is the one it configured, None outside
    fitting). With the tensor manager: the unit size and the placement planned, the manager made, connected
    to the ranks and opened in its prepared directories with the model's initial weights; otherwise the
    units stay on the device with rank 0's weights."""
    guard = NonFiniteGuard(cut.config.on_nonfinite, ctx.warn, loss_scaled=ctx.precision.loss_scaler is not None)
    if not cut.config.offload.uses_tensor_manager:
        if ctx.fitting and ctx.settings.optimizer_path != "auto":
            ctx.warn("optimizer_path", f"optimizer_path={ctx.settings.optimizer_path!r} is ignored: every kind of "
                     "tensor is on the device, so Lightning steps your optimizer as it is, on whole parameters (no "
                     "per-unit step). Fix: offload a kind (offload.optimizer_states='host', say) to use it, or leave "
                     "optimizer_path='auto'.")
        directories = OffloadDirectories(cut.config.offload, ctx.owner)
        if directories.given:  # (checked and reported all the same, though nothing goes there)
            reports = directories.prepare(ctx.default_root, [{} for _ in directories.dirs], ctx.global_rank,
                                          ctx.local_rank, ctx.is_distributed)
            ctx.report(directories.text(reports, empty_path_note(ctx.settings, cut.config, None)))
        try:
            ctx.broadcast_parameters([p for unit in cut.units for p in unit.parameters()])
            engine = WindowEngine(cut.chain, cut.units, cut.config, InMemoryTensorStore(), ctx.device,
                                  ctx.precision.forward_context, rng=TrainingRng(ctx.device, ctx.report))
        except BaseException:
            directories.cleanup([])
            raise
        return Run(cut, engine, guard, None, directories)
    shard = (ctx.global_rank, ctx.world_size) if ctx.is_distributed and cut.config.shard_state else None
    dtype, scaler = ctx.precision.compute_dtype, ctx.precision.loss_scaler
    speculative = step_mode(clip, loss_scaled=scaler is not None).speculative  # (fp16's second slots, planned)
    # how the optimizer is stepped, decided once, before any work (an optimizer no path steps exactly is refused)
    contract = optimizer_contract(optimizer, ctx.settings.optimizer_path, ctx.warn)
    # (the plans start from the settings in effect after the cut: its unit size, clamped to the blocks)
    before = dataclasses.replace(before, config=cut.config)
    planner = Planner(ctx, before, measurements_for(ctx, cut.chain, optimizer, contract, shard))
    planned = planner.plan_setup(cut.chain, optimizer, contract, dtype, shard, speculative=speculative,
                                 clip_norm=clip.defer)
    config = planned.config
    built_bytes = 0 if cut.on_meta else sum(p.numel() * p.element_size() for p in module.parameters())
    manager = new_tensor_manager(ctx, planned, module, optimizer, contract, clip, shard)
    try:
        planner.report_setup(planned, kinds_without_bytes(manager.placement))
        memory = HostMemory.of(planner.host_budget_bytes, built_bytes, manager, bounded=config.auto,
                               process_bytes=process_rss_bytes())  # (before the manager allocates anything)
        if config.auto:  # (a host budget was planned within: say what it covers, and what comes back)
            memory.tell(ctx.report, ctx.warn)
        directories = OffloadDirectories(config.offload, ctx.owner)
        open_tensor_manager(ctx, manager, directories, planned.units, cut.layered if cut.on_meta else None,
                            empty_path_note(ctx.settings, config, planned.placement))
    except BaseException:
        manager.close()
        raise
    telemetry = StepRecorder(manager)
    if ctx.fitting and config.trace_steps:
        telemetry.start_trace(config.trace_steps,
                              Path(config.trace_path or ctx.default_root / "greedysnake_trace.json"))
    lanes = manager.stats.lanes
    timer = compute_timer_for(ctx.device, lambda name, a, b: lanes.add("compute", a, b, name))
    engine = WindowEngine(cut.chain, planned.units, config, manager, ctx.device, ctx.precision.forward_context,
                          timer=timer, rng=TrainingRng(ctx.device, ctx.report))
    checkpoints = StreamedCheckpoints(manager.values, rank=ctx.global_rank, world=ctx.world_size,
                                      layered_prefix=f"{cut.path}." if cut.path else "",
                                      precision=str(ctx.precision.precision),
                                      aliases=parameter_aliases(module, [slot.name for lay in manager.values.layouts
                                                                         for slot in lay.params]))
    return Run(cut, engine, guard, planner, directories, checkpoints=checkpoints, placement=planned.placement,
               telemetry=telemetry, timer=timer,
               hand_back=ctx.broadcast(memory.hand_back))  # (rank 0's: gathering it back is collective)
