"""``auto=True`` with ``layers_per_unit`` unset: choose it at setup, before any file is shaped by it
(:mod:`lightning_greedysnake.planner.unit_size`). Each candidate gets its own placement plan within
the host budget; rank 0 measures the offload disks at the candidates' request sizes (at most 64 MiB of
scratch file) and the optimizer's rate, scores them and every rank takes its choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_greedysnake.config import GreedySnakeConfig
from lightning_greedysnake.layout import StateLayout
from lightning_greedysnake.models import LayerChain, make_units
from lightning_greedysnake.config import REGION_KINDS
from lightning_greedysnake.planner.measure import interpolate, optimizer_rate, probe_sizes, request_bandwidth
from lightning_greedysnake.planner.plan import Choice
from lightning_greedysnake.planner.roofline import Machine, traffic
from lightning_greedysnake.strategy.device_plan import DeviceSide, device_side
from lightning_greedysnake.planner.unit_size import Bandwidth, choose_unit_size, machine_at, plans_by_size, requests, table
from lightning_greedysnake.strategy.placement import (
    PlacementPlan,
    host_budget_bytes,
    place_kinds,
    placed_config,
    plan_at_setup,
    staging_estimate,
    planned_costs,
)
from lightning_greedysnake.tensor_manager import discover_slots, state_format_for, state_layout

if TYPE_CHECKING:
    from lightning_greedysnake.strategy.run import SetupContext

CANDIDATES = (1, 2, 4, 8)
"""The unit sizes considered (blocks per unit; those up to the model's number of blocks)."""


def probe_directory(setting: str | None, default_root: Path) -> Path:
    """Where to measure the disk of an offload path before it exists: its nearest existing ancestor
    (a directory about to be created lives on that one's filesystem)."""
    path = Path(setting.format(rank=0, local_rank=0)) if setting else default_root / "greedysnake_offload"
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return candidate
    return Path.cwd()


def candidate_layouts(settings: GreedySnakeConfig, chain: LayerChain, optimizer: torch.optim.Optimizer | None,
                      dtype: torch.dtype, shard: tuple[int, int] | None) -> dict[int, StateLayout]:
    """Each candidate's state layout (the optimizer's slots and state format found once)."""
    slots = discover_slots(optimizer) if optimizer is not None else ()
    fmt = state_format_for(optimizer, slots, settings.offload.optimizer_state_dtype, shard)
    sizes = [c for c in CANDIDATES if c <= len(chain.blocks)]
    return {c: state_layout(make_units(chain, c), {}, optimizer, settings.offload, dtype, shard, slots, fmt)
            for c in sizes}


@dataclasses.dataclass(frozen=True)
class UnitSizeScores:
    """Each candidate's roofline plan, its machine (the disks at its request sizes) and SSD bytes a step."""

    plans: dict[int, Choice]
    machines: dict[int, Machine]
    ssd_bytes: dict[int, int]


def _score_all(settings: GreedySnakeConfig, layouts: dict[int, StateLayout], optimizer: Any, k: int, budget: int,
               *, speculative: bool, clip_norm: bool, default_root: Path,
               device: DeviceSide = DeviceSide(), optimizer_threads: int = 1) -> UnitSizeScores:
    placed: dict[int, tuple[list, Any, int, int, GreedySnakeConfig]] = {}
    for lpu, state in layouts.items():
        try:
            if settings.offload.unset() & set(REGION_KINDS):
                lag, placement = place_kinds(settings, state, k, budget, speculative=speculative,
                                             clip_norm=clip_norm, device=device)
                config = placed_config(settings, state, lag, placement)
                room = budget - sum(kind.host_bytes for kind in placement.kinds.values())
            else:  # every kind placed by the user: the budget still bounds a larger unit's staging
                config, room = settings.resolved(), budget
                if lpu > 1 and staging_estimate(state, config.offload, config.lag, device.tier) > budget:
                    continue
        except ValueError:
            continue  # its staging alone exceeds the budget
        costs = planned_costs(state, config.offload, config.alpha or 0.0, device.tier)
        schedule = config.schedule.value
        placed[lpu] = (costs, traffic(costs, schedule, k, clip_norm=clip_norm and schedule == "vertical"),
                       state.num_slots, room, config)
    if not placed:
        return UnitSizeScores({}, {}, {})
    if any(t.read_bytes + t.write_bytes for _, t, *_ in placed.values()):
        io = settings.offload
        dirs = [probe_directory(p, default_root) for p in (io.paths or [None])]
        sizes = probe_sizes([request for costs, _, slots, *_ in placed.values() for request in requests(costs, slots)])
        per_path = [request_bandwidth(d, sizes, io.io_threads, io.io_chunk_bytes, io.direct_io) for d in dirs]
        measured = {size: (len(dirs) * min(p[size][0] for p in per_path), len(dirs) * min(p[size][1] for p in per_path))
                    for size in sizes}
        bandwidth = interpolate(measured)
    else:
        def bandwidth(size: int) -> tuple[float, float]:
            return float("inf"), float("inf")
    params = sum(lay.trainable_numel for lay in layouts[min(layouts)].units)
    rate = optimizer_rate(numel=min(1 << 20, max(1 << 16, params)), optimizer=optimizer, threads=optimizer_threads)
    return score_candidates(placed, bandwidth, rate, k)


def score_candidates(placed: dict[int, tuple[list, Any, int, int, GreedySnakeConfig]], bandwidth: Bandwidth,
                     rate: float, k: int) -> UnitSizeScores:
    """Each candidate (``layers_per_unit -> (its units' costs, their traffic, the state's slots, the host
    room for staging, its settings)``) on the disks at its request sizes, by the roofline: setup sees no
    batch (no checkpoints), the first steps' settings."""
    machines = {lpu: machine_at(costs, t, bandwidth, rate, slots) for lpu, (costs, t, slots, *_) in placed.items()}
    plans: dict[int, Choice] = {}
    for lpu, (costs, _, _, room, config) in placed.items():
        plans.update(plans_by_size({lpu: (costs, machines[lpu])}, k, room, 0, alphas=(config.alpha,),
                                   lags=(config.lag,), recompute=(True,), checkpoint_placements=("host",),
                                   prefetch_units=config.offload.prefetch_units))
    return UnitSizeScores(plans, machines, {lpu: t.read_bytes + t.write_bytes for lpu, (_, t, *_) in placed.items()})


def plan_layers_per_unit(settings: GreedySnakeConfig, chain: LayerChain, optimizer: Any, dtype: torch.dtype,
                         shard: tuple[int, int] | None, k: int, *, speculative: bool, clip_norm: bool,
                         budget: int, default_root: Path, is_global_zero: bool,
                         broadcast: Callable[[Any], Any], report: Callable[[str], None],
                         device: DeviceSide = DeviceSide(), optimizer_threads: int = 1) -> int:
    """``layers_per_unit`` for this run: the user's, 1 with ``auto=False``, else the best-scoring
    candidate on rank 0 (every rank takes it). A candidate whose staging alone exceeds the host
    budget (``budget``: the run's, :func:`host_budget_bytes`) is not considered; where none can be
    measured, 1 (and the report says why)."""
    if settings.layers_per_unit is not None or not settings.auto:
        return settings.resolved().layers_per_unit
    if len([c for c in CANDIDATES if c <= len(chain.blocks)]) < 2:
        return 1
    result: int | str = 1
    if is_global_zero:
        try:
            layouts = candidate_layouts(settings, chain, optimizer, dtype, shard)
            scores = _score_all(settings, layouts, optimizer, k, budget, speculative=speculative,
                                clip_norm=clip_norm, default_root=default_root, device=device,
                                optimizer_threads=optimizer_threads)
            if scores.plans:
                chosen = choose_unit_size(scores.plans)
                result = chosen
                report("greedysnake unit size (auto=True; set layers_per_unit to fix it: unit sizes agree up to "
                       "rounding, not bit for bit, and this choice rests on a measurement): the disks measured at "
                       "each candidate's request sizes, its placement within the host budget, its step predicted by the "
                       "roofline without compute (setup sees no batch)\n"
                       + table(scores.plans, scores.machines, scores.ssd_bytes, chosen))
        except OSError as e:
            result = f"layers_per_unit=1: the offload disk could not be measured ({e})"
        except ValueError as e:  # a setting refused: setup refuses it next, on every rank (none waits here)
            result = f"layers_per_unit=1 ({e})"
    result = broadcast(result)
    if isinstance(result, str):
        report(f"greedysnake: {result}")
        return 1
    return result


@dataclasses.dataclass(frozen=True)
class SetupPlan:
    """What setup planned: the settings in effect, the placement plan (None: nothing planned), the
    units of the planned size and the run's host budget."""

    config: GreedySnakeConfig
    placement: PlacementPlan | None
    units: list
    host_budget_bytes: int
    """The run's host budget (:func:`host_budget_bytes`, rank 0's), measured once at setup: every plan of
    the run (the unit size, the placement, the activation checkpoints' tier, the warm-step plan) is made
    within this one number, not within the memory available when each runs (which the run itself lowers)."""


def plan_setup(ctx: SetupContext, chain: LayerChain, optimizer: Any, dtype: torch.dtype,
               shard: tuple[int, int] | None, *, speculative: bool, clip_norm: bool) -> SetupPlan:
    """What setup plans, in order: the run's host budget (rank 0's: every rank decides alike), then
    ``layers_per_unit``, then the placement of the unset kinds for the units of that size."""
    device = device_side(ctx.settings, ctx.device, ctx.device_tier)
    budget = ctx.broadcast(host_budget_bytes(ctx.settings, ctx.local_processes))
    lpu = plan_layers_per_unit(
        ctx.settings, chain, optimizer, dtype, shard, ctx.accumulate, speculative=speculative,
        clip_norm=clip_norm, budget=budget, default_root=ctx.default_root,
        is_global_zero=ctx.is_global_zero, broadcast=ctx.broadcast, report=ctx.report, device=device,
        optimizer_threads=ctx.optimizer_threads)
    units = make_units(chain, lpu)
    config, plan = plan_at_setup(
        dataclasses.replace(ctx.settings, layers_per_unit=lpu),
        state_layout(units, {}, optimizer, ctx.settings.offload.placed(), dtype, shard), ctx.accumulate,
        speculative=speculative, clip_norm=clip_norm, budget=budget, broadcast=ctx.broadcast, report=ctx.report,
        device=device)
    return SetupPlan(config, plan, units, budget)
