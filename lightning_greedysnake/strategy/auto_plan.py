"""``auto=True`` after the first optimizer step: plan the unset ones of alpha, lag, the staging budget and
recompute from this run's measurements, and apply the choice between windows."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_greedysnake.config import GreedySnakeConfig, Tier
from lightning_greedysnake.offload.staging import min_budget_bytes
from lightning_greedysnake.planner import Choice, Machine, PlanError, plan, predict
from lightning_greedysnake.planner.measure import disk_bandwidth, optimizer_rate, unit_costs, unit_times
from lightning_greedysnake.strategy.placement import host_budget_bytes
from lightning_greedysnake.tensor_manager import TieredTensorStore

FIRST_STEP_SETTINGS = frozenset({"alpha", "lag", "recompute", "offload.buffer_budget_bytes"})
"""What the first-step plan chooses when the user left it unset."""


def measured_machine(manager: TieredTensorStore, default_root: Path) -> tuple[Machine, str]:
    """The offload disks' O_DIRECT bandwidth (each path; units are striped round robin over them, so the
    slowest binds, once per path) and the element rate of the user's optimizer on the host. The probes
    are small (at most 16 MiB of file and buffer, 1M optimizer elements: 16 MiB) so that they fit the
    host budget too."""
    params = sum(lay.trainable_numel for lay in manager.layouts)
    rate = optimizer_rate(numel=min(1 << 20, max(1 << 16, params)), optimizer=manager.optimizer)
    if not manager.config.uses_ssd:
        return Machine(math.inf, math.inf, rate), "no SSD tier"
    probe = 16 << 20
    dirs = manager.offload_dirs or [default_root]
    per_path = [disk_bandwidth(d, nbytes=probe) for d in dirs]
    read, write = len(dirs) * min(r for r, _ in per_path), len(dirs) * min(w for _, w in per_path)
    paths = ", ".join(f"{d}: read {r / 1e9:.2f} GB/s, write {w / 1e9:.2f} GB/s" for d, (r, w) in zip(dirs, per_path))
    return Machine(read, write, rate), paths


LARGER_UNITS_GAIN = 0.05
"""How much faster (a fraction of the step) larger units must be predicted for the first-step plan to
suggest them for the next run."""


class FirstStepPlan:
    """Runs once, after the first optimizer step, when ``auto=True`` left any of
    :data:`FIRST_STEP_SETTINGS` unset."""

    def __init__(self, settings: GreedySnakeConfig, local_processes: int) -> None:
        self.settings = settings
        self.local_processes = local_processes
        self.pending = settings.auto and bool(settings.unset() & FIRST_STEP_SETTINGS)
        self.choice: Choice | None = None

    def run(self, manager: TieredTensorStore, activation_bytes: dict[int, int], config: GreedySnakeConfig, k: int,
            default_root: Path, broadcast: Callable[[Any], Any], report: Callable[[str], None]) -> GreedySnakeConfig:
        """Measure, plan (every rank runs rank 0's choice), reconfigure ``manager``; returns the config
        in effect from the next window on (its ``recompute`` is the engine's)."""
        self.pending = False
        manager.drain()
        unset = self.settings.unset()
        machine, disks = measured_machine(manager, default_root)
        fwd, bwd = unit_times(manager.stats.lanes.spans(0.0, float("inf")), manager.num_units)
        costs = unit_costs(manager, fwd, bwd, activation_bytes)
        budget = host_budget_bytes(self.settings, self.local_processes) - manager.arena.host_bytes()
        explicit_budget = None if "offload.buffer_budget_bytes" in unset else config.offload.buffer_budget_bytes
        lags = (0, 1, 2) if "lag" in unset else (config.lag,)
        if explicit_budget is not None:  # only the lags whose must-run staging fits the budget given
            lags = tuple(lag for lag in lags if min_budget_bytes(manager.state, manager.config, lag) <= explicit_budget)
        options: dict[str, Any] = {
            "alphas": tuple(a / 20 for a in range(11)) if "alpha" in unset else (config.alpha,),
            "lags": lags or (config.lag,),
            "recompute": (True, False) if "recompute" in unset else (config.recompute,),
            "checkpoint_placements": ("ssd" if manager.activations.tier is Tier.SSD else "host",)}
        try:
            choice: Choice | str = plan(costs, machine, k, budget, manager.checkpoint_bytes, layers_per_unit=(1,),
                                        **options)
        except PlanError as e:
            choice = str(e)
        choice = broadcast(choice)  # rank 0's, a choice or why there is none: every rank does the same
        if isinstance(choice, str):
            report(f"greedysnake auto plan: keeping the settings in effect ({choice})")
            return config
        self.choice = choice
        staging = explicit_budget if explicit_budget is not None else choice.buffer_budget_bytes
        manager.reconfigure(choice.alpha, choice.lag, staging)
        if choice.recompute != config.recompute:
            config = dataclasses.replace(config, recompute=choice.recompute)
        config = dataclasses.replace(config, alpha=choice.alpha, lag=choice.lag)
        bound = predict(costs, machine, config.schedule.value, k).bound
        report(f"greedysnake auto plan ({disks}; optimizer {machine.optimizer_elements_per_s / 1e6:.0f} M "
               f"elements/s; planned: {', '.join(sorted(unset & FIRST_STEP_SETTINGS))}):\n{choice.table()}\n"
               f"{'binding resource':<22}{bound:>20}"
               + self.larger_units(costs, machine, k, budget, manager, choice, config.layers_per_unit, options))
        return config

    def larger_units(self, costs: list, machine: Machine, k: int, budget: int, manager: TieredTensorStore,
                     choice: Choice, lpu: int, options: dict[str, Any]) -> str:
        """A note for the next run when units of several of this run's (``lpu`` blocks each) are predicted
        :data:`LARGER_UNITS_GAIN` faster with this step's measured compute, over the same ``options``
        (setup, which sees no batch, chose the size from the disks alone, and the files are shaped by
        it now). Empty otherwise, and when the user set ``layers_per_unit``."""
        sizes = tuple(n for n in (2, 4, 8) if n * lpu <= 8 and n <= len(costs))
        if self.settings.layers_per_unit is not None or not sizes:
            return ""
        try:
            best = plan(costs, machine, k, budget, manager.checkpoint_bytes, layers_per_unit=sizes, **options)
        except PlanError:
            return ""
        if best.step_s > choice.step_s * (1 - LARGER_UNITS_GAIN):
            return ""
        return (f"\nlarger units would be faster here: layers_per_unit={best.layers_per_unit * lpu} is predicted at "
                f"{best.step_s:.3f} s a step against {choice.step_s:.3f} s (its last unit recomputes nothing; "
                f"staging {best.buffer_budget_bytes:,} bytes). The files are shaped by the unit size: set it for "
                "the next run.")
