"""``auto=True`` at setup, the settings' side of the plan: the host budget, each candidate unit size as
the pure plan takes it (:func:`sized`), and the plan's choice turned into the run's settings
(:func:`placed_config`: the kinds the user left unset placed between the device, host memory and SSD,
:mod:`lightning_greedysnake.planner.setup`). Settings the user gave are kept as given."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from lightning_greedysnake.config import (
    REGION_KINDS,
    GreedySnakeConfig,
    OffloadConfig,
    RunConfig,
    Split,
    TensorKind,
    Tier,
)
from lightning_greedysnake.layout import StateLayout, UnitLayout, unit_tiers
from lightning_greedysnake.models import LayerChain, make_units
from lightning_greedysnake.offload.preflight import human_bytes
from lightning_greedysnake.offload.regions import SLOTTED, placement_of
from lightning_greedysnake.optim.contract import OptimizerContract
from lightning_greedysnake.planner.placement import PlacementPlan
from lightning_greedysnake.planner.roofline import UnitCost
from lightning_greedysnake.planner.setup import ACTIVATION_SHARE, SetupChoice, Sized
from lightning_greedysnake.schedule import ScheduleKind
from lightning_greedysnake.strategy.planning.device import weights_room_bytes
from lightning_greedysnake.tensor_manager import state_format_for, state_layout


def available_memory_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (free RAM plus what the kernel can reclaim), else all RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_budget_bytes(config: GreedySnakeConfig, local_processes: int) -> int:
    """``auto_host_budget_bytes``, or half of the available memory shared by the node's processes."""
    if config.auto_host_budget_bytes is not None:
        return config.auto_host_budget_bytes
    return available_memory_bytes() // 2 // max(1, local_processes)


def budget_error(settings: GreedySnakeConfig, budget: int, staging: int, lag: int) -> str:
    """Why the host budget cannot be kept: the tensor manager's staging alone exceeds it."""
    if settings.auto_host_budget_bytes is None:
        given = f"the default host budget (half of the available memory: {budget:,} bytes)"
        fix = "free memory, set auto_host_budget_bytes higher, or auto=False (the fixed defaults, no budget)"
    else:
        given = f"auto_host_budget_bytes={budget:,}"
        fix = f"raise auto_host_budget_bytes to at least {staging:,}"
    what = (f"offload.buffer_budget_bytes={settings.offload.buffer_budget_bytes:,}"
            if settings.offload.buffer_budget_bytes is not None else
            f"the staging the tensor manager needs at lag {lag} ({staging:,} bytes: one unit's working set"
            f" on SSD, the queued steps' weights and gradients, {settings.offload.prefetch_units} unit(s)' weights"
            " prefetched)")
    if settings.offload.buffer_budget_bytes is not None:
        fix += " or lower offload.buffer_budget_bytes"
    else:  # (only what can still shrink the staging: at one block per unit, lag 0 and no prefetch it cannot)
        lower = []
        if (settings.layers_per_unit or 1) > 1:
            lower.append(f"set a smaller layers_per_unit (now {settings.layers_per_unit}; smaller units stage less)")
        if lag > 0:
            lower.append(f"set lag=0 (now {lag}; no queued steps)")
        if settings.offload.prefetch_units > 0:
            lower.append(f"set offload.prefetch_units=0 (now {settings.offload.prefetch_units}; no read-ahead)")
        fix += "".join(f", or {item}" for item in lower)
    return f"{given} cannot hold {what}. Fix: {fix}."


class SizedStore(Protocol):
    """What the roofline needs of the tensor manager: its units and their byte sizes."""

    @property
    def layouts(self) -> Sequence[UnitLayout]: ...

    @property
    def state(self) -> StateLayout: ...

    def region_bytes(self, kind: TensorKind, u: int) -> int: ...

    def deferred_bytes(self, kind: TensorKind, u: int) -> int:
        """Bytes of unit ``u``'s region of ``kind`` that its deferred (alpha) part moves."""

    def on_ssd(self, kind: TensorKind, u: int) -> bool:
        """Whether unit ``u``'s region of ``kind`` lives on SSD."""

    def on_device(self, kind: TensorKind, u: int) -> bool:
        """Whether unit ``u``'s region of ``kind`` is resident on the device."""


