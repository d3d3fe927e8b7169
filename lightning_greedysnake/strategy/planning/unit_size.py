"""Setup's unit-size candidates (:mod:`lightning_greedysnake.planner.unit_size`: the model and the rule):
each gets its own placement plan within the host budget, and is scored on the run's measurements (the
offload disks at the candidates' request sizes, the optimizer's rate: :class:`Measurements`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_greedysnake.config import REGION_KINDS, GreedySnakeConfig, RunConfig
from lightning_greedysnake.layout import StateLayout
from lightning_greedysnake.models import LayerChain, make_units
from lightning_greedysnake.optim.contract import OptimizerContract
from lightning_greedysnake.planner.measure import probe_sizes
from lightning_greedysnake.planner.placement import PlacementPlan
from lightning_greedysnake.planner.plan import Choice
from lightning_greedysnake.planner.roofline import Machine, Traffic, UnitCost, traffic
from lightning_greedysnake.planner.unit_size import Bandwidth, machine_at, plans_by_size, requests
from lightning_greedysnake.strategy.planning.device import DeviceSide
from lightning_greedysnake.strategy.planning.measurements import NOTHING_MOVES, Measurements
from lightning_greedysnake.strategy.planning.placement import place_kinds, placed_config, planned_costs
from lightning_greedysnake.tensor_manager import state_format_for, state_layout


def candidate_layouts(settings: GreedySnakeConfig, chain: LayerChain, optimizer: torch.optim.Optimizer | None,
                      contract: OptimizerContract, dtype: torch.dtype, shard: tuple[int, int] | None,
                      sizes: list[int]) -> dict[int, StateLayout]:
    """Each candidate size's state layout (the optimizer's state format found once)."""
    fmt = state_format_for(optimizer, contract.slots, settings.offload.optimizer_state_dtype, shard,
                           contract.whole_parameters)
    return {c: state_layout(make_units(chain, c), {}, optimizer, settings.offload, dtype, shard, contract, fmt)
            for c in sizes}


@dataclass(frozen=True)
class Candidate:
    """One unit size, placed: what :func:`score_candidates` scores, and what setup runs if it is chosen."""

    costs: list[UnitCost]
    """Its units' costs (compute unknown at setup)."""
    traffic: Traffic
    """Their SSD bytes a step."""
    slots: int
    """The state's slots (requests per region: :func:`requests`)."""
    room: int
    """Host bytes left for staging once the placement's RAM regions are counted."""
    config: RunConfig
    """Its settings (the first steps'), placed."""
    placement: PlacementPlan | None = None
    """The placement plan of the kinds the user left unset (None: nothing placed)."""


class UnitSizeScores(NamedTuple):
    """Each candidate's roofline plan, its machine (the disks at its request sizes) and SSD bytes a step."""

    plans: dict[int, Choice]
    machines: dict[int, Machine]
    ssd_bytes: dict[int, int]
    probed: str = ""
    """Where the disk was probed (the offload paths' filesystems); empty: not probed, nothing moves."""


def place_candidates(settings: GreedySnakeConfig, fixed: RunConfig, layouts: dict[int, StateLayout], k: int,
                     budget: int, *, speculative: bool, clip_norm: bool,
                     device: DeviceSide) -> dict[int, Candidate | ValueError]:
    """Each candidate size placed within ``budget``, once (pure: every rank computes the same). ``settings``:
    the user's; ``fixed``: the settings in effect before the plan (:attr:`Planner.config`). With
    ``auto=True`` the kinds left unset are placed (:func:`place_kinds`); a size whose staging alone
    exceeds the budget gets the refusal instead (raised if it is the one setup runs)."""
    planned = settings.auto and bool(settings.offload.unset() & set(REGION_KINDS))
    placed: dict[int, Candidate | ValueError] = {}
    for lpu, state in layouts.items():
        config, placement, room = dataclasses.replace(fixed, layers_per_unit=lpu), None, budget
        if planned:
            try:
                lag, placement = place_kinds(settings, config, state, k, budget, speculative=speculative,
                                             clip_norm=clip_norm, device=device)
            except ValueError as e:
                placed[lpu] = e
                continue
            config = placed_config(settings, config, state, lag, placement)
            room = budget - sum(kind.host_bytes for kind in placement.kinds.values())
        costs = planned_costs(state, config.offload, config.alpha or 0.0, device.tier)
        schedule = config.schedule.value
        placed[lpu] = Candidate(costs, traffic(costs, schedule, k, clip_norm=clip_norm and schedule == "vertical"),
                                state.num_slots, room, config, placement)
    return placed


def score_sizes(placed: dict[int, Candidate], measurements: Measurements, k: int) -> UnitSizeScores:
    """Score the placed candidates (:func:`score_candidates`; the roofline's plan leaves out one whose
    staging exceeds its room) on ``measurements``: the disks at the candidates' request sizes (where any
    moves bytes), the optimizer's rate."""
    if not placed:
        return UnitSizeScores({}, {}, {})
    moved = any(c.traffic.read_bytes + c.traffic.write_bytes for c in placed.values())  # (else nothing to measure)
    bandwidth = (measurements.disk(probe_sizes([r for c in placed.values() for r in requests(c.costs, c.slots)]))
                 if moved else NOTHING_MOVES)
    scores = score_candidates(placed, bandwidth, measurements.rates[0], k)
    return scores._replace(probed=measurements.where if moved else "")


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
