"""``auto=True`` after the first warm optimizer step (the second): plan the unset ones of alpha, lag, the
staging budget and recompute from this run's measurements, and apply the choice between windows."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_greedysnake.config import GreedySnakeConfig, Tier
from lightning_greedysnake.offload.preflight import disk_free_bytes
from lightning_greedysnake.offload.staging import staging_budget_of
from lightning_greedysnake.planner import Choice, Machine, PlanError, plan, predict
from lightning_greedysnake.planner.measure import disk_bandwidth, optimizer_rate, unit_costs, unit_times
from lightning_greedysnake.planner.plan import merge
from lightning_greedysnake.planner.unit_size import choose_unit_size, plans_by_size
from lightning_greedysnake.tensor_manager import TieredTensorStore

FIRST_STEP_SETTINGS = frozenset({"alpha", "lag", "recompute", "offload.buffer_budget_bytes"})
"""What the warm-step plan chooses when the user left it unset."""

PLAN_STEP = 2
"""The optimizer step whose compute the plan measures, and after which it runs: the first warm one. The
first step's compute runs slow (every staging buffer touched for the first time, each kernel's first
call): its backward took 1.4-1.5x a later step's on the 168M GPT at sequence 32 here, which made the
plan see compute bind where the disk did and underrate larger units. A run of fewer steps is not
planned (the settings in effect are kept)."""


def measured_machine(manager: TieredTensorStore, default_root: Path) -> tuple[Machine, str]:
    """The offload disks' O_DIRECT bandwidth (each path; units are striped round robin over them, so the
    slowest binds, once per path) and the element rate of the user's optimizer on the host. The probes
    are small (at most 16 MiB of file and buffer, 1M optimizer elements: 16 MiB) so that they fit the
    host budget too, and the disk's free space (:func:`probe_bytes`); the optimizer at the lane's threads. Raises ``OSError`` where a disk
    cannot be measured."""
    params = sum(lay.trainable_numel for lay in manager.layouts)
    rate = optimizer_rate(numel=min(1 << 20, max(1 << 16, params)), optimizer=manager.optimizer,
                          threads=manager.optimizer_threads)  # (at the threads the lane really gets)
    if not manager.config.uses_ssd:
        return Machine(math.inf, math.inf, rate), "no SSD tier"
    dirs = manager.offload_dirs or [default_root]
    per_path = [disk_bandwidth(d, nbytes=probe_bytes(d)) for d in dirs]
    read, write = len(dirs) * min(r for r, _ in per_path), len(dirs) * min(w for _, w in per_path)
    paths = ", ".join(f"{d}: read {r / 1e9:.2f} GB/s, write {w / 1e9:.2f} GB/s" for d, (r, w) in zip(dirs, per_path))
    return Machine(read, write, rate), paths


def probe_bytes(directory: Path, largest: int = 16 << 20) -> int:
    """The disk probe's size in ``directory``: ``largest``, or a quarter of the free space where that is
    less (the probe's scratch file must not fill a disk the run is using), in 64 KiB steps."""
    step = 64 << 10
    return max(step, min(largest, disk_free_bytes(directory) // 4 // step * step))


class WarmStepPlan:
    """Runs once, after optimizer step :data:`PLAN_STEP`, when ``auto=True`` left any of
    :data:`FIRST_STEP_SETTINGS` unset. Told of every step's end (:meth:`step_ended`)."""

    def __init__(self, settings: GreedySnakeConfig, host_budget_bytes: int) -> None:
        self.settings = settings
        self.host_budget_bytes = host_budget_bytes
        """The run's host budget, measured once at setup (:class:`~lightning_greedysnake.strategy.unit_plan.SetupPlan`)."""
        self.pending = settings.auto and bool(settings.unset() & FIRST_STEP_SETTINGS)
        self.choice: Choice | None = None
        self.machine: Machine | None = None
        """The disks and optimizer rate measured after the warm step."""
        self.steps = 0
        """Optimizer steps ended so far in this fit."""
        self.since = 0.0
        """``time.perf_counter()`` at the end of the step before the warm one: its compute is measured
        from here."""
        self.unit_seconds: tuple[list[float], list[float]] | None = None
        """The warm step's forward and backward seconds per micro-batch of each unit, as planned with."""

    def step_ended(self) -> bool:
        """An optimizer step ended: whether the plan is due now (it runs once)."""
        if not self.pending:
            return False
        self.steps += 1
        if self.steps < PLAN_STEP:
            self.since = time.perf_counter()
            return False
        return True

    def run(self, manager: TieredTensorStore, activation_bytes: dict[int, int], config: GreedySnakeConfig, k: int,
            default_root: Path, broadcast: Callable[[Any], Any], report: Callable[[str], None]) -> GreedySnakeConfig:
        """Measure, plan (every rank runs rank 0's choice), reconfigure ``manager``; returns the config
        in effect from the next window on (its ``recompute`` is the engine's)."""
        self.pending = False
        manager.drain()
        unset = self.settings.unset()
        try:
            machine, disks = measured_machine(manager, default_root)
        except OSError as e:  # (a full disk, say: every rank still takes rank 0's word below)
            machine, disks = None, f"the offload disk could not be measured: {e}"
        self.machine = machine
        fwd, bwd = self.unit_seconds = unit_times(manager.stats.lanes.spans(self.since, float("inf")),
                                                  manager.num_units)
        costs = unit_costs(manager, fwd, bwd, activation_bytes)
        budget = self.host_budget_bytes - manager.arena.regions.host_bytes()
        explicit_budget = None if "offload.buffer_budget_bytes" in unset else config.offload.buffer_budget_bytes
        lags = (0, 1, 2) if "lag" in unset else (config.lag,)
        if explicit_budget is not None:  # only the lags whose must-run staging fits the budget given
            device_tier = manager.copies is not None
            lags = tuple(lag for lag in lags
                         if staging_budget_of(manager.state, manager.config, lag, device_tier).minimum_bytes
                         <= explicit_budget)
        options: dict[str, Any] = {
            "alphas": tuple(a / 20 for a in range(11)) if "alpha" in unset else (config.alpha,),
            "lags": lags or (config.lag,),
            "recompute": (True, False) if "recompute" in unset else (config.recompute,),
            "checkpoint_placements": ("ssd" if manager.activations.tier is Tier.SSD else "host",),
            "prefetch_units": manager.config.prefetch_units}
        try:
            choice: Choice | str = disks if machine is None else plan(
                costs, machine, k, budget, manager.checkpoint_bytes, layers_per_unit=(1,), **options)
        except PlanError as e:
            choice = str(e)
        choice = broadcast(choice)  # rank 0's, a choice or why there is none: every rank does the same
        if isinstance(choice, str):
            report(f"greedysnake auto plan: keeping the settings in effect ({choice})")
            return config
        self.choice = choice
        if machine is None:  # (this rank could not measure; rank 0 could: its choice stands)
            machine = self.machine = Machine(math.inf, math.inf, math.inf)
        staging = explicit_budget if explicit_budget is not None else choice.buffer_budget_bytes
        manager.reconfigure(choice.alpha, choice.lag, staging)
        if choice.recompute != config.recompute:
            config = dataclasses.replace(config, recompute=choice.recompute)
        config = dataclasses.replace(config, alpha=choice.alpha, lag=choice.lag)
        bound = predict(costs, machine, config.schedule.value, k).bound
        report(f"greedysnake auto plan ({disks}; optimizer {machine.optimizer_elements_per_s / 1e6:.0f} M "
               f"elements/s; planned: {', '.join(sorted(unset & FIRST_STEP_SETTINGS))}):\n{choice.table()}\n"
               f"{'binding resource':<22}{bound:>20}")
        larger = self.larger_units(costs, machine, k, budget, manager, config.layers_per_unit, options)
        if larger is not None:
            report(larger_units_note(*larger))
        return config

    def larger_units(self, costs: list, machine: Machine, k: int, budget: int, manager: TieredTensorStore,
                     lpu: int, options: dict[str, Any]) -> tuple[Choice, Choice] | None:
        """Whether units of several of this run's (``lpu`` blocks each) are faster with this step's
        measured compute, by setup's model and rule (:mod:`~lightning_greedysnake.planner.unit_size`;
        setup, which sees no batch, chose from the disks alone), over the same ``options``: the plan of
        the size chosen and of this one's. None where this one stays, and when the user set ``layers_per_unit``."""
        sizes = [n for n in (1, 2, 4, 8) if n * lpu <= 8 and n <= len(costs)]
        if self.settings.layers_per_unit is not None or len(sizes) < 2:
            return None
        plans = plans_by_size({n * lpu: (merge(costs, n), machine) for n in sizes}, k, budget,
                              manager.checkpoint_bytes, **options)
        if lpu not in plans:
            return None
        chosen = choose_unit_size(plans)
        return None if chosen == lpu else (plans[chosen], plans[lpu])


def larger_units_note(best: Choice, current: Choice) -> str:
    """The report's suggestion of larger units for the next run."""
    lpu = best.layers_per_unit
    return (f"greedysnake: larger units are faster here: layers_per_unit={lpu} is predicted at {best.step_s:.3f} s a "
            f"step against {current.step_s:.3f} s (its last unit recomputes nothing; staging "
            f"{best.buffer_budget_bytes:,} bytes). Set layers_per_unit={lpu} for the next run (a run keeps the unit "
            "size its files were laid out in).")
