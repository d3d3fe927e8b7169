"""The run's one planner (:class:`Planner`): at setup the device plan, the host budget, the unit size, the
placement and the saved activations' tier; after the first warm optimizer step (the second) the
unset ones of alpha, lag, the staging budget and recompute, from this run's measurements, applied between
windows. The arithmetic is :mod:`lightning_greedysnake.planner`'s; this module measures, broadcasts rank
0's decisions and reports them."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_greedysnake.config import REGION_KINDS, RunConfig, TensorKind, Tier
from lightning_greedysnake.models import LayerChain, make_units
from lightning_greedysnake.offload.activations import ActivationTierPlan
from lightning_greedysnake.optim.contract import OptimizerContract
from lightning_greedysnake.optim.unit_optimizer import construct_like
from lightning_greedysnake.planner import Choice, Machine, PlanError, UnitCost, plan, predict
from lightning_greedysnake.planner.measure import probe_numel, unit_times
from lightning_greedysnake.planner.plan import ALPHAS, merge
from lightning_greedysnake.planner.roofline import traffic
from lightning_greedysnake.planner.setup import ACTIVATION_SHARE, SetupInputs, lag_in_effect, plan_setup
from lightning_greedysnake.planner.staging import staging_budget
from lightning_greedysnake.planner.unit_size import (
    CANDIDATES,
    choose_unit_size,
    machine_at,
    plans_by_size,
    requests,
    table,
)
from lightning_greedysnake.strategy.planning.device import device_budget_bytes, plan_device
from lightning_greedysnake.strategy.planning.measurements import Measurements, probe_directory
from lightning_greedysnake.strategy.planning.placement import (
    budget_error,
    candidate_layouts,
    host_budget_bytes,
    placed_config,
    sized,
    unit_costs,
)
from lightning_greedysnake.strategy.report import TERMS
from lightning_greedysnake.strategy.setup_context import SetupContext, SetupPlan
from lightning_greedysnake.tensor_manager import TieredTensorStore

FIRST_STEP_SETTINGS = frozenset({"alpha", "lag", "recompute", "offload.buffer_budget_bytes"})
"""What the warm-step plan chooses when the user left it unset."""

PLAN_STEP = 2
"""The optimizer step whose compute the plan measures, and after which it runs: the first warm one. The
first step's compute runs slow (every staging buffer touched for the first time, each kernel's first
call) and would make the plan see compute bind where the disk does. A run of fewer steps is not planned
(the settings in effect are kept)."""


@dataclass(frozen=True)
class BeforeSetup:
    """What is planned before Lightning's own setup places the model (:func:`plan_before_setup`)."""

    config: RunConfig
    """The settings in effect before the tensor manager's plan: the device plan's (every kind on the GPU
    where it all fits)."""
    host_budget_bytes: int
    """The run's host budget, measured once (rank 0's): every plan of the run (the unit size, the
    placement, the saved activations' tier, the warm-step plan) is made within this one number, not within
    the memory available when each runs (which the run itself lowers)."""


def plan_before_setup(ctx: SetupContext, module: nn.Module) -> BeforeSetup:
    """The device plan and the run's host budget, from what setup reads and the LightningModule."""
    config = plan_device(ctx.settings, module, ctx.device, simulated=ctx.simulated,
                         loss_scaling=ctx.precision.loss_scaler is not None, broadcast=ctx.broadcast,
                         report=ctx.report).resolved()
    return BeforeSetup(config, ctx.broadcast(host_budget_bytes(ctx.settings, ctx.local_processes)))


def measurements_for(ctx: SetupContext, chain: LayerChain, optimizer: Any, contract: OptimizerContract,
                     shard: tuple[int, int] | None) -> Measurements:
    """The run's measurements of its machine (taken when a plan first asks): the optimizer's rate on a
    probe sized by the model's trainable elements (this rank's share), the offload paths' disks."""
    settings = ctx.settings
    params = sum(p.numel() for m in (*chain.pre_modules, *chain.blocks, *chain.post_modules)
                 for p in m.parameters() if p.requires_grad) // (shard[1] if shard else 1)
    make = None if optimizer is None else functools.partial(_like, optimizer)
    return Measurements(make, probe_numel(params), contract.probe_shape, ctx.optimizer_threads,
                        not ctx.device_tier,
                        [probe_directory(p, ctx.default_root) for p in (settings.offload.paths or [None])],
                        settings.offload)


