"""Setup's unit-size candidates (:mod:`lightning_greedysnake.planner.unit_size`: the model and the rule):
each gets its own placement plan within the host budget; the offload disks are measured at the
candidates' request sizes (at most 64 MiB of scratch file), and the optimizer's rate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lightning_greedysnake.config import REGION_KINDS, GreedySnakeConfig
from lightning_greedysnake.layout import StateLayout
from lightning_greedysnake.models import LayerChain, make_units
from lightning_greedysnake.planner.measure import interpolate, optimizer_rate, paths_bandwidth, probe_numel, probe_sizes
from lightning_greedysnake.planner.plan import Choice
from lightning_greedysnake.planner.roofline import Machine, Traffic, UnitCost, traffic
from lightning_greedysnake.planner.unit_size import CANDIDATES, Bandwidth, machine_at, plans_by_size, requests
from lightning_greedysnake.strategy.planning.device import DeviceSide
from lightning_greedysnake.strategy.planning.placement import place_kinds, placed_config, planned_costs
from lightning_greedysnake.optim.contract import OptimizerContract
from lightning_greedysnake.tensor_manager import state_format_for, state_layout


def probe_directory(setting: str | None, default_root: Path) -> Path:
    """Where to measure the disk of an offload path before it exists: its nearest existing ancestor
    (a directory about to be created lives on that one's filesystem)."""
    path = Path(setting.format(rank=0, local_rank=0)) if setting else default_root / "greedysnake_offload"
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return candidate
    return Path.cwd()


def candidate_layouts(settings: GreedySnakeConfig, chain: LayerChain, optimizer: torch.optim.Optimizer | None,
                      contract: OptimizerContract, dtype: torch.dtype, shard: tuple[int, int] | None
                      ) -> dict[int, StateLayout]:
    """Each candidate's state layout (the optimizer's state format found once)."""
    fmt = state_format_for(optimizer, contract.slots, settings.offload.optimizer_state_dtype, shard,
                           contract.whole_parameters)
    sizes = [c for c in CANDIDATES if c <= len(chain.blocks)]
    return {c: state_layout(make_units(chain, c), {}, optimizer, settings.offload, dtype, shard, contract, fmt)
            for c in sizes}



@dataclass(frozen=True)
class Candidate:
    """One unit size, placed: what :func:`score_candidates` scores."""

    costs: list[UnitCost]
    """Its units' costs (compute unknown at setup)."""
    traffic: Traffic
    """Their SSD bytes a step."""
    slots: int
    """The state's slots (requests per region: :func:`requests`)."""
    room: int
    """Host bytes left for staging once the placement's RAM regions are counted."""
    config: GreedySnakeConfig
    """Its settings (the first steps')."""

class UnitSizeScores(NamedTuple):
    """Each candidate's roofline plan, its machine (the disks at its request sizes) and SSD bytes a step."""

    plans: dict[int, Choice]
    machines: dict[int, Machine]
    ssd_bytes: dict[int, int]
    probed: str = ""
    """Where the disk was probed (the offload paths' filesystems); empty: not probed, nothing moves."""


def score_sizes(settings: GreedySnakeConfig, fixed: GreedySnakeConfig, layouts: dict[int, StateLayout], optimizer: Any,
                k: int, budget: int, *, speculative: bool, clip_norm: bool, default_root: Path, device: DeviceSide,
                optimizer_threads: int, shape: tuple[int, ...] | None = None) -> UnitSizeScores:
    """``settings``: the user's; ``fixed``: the settings in effect before the plan (:attr:`Planner.config`).
    Place each candidate within ``budget`` (one whose staging alone exceeds it is left out, by the
    placement or the roofline's plan), measure the disks at their request sizes and the optimizer, and
    score them (:func:`score_candidates`). ``shape``: the optimizer's rate measured on a parameter of
    this shape (:attr:`~lightning_greedysnake.optim.contract.OptimizerContract.probe_shape`)."""
    placed: dict[int, Candidate] = {}
    for lpu, state in layouts.items():
        try:
            if settings.offload.unset() & set(REGION_KINDS):
                lag, placement = place_kinds(settings, fixed, state, k, budget, speculative=speculative,
                                             clip_norm=clip_norm, device=device)
                config = placed_config(settings, fixed, state, lag, placement)
                room = budget - sum(kind.host_bytes for kind in placement.kinds.values())
            else:  # every kind placed by the user (the roofline's plan still bounds each size's staging)
                config, room = fixed, budget
        except ValueError:
            continue  # its staging alone exceeds the budget
        costs = planned_costs(state, config.offload, config.alpha or 0.0, device.tier)
        schedule = config.schedule.value
        placed[lpu] = Candidate(costs, traffic(costs, schedule, k, clip_norm=clip_norm and schedule == "vertical"),
                                state.num_slots, room, config)
    if not placed:
        return UnitSizeScores({}, {}, {})
    sizes = probe_sizes([request for c in placed.values() for request in requests(c.costs, c.slots)])
    dirs = [probe_directory(p, default_root) for p in (settings.offload.paths or [None])]
    moved = any(c.traffic.read_bytes + c.traffic.write_bytes for c in placed.values())  # (else nothing to measure)
    bandwidth = interpolate(paths_bandwidth(dirs, sizes, settings.offload) if moved else {1: (math.inf, math.inf)})
    params = sum(lay.trainable_numel for lay in layouts[min(layouts)].units)
    rate = optimizer_rate(numel=probe_numel(params), optimizer=optimizer, threads=optimizer_threads, shape=shape)
    scores = score_candidates(placed, bandwidth, rate, k)
    return scores._replace(probed=", ".join(map(str, dirs)) if moved else "")


def score_candidates(placed: dict[int, Candidate], bandwidth: Bandwidth, rate: float, k: int) -> UnitSizeScores:
    """Each candidate (``layers_per_unit -> (its units' costs, their traffic, the state's slots, the host
    room for staging, its settings)``) on the disks at its request sizes, by the roofline: setup sees no
    batch (no saved activations), the first steps' settings."""
    machines = {lpu: machine_at(c.costs, c.traffic, bandwidth, rate, c.slots) for lpu, c in placed.items()}
    plans: dict[int, Choice] = {}
    for lpu, c in placed.items():
        plans.update(plans_by_size({lpu: (c.costs, machines[lpu])}, k, c.room, 0, alphas=(c.config.alpha,),
                                   lags=(c.config.lag,), recompute=(True,), activation_placements=("host",),
                                   prefetch_units=c.config.offload.prefetch_units))
    return UnitSizeScores(plans, machines, {lpu: c.traffic.read_bytes + c.traffic.write_bytes for lpu, c in placed.items()})