def unit_costs(manager: SizedStore, forward_s: list[float] | None = None, backward_s: list[float] | None = None,
               activation_bytes: dict[int, int] | None = None) -> list[UnitCost]:
    """:class:`UnitCost` per unit of a tensor manager (sizes as laid out; times if given;
    ``activation_bytes`` as the engine measured them). Every unit but the fused last one recomputes its
    forward in backward."""
    last = len(manager.layouts) - 1
    return [UnitCost(
        forward_s=forward_s[u] if forward_s else 0.0,
        backward_s=backward_s[u] if backward_s else 0.0,
        weight_bytes=manager.region_bytes(TensorKind.WEIGHTS, u),
        grad_bytes=manager.region_bytes(TensorKind.GRADIENTS, u),
        master_bytes=manager.region_bytes(TensorKind.MASTER_WEIGHTS, u),
        state_bytes=manager.region_bytes(TensorKind.OPTIMIZER_STATES, u),
        params=lay.trainable_numel,
        alpha_weight_bytes=manager.deferred_bytes(TensorKind.WEIGHTS, u),
        alpha_grad_bytes=manager.deferred_bytes(TensorKind.GRADIENTS, u),
        recompute_s=(forward_s[u] if forward_s and u < last else 0.0),
        activation_bytes=(activation_bytes or {}).get(u, 0),
        on_ssd=frozenset(kind.value for kind in REGION_KINDS if manager.on_ssd(kind, u)),
        on_device=frozenset(kind.value for kind in REGION_KINDS if manager.on_device(kind, u)),
        trained_weight_bytes=manager.state.written_weight_bytes(u),
    ) for u, lay in enumerate(manager.layouts)]


@dataclasses.dataclass(frozen=True)
class PlannedState:
    """A state layout placed as ``tiers`` say (:func:`~lightning_greedysnake.offload.regions.placement_of`),
    before any tensor manager exists: the cost model's :class:`SizedStore`
    at setup (:func:`planned_costs`), as the tensor manager is after the first steps. The deferred part of
    every unit but the first (never deferred) is about ``alpha`` of it."""

    state: StateLayout
    tiers: Mapping[TensorKind, list[Tier]]
    alpha: float = 0.0

    @property
    def layouts(self) -> tuple[UnitLayout, ...]:
        return self.state.units

    def region_bytes(self, kind: TensorKind, u: int) -> int:
        return self.state.region_bytes(kind, u)

    def deferred_bytes(self, kind: TensorKind, u: int) -> int:
        deferred = self.alpha if u > 0 and self.state.units[u].trainable_numel else 0.0
        stepped = (self.state.written_weight_bytes(u) if kind is TensorKind.WEIGHTS  # (the trained prefix)
                   else self.state.region_bytes(kind, u))
        return int(deferred * stepped)

    def on_ssd(self, kind: TensorKind, u: int) -> bool:
        return self.tiers[kind][u] is Tier.SSD

    def on_device(self, kind: TensorKind, u: int) -> bool:
        return self.tiers[kind][u] is Tier.DEVICE


def planned_costs(state: StateLayout, offload: OffloadConfig, alpha: float, device_tier: bool) -> list[UnitCost]:
    """The cost model's units (:func:`unit_costs`, the same the
    warm-step plan takes from the tensor manager) of ``state`` placed as ``offload`` says."""
    return unit_costs(PlannedState(state, placement_of(state, offload, device_tier), alpha))


def as_placement(sizes: list[int], host_units: int, device_units: int = 0) -> Tier | Split:
    """The config value that keeps the first ``device_units`` of units sized ``sizes`` on the device,
    the next up to ``host_units`` (counted from the first) in RAM and every later unit that holds bytes on
    SSD (a unit of 0 bytes holds nothing, wherever it is counted)."""
    total = sum(sizes)
    device, host, ssd = sum(sizes[:device_units]), sum(sizes[device_units:host_units]), sum(sizes[host_units:])
    if not total or (not device and not ssd):
        return Tier.HOST
    if not host and not ssd:
        return Tier.DEVICE
    if not device and not host:
        return Tier.SSD

    def first_after(u: int) -> int:
        return next((size for size in sizes[u:] if size), 0)

    # each share reaches into the next unit with bytes, by less than that unit (unit_tiers keeps the
    # prefix and no more, whatever the rounding), and together by less than the SSD's bytes (so the SSD
    # keeps a share: it is the last tier, which takes the rest)
    ssd_margin = first_after(host_units) / 3
    device_share = (device + min(first_after(device_units) / 2, ssd / 3 if ssd else float("inf"))) if device else 0.0
    host_share = (host + ssd_margin) if host else 0.0
    if not ssd:
        host_share = total - device_share
    placement = Split(host_share / total, max(0.0, 1.0 - (host_share + device_share) / total), device_share / total)
    expected = [Tier.DEVICE if u < device_units else Tier.HOST if u < host_units else Tier.SSD
                for u, size in enumerate(sizes) if size]
    assert [t for t, size in zip(unit_tiers(sizes, placement), sizes, strict=True) if size] == expected, (
        sizes, host_units, device_units, placement)
    return placement


