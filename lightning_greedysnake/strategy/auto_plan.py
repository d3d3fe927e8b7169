"""``auto=True``: plan alpha, lag, the staging budget and recompute from the run's first optimizer step,
and apply the choice between windows."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_greedysnake.config import GreedySnakeConfig, Tier
from lightning_greedysnake.planner import Choice, Machine, plan
from lightning_greedysnake.planner.measure import disk_bandwidth, optimizer_rate, unit_costs, unit_times
from lightning_greedysnake.tensor_manager import TieredTensorStore


def auto_plan(manager: TieredTensorStore, activation_bytes: dict[int, int], config: GreedySnakeConfig, k: int,
              default_root: Path, broadcast: Callable[[Any], Any]) -> tuple[Choice, GreedySnakeConfig, str]:
    """Measure the offload disk and the optimizer, take each unit's compute time from the steps so far,
    plan (every rank runs rank 0's choice) and reconfigure ``manager``. Returns the choice, the config
    with its ``recompute`` (for the engine, from the next window on) and a report."""
    manager.drain()
    probe_dir = manager.offload_dir or default_root
    read_bps, write_bps = disk_bandwidth(probe_dir, nbytes=64 << 20)
    fwd, bwd = unit_times(manager.stats.lanes.spans(0.0, float("inf")), manager.num_units)
    costs = unit_costs(manager, fwd, bwd, activation_bytes)
    budget = config.auto_host_budget_bytes or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 4
    placement = "ssd" if config.offload.checkpoints is Tier.SSD else "host"
    choice = plan(costs, Machine(read_bps, write_bps, optimizer_rate()), k, int(budget),
                  manager.checkpoint_bytes, layers_per_unit=(1,),  # costs are per current unit
                  checkpoint_placements=(placement,))
    choice = broadcast(choice)  # every rank must run the same schedule and lane
    manager.reconfigure(choice.alpha, choice.lag, choice.buffer_budget_bytes)
    if choice.recompute != config.recompute:
        config = dataclasses.replace(config, recompute=choice.recompute)
    report = (f"greedysnake auto plan (SSD read {read_bps / 1e9:.2f} GB/s, write {write_bps / 1e9:.2f} GB/s):\n"
              + choice.table())
    return choice, config, report