def _like(optimizer: Any, params: list[Any]) -> Any:
    """The user's optimizer class over ``params`` with its first group's settings, configured as it is."""
    return construct_like(optimizer, [{**{k: v for k, v in optimizer.param_groups[0].items() if k != "params"},
                                       "params": params}])


class Planner:
    """The run's one planner with the tensor manager, built complete at setup from what setup reads
    (:class:`SetupContext`), what was planned before Lightning's setup (:class:`BeforeSetup`: the device
    plan, :attr:`config`, and the run's host budget, :attr:`host_budget_bytes`) and the run's measurements.
    Two entry points: :meth:`plan_setup` (the unit size, the placement, the saved activations' tier), and the
    warm step (:meth:`step_ended`, then :meth:`plan_warm_step` once, after optimizer step :data:`PLAN_STEP`,
    when ``auto=True`` left any of :data:`FIRST_STEP_SETTINGS` unset)."""

    def __init__(self, ctx: SetupContext, before: BeforeSetup, measurements: Measurements) -> None:
        self.ctx = ctx
        self.config = before.config
        self.host_budget_bytes = before.host_budget_bytes
        self.measurements = measurements
        """The run's measurements of its machine (the optimizer's rate, the disks), each taken at the
        first plan that asks (setup's unit-size plan or the warm step's) and kept."""
        self.pending = ctx.settings.auto and bool(ctx.settings.unset() & FIRST_STEP_SETTINGS)
        """The warm-step plan is still to run."""
        self.steps, self.since = 0, 0.0
        """Optimizer steps ended in this fit; ``perf_counter()`` at the end of the one before the warm one."""
        self.choice: Choice | None = None
        """The warm-step plan's choice, :attr:`machine` what it measured (the disks, the optimizer's rate)
        and :attr:`unit_seconds` each unit's forward and backward seconds a micro-batch."""
        self.machine: Machine | None = None
        self.unit_seconds: tuple[list[float], list[float]] | None = None
        self.warm_step_s: float | None = None
        """The warm step's wall time (from the end of the step before it to its own end), beside which the
        warm-step plan prints its prediction."""

    # -- at setup -------------------------------------------------------------------------------------
    def plan_setup(self, chain: LayerChain, optimizer: Any, contract: OptimizerContract, dtype: torch.dtype,
                   shard: tuple[int, int] | None, *, speculative: bool, clip_norm: bool) -> SetupPlan:
        """``layers_per_unit``, the placement of the unset kinds for units of that size, the first window's
        lag and order: rank 0 sizes each candidate (the user's or ``auto=False``'s size the only one) and
        plans in one call (:func:`~lightning_greedysnake.planner.setup.plan_setup`, on the run's
        measurements), and every rank runs its plan (:meth:`report_setup` prints the placement once the
        tensor manager is laid out); and the saved activations' share. ``speculative``: fp16's two slots of
        the kinds a step rewrites; ``contract``: how ``optimizer`` is stepped (its state slots, its
        layout's cuts)."""
        ctx, settings, budget, fixed = self.ctx, self.ctx.settings, self.host_budget_bytes, self.config
        sizes = ([c for c in CANDIDATES if c <= max(1, len(chain.blocks))]
                 if settings.auto and settings.layers_per_unit is None else [fixed.layers_per_unit])
        planned = settings.offload.unset() & set(REGION_KINDS) if settings.auto else frozenset()
        # what the placement may put on the device: with the weights unset, the device budget (rank 0's: the
        # GPUs' free memory differs), measured now that Lightning has moved the rest of the model there
        planned_weights = ctx.device_tier and TensorKind.WEIGHTS in planned
        device_budget = ctx.broadcast(device_budget_bytes(settings, ctx.device) if planned_weights else None)
        # (every rank lays each size out: a layout it cannot make is refused on every rank, none waits below)
        layouts = candidate_layouts(settings, chain, optimizer, contract, dtype, shard, sizes)
        result: Any = None
        if ctx.global_rank == 0:  # (every rank runs rank 0's plan, or raises its error: none waits in the broadcast)
            try:
                choice = plan_setup(SetupInputs(
                    {lpu: sized(state, fixed, planned, speculative=speculative, device_tier=ctx.device_tier,
                                device_budget=device_budget)
                     for lpu, state in layouts.items()},
                    frozenset(kind.value for kind in planned), budget, ctx.accumulate, fixed.lag, settings.lag is None,
                    fixed.alpha or 0.0, fixed.schedule.value, settings.auto and settings.schedule is None
                    and not ctx.device_tier, clip_norm, fixed.offload.prefetch_units,
                    fixed.offload.buffer_budget_bytes,
                ), self.measurements)
                result = choice, placed_config(settings, fixed, layouts[choice.layers_per_unit], choice)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                result = e
        result = ctx.broadcast(result)
        if isinstance(result, Exception):
            raise result
        choice, config = result
        if choice.fallback is not None:
            ctx.report(f"greedysnake: {choice.fallback}")
        if choice.refused_staging_bytes is not None:
            raise ValueError(budget_error(settings, budget, choice.refused_staging_bytes, choice.lag))
        if (scores := choice.scores) is not None:
            ctx.report("greedysnake unit size (auto=True; set layers_per_unit to fix it: unit sizes agree up to "
                       "rounding, not bit for bit, and this choice rests on a measurement): each candidate placed "
                       "within the host budget, its step predicted by the roofline from the disk's speed at its "
                       f"request sizes, without compute (setup sees no batch) {TERMS}\n"
                       + table(scores.plans, scores.machines, scores.ssd_bytes, choice.layers_per_unit, scores.probed))
        activations = (ActivationTierPlan(budget // ACTIVATION_SHARE, ctx.report)
                       if settings.auto and settings.offload.activations is None else None)
        units = make_units(chain, config.layers_per_unit)
        if settings.lag is not None and config.lag < settings.lag:  # (the clamp: planner.setup.lag_in_effect)
            ctx.report(f"greedysnake: lag={settings.lag} on {len(units)} unit{'s' if len(units) != 1 else ''}: "
                       f"{config.lag} in effect (the optimizer lane holds at most one step per unit, so a deeper "
                       f"lag waits no less; staging is sized for lag {config.lag})")
        note = (None if config.schedule is fixed.schedule else
                "greedysnake schedule: horizontal (auto=True: every kind is in host memory, so nothing moves per "
                "micro-batch and one micro-batch's activations are held at a time, as in Lightning; set "
                "schedule=vertical to fix it)")
        return SetupPlan(config, choice.placement, units, activations, note)

    def report_setup(self, planned: SetupPlan, notes: dict[str, str]) -> None:
        """Say the setup plan once the tensor manager is laid out: the placement table (``notes``: the kinds
        that keep no bytes where placed, and why, in the words of the offload directory's breakdown:
        :func:`~lightning_greedysnake.strategy.report.kinds_without_bytes`), then the planned schedule."""
        if planned.placement is not None:
            self.ctx.report(f"greedysnake placement plan (auto=True; set auto=False or a kind's placement to fix it) "
                            f"{TERMS}:\n" + planned.placement.table(notes))
        if planned.schedule_note is not None:
            self.ctx.report(planned.schedule_note)

    # -- after the warm step --------------------------------------------------------------------------
    def step_ended(self) -> bool:
        """An optimizer step ended: whether the warm-step plan is due now (it runs once)."""
        if not self.pending:
            return False
        self.steps += 1
        if self.steps < PLAN_STEP:
            self.since = time.perf_counter()
            return False
        self.warm_step_s = time.perf_counter() - self.since
        return True

    def plan_warm_step(self, manager: TieredTensorStore, activation_bytes: dict[int, int],
                       config: RunConfig) -> RunConfig:
        """Measure, plan the unset ones of :data:`FIRST_STEP_SETTINGS` (every rank runs rank 0's choice);
        returns the config in effect from the next window on, with the staging budget chosen (``config``
        itself where nothing was planned), which :meth:`Run.apply` gives every part of the run."""
        ctx, k = self.ctx, self.ctx.accumulate
        self.pending = False
        warm = config  # (the settings the warm step ran with)
        manager.drain()
        unset = ctx.settings.unset()
        fwd, bwd = self.unit_seconds = unit_times(manager.stats.lanes.spans(self.since, float("inf")),
                                                  manager.num_units)
        costs = unit_costs(manager, fwd, bwd, activation_bytes)
        try:
            machine, disks = self.measured_machine(manager, costs, config)
        except OSError as e:  # (a full disk, say: every rank still takes rank 0's word below)
            machine, disks = None, f"the offload disk could not be measured: {e}"
        self.machine = machine
        budget = self.host_budget_bytes - manager.placement.host_bytes()
        explicit_budget = None if "offload.buffer_budget_bytes" in unset else config.offload.buffer_budget_bytes
        lags = (tuple(sorted({lag_in_effect(lag, manager.num_units) for lag in (0, 1, 2)})) if "lag" in unset
                else (config.lag,))
        if explicit_budget is not None:  # only the lags whose must-run staging fits the budget given
            lags = tuple(lag for lag in lags if staging_budget(
                [u.staging() for u in costs], lag, manager.config.prefetch_units).minimum_bytes <= explicit_budget)
        options: dict[str, Any] = {
            "alphas": ALPHAS if "alpha" in unset else (config.alpha,),
            "lags": lags or (config.lag,),
            "recompute": (True, False) if "recompute" in unset else (config.recompute,),
            "activation_placements": ("ssd" if manager.activations.tier is Tier.SSD else "host",),
            # kept graphs' saved tensors may go to SSD where saved activations are there, or may go (left to plan),
            # and the disk was measured (with nothing else on SSD it was not: an unmeasured disk would look free)
            "graphs_on_ssd": machine is not None and math.isfinite(machine.read_bytes_per_s) and (
                manager.activations.tier is Tier.SSD or (bool(manager.offload_dirs) and "offload.activations" in unset
                                                          and manager.activations.tier is Tier.HOST)),
            "prefetch_units": manager.config.prefetch_units, "schedule": config.schedule.value}
        try:
            choice: Choice | str = disks if machine is None else plan(
                costs, machine, k, budget, manager.unit_input_bytes, layers_per_unit=config.layers_per_unit, **options)
        except PlanError as e:
            choice = str(e)
        choice = ctx.broadcast(choice)  # rank 0's, a choice or why there is none: every rank does the same
        if isinstance(choice, str):
            ctx.report(f"greedysnake auto plan: keeping the settings in effect ({choice})")
            return config
        self.choice = choice
        if machine is None:  # (this rank could not measure; rank 0 could: its choice stands)
            machine = self.machine = Machine(math.inf, math.inf, math.inf)
        staging = explicit_budget if explicit_budget is not None else choice.buffer_budget_bytes
        # (kept graphs with their saved tensors on SSD: the saved activations' tier says so to the engine and the store)
        kept_on_ssd = {"activations": Tier.SSD} if not choice.recompute and choice.activations == "ssd" else {}
        config = dataclasses.replace(config, alpha=choice.alpha, lag=choice.lag, recompute=choice.recompute,
                                     offload=dataclasses.replace(config.offload, buffer_budget_bytes=staging,
                                                                 **kept_on_ssd))
        bound = predict(costs, machine, config.schedule.value, k).bound
        inline = (f", {machine.inline_rate / 1e6:.0f} M on the training thread"
                  if machine.inline_optimizer_elements_per_s else "")
        ctx.report(f"greedysnake auto plan ({disks}; optimizer {machine.optimizer_elements_per_s / 1e6:.0f} M "
                   f"elements/s on the lane{inline}; planned: {', '.join(sorted(unset & FIRST_STEP_SETTINGS))}) "
                   f"{TERMS}:\n{choice.table()}\n{'binding resource':<22}{bound:>20}"
                   + self.measured_step(costs, machine, budget, manager.unit_input_bytes, warm, options, choice))
        larger = self.larger_units(costs, machine, budget, manager.unit_input_bytes, config.layers_per_unit, options)
        if larger is not None:  # (the files are laid out by the unit size: a run keeps its own)
            (best, current), lpu = larger, larger[0].layers_per_unit
            ctx.report(f"greedysnake: larger units are faster here: layers_per_unit={lpu} is predicted at "
                       f"{best.step_s:.3f} s a step against {current.step_s:.3f} s (its last unit recomputes "
                       f"nothing; staging {best.buffer_budget_bytes:,} bytes). Set layers_per_unit={lpu} for the "
                       "next run (a run keeps the unit size its files were laid out in).")
        return config

    def measured_machine(self, manager: TieredTensorStore, costs: list[UnitCost],
                         config: RunConfig) -> tuple[Machine, str]:
        """The machine the warm step's units see, from the run's measurements (setup's, where its plan took
        them; else taken now) by setup's model (:func:`~lightning_greedysnake.planner.unit_size.machine_at`:
        the disks at these units' request sizes, weighted by the bytes each kind moves a step), with the
        words the report says the disks in. Raises ``OSError`` where a disk cannot be measured."""
        measured = self.measurements
        lane, inline = measured.rates
        if not manager.config.uses_ssd:
            return Machine(math.inf, math.inf, lane, inline, measured.shared), "no SSD tier"
        said = "setup's probe" if measured.disk_measured else "probed now"
        bandwidth = measured.disk(requests(costs, manager.state.num_slots))
        schedule = config.schedule.value
        moved = traffic(costs, schedule, self.ctx.accumulate, clip_norm=manager.clip.defer)
        machine = dataclasses.replace(machine_at(costs, moved, bandwidth, lane, manager.state.num_slots),
                                      inline_optimizer_elements_per_s=inline, shared_cores=measured.shared)
        return machine, f"disk ({measured.where}): {machine.disk}, {said}"

    def measured_step(self, costs: list[UnitCost], machine: Machine, budget: int, unit_input_bytes: int,
                      warm: RunConfig, options: dict[str, Any], choice: Choice) -> str:
        """The warm step's measured wall time, for the report beside the plan's predicted step; where the
        warm step ran with other settings than the plan's, the roofline's prediction for those too (the one
        to compare it with)."""
        if self.warm_step_s is None:
            return ""
        line = f"\n{'measured step (s)':<22}{self.warm_step_s:>20.3f}"
        ran = {"alpha": warm.alpha, "lag": warm.lag, "recompute": warm.recompute}
        if ran == {"alpha": choice.alpha, "lag": choice.lag, "recompute": choice.recompute}:
            return line + f"\n  (step {PLAN_STEP}, the warm one, wall time; it ran with the settings above)"
        settings = ", ".join(f"{name} {value}" for name, value in ran.items())
        try:
            same = plan(costs, machine, self.ctx.accumulate, budget, unit_input_bytes,
                        layers_per_unit=warm.layers_per_unit, **{**options, "alphas": (warm.alpha,),
                                                                 "lags": (warm.lag,), "recompute": (warm.recompute,)})
            predicted = f": the roofline predicts {same.step_s:.3f} s for those"
        except PlanError:
            predicted = ""
        return line + (f"\n  (step {PLAN_STEP}, the warm one, wall time; it ran with {settings}{predicted}; the "
                       "settings above apply from the next step)")

    def larger_units(self, costs: list[UnitCost], machine: Machine, budget: int, unit_input_bytes: int, lpu: int,
                     options: dict[str, Any]) -> tuple[Choice, Choice] | None:
        """Whether units of several of this run's (``lpu`` blocks each) are faster with the warm step's
        measured compute, by setup's model and rule (:mod:`~lightning_greedysnake.planner.unit_size`;
        setup, which sees no batch, chose from the disks alone), over the same ``options``: the plans of
        the size chosen and of this one. None where this one stays, and when the user set ``layers_per_unit``."""
        sizes = [n for n in CANDIDATES if n * lpu <= CANDIDATES[-1] and n <= len(costs)]
        if self.ctx.settings.layers_per_unit is not None or len(sizes) < 2:
            return None
        plans = plans_by_size({n * lpu: (merge(costs, n), machine) for n in sizes}, self.ctx.accumulate, budget,
                              unit_input_bytes, **options)
        if lpu not in plans:
            return None
        chosen = choose_unit_size(plans)
        return None if chosen == lpu else (plans[chosen], plans[lpu])