def candidate_layouts(settings: GreedySnakeConfig, chain: LayerChain, optimizer: torch.optim.Optimizer | None,
                      contract: OptimizerContract, dtype: torch.dtype, shard: tuple[int, int] | None,
                      sizes: list[int]) -> dict[int, StateLayout]:
    """Each candidate size's state layout (the optimizer's state format found once)."""
    fmt = state_format_for(optimizer, contract.slots, settings.offload.optimizer_state_dtype, shard,
                           contract.whole_parameters)
    return {c: state_layout(make_units(chain, c), {}, optimizer, settings.offload, dtype, shard, contract, fmt)
            for c in sizes}


def sized(state: StateLayout, fixed: RunConfig, planned: frozenset[TensorKind], *, speculative: bool,
          device_tier: bool, device_budget: int | None) -> Sized:
    """``state`` as the pure plan takes it (:class:`~lightning_greedysnake.planner.setup.Sized`): the
    ``planned`` kinds on SSD, the others as ``fixed`` (the settings in effect before the plan) places them;
    ``speculative``: fp16's two slots of the kinds a step rewrites; ``device_tier``: units placed on the
    device live in device memory (a GPU, or the simulated device; else the device is host RAM);
    ``device_budget``: the device budget the compute weights may use some of (:func:`weights_room_bytes`;
    None: none planned)."""
    every_ssd = dataclasses.replace(fixed.offload, **{kind.value: Tier.SSD for kind in planned})
    kept = {kind.value: [state.kept_unit_bytes(kind, u) * (2 if speculative and kind in SLOTTED else 1)
                         for u in range(state.num_units)] for kind in REGION_KINDS}
    room = (weights_room_bytes(state, fixed.offload, device_budget)
            if device_tier and device_budget and TensorKind.WEIGHTS in planned else 0)
    return Sized(planned_costs(state, every_ssd, fixed.alpha or 0.0, device_tier), kept, state.num_slots, room)


def placed_config(settings: GreedySnakeConfig, fixed: RunConfig, state: StateLayout, choice: SetupChoice) -> RunConfig:
    """``fixed`` (the settings in effect before the plan) with the plan's unit size, lag and order, and its
    placement of the kinds ``settings`` (the user's) leave unset."""
    offload = fixed.offload
    if choice.placement is not None:
        offload = settings.offload.placed({
            TensorKind(name): as_placement(state.all_region_bytes(TensorKind(name)), kind.host_units, kind.device_units)
            for name, kind in choice.placement.kinds.items() if kind.planned})
    return dataclasses.replace(fixed, layers_per_unit=choice.layers_per_unit, lag=choice.lag, offload=offload,
                               schedule=ScheduleKind(choice.schedule))


def empty_path_note(settings: GreedySnakeConfig, config: RunConfig, plan: PlacementPlan | None) -> str:
    """What the start-of-run report says under an offload path that holds none of the run's state (one
    given in ``offload.path``, checked all the same): why nothing went there, and how to put state there.
    ``settings``: what the user set; ``config``: the settings in effect (after the device plan and the
    placement ``plan``, None when nothing was planned)."""
    offload = config.offload
    if offload.uses_ssd:  # (several paths, fewer units on SSD than paths)
        return ("nothing placed here: the units on SSD are striped over the offload paths one unit at a time, "
                "and none fell to this one. To use it: put more units on SSD (offload.<kind>=ssd), or give "
                "fewer paths.")
    given = {kind.value: getattr(settings.offload, kind.value) for kind in TensorKind}
    yours = [f"offload.{name}={value.value if isinstance(value, Tier) else value}"
             for name, value in given.items() if value is not None]
    force = "offload.<kind>=ssd (e.g. offload.optimizer_states=ssd)"
    if not offload.uses_tensor_manager and settings.offload.unset():
        why = "the model's whole training state fits the device (the device plan above), so every kind stays there"
        fix = f"{force}, or auto_device_budget_bytes=0"
    elif plan is not None:
        planned = [name for name, k in plan.kinds.items() if k.planned]
        source = ("auto_host_budget_bytes" if settings.auto_host_budget_bytes is not None
                  else "half the available memory")
        on_ssd = sum(k.total_bytes for k in plan.kinds.values() if k.planned) // len(offload.paths or [None])
        why = (f"{', '.join(planned)} fit in the {human_bytes(plan.budget_bytes)} host budget ({source}), so the "
               f"planner (auto=True) keeps them in RAM (on SSD they would take about {human_bytes(on_ssd)} "
               f"here){'; yours: ' + ', '.join(yours) if yours else ''}")
        fix = f"{force}, or a smaller auto_host_budget_bytes"
    else:
        rest = ", the others at their defaults" if settings.offload.unset() else ""
        why = f"your settings keep every kind off SSD ({', '.join(yours)}{rest})"
        fix = force
    if settings.auto and settings.offload.activations is None and offload.uses_tensor_manager:
        why += (f"; saved activations come here only if, at the first save, a window's exceed "
                f"1/{ACTIVATION_SHARE} of the host budget")
    return f"nothing placed here: {why}. To put state here: {fix}."
