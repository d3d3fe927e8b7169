"""Setup's plan in one call (:func:`plan_setup`): each candidate unit size placed within the host budget
(:func:`~lightning_greedysnake.planner.placement.plan_placement`), scored on the disks at its own request
sizes by the roofline (:mod:`~lightning_greedysnake.planner.unit_size`), one chosen, and the window's order
where nothing streams. Pure arithmetic over what the strategy's planning sized and measured
(:class:`SetupInputs`); the one measurement it may ask for, the disks at the candidates' request sizes,
comes through :class:`Probes`, asked at most once and only where a candidate moves bytes and there is a
choice to make."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from lightning_greedysnake.planner.placement import PlacementPlan, plan_placement
from lightning_greedysnake.planner.plan import Choice, staging_bytes
from lightning_greedysnake.planner.roofline import Machine, UnitCost, traffic
from lightning_greedysnake.planner.unit_size import (
    Bandwidth,
    choose_unit_size,
    machine_at,
    plans_by_size,
    requests,
)

ACTIVATION_SHARE = 8
"""The placement leaves 1/8 of the host budget for saved activations in host memory (their size
depends on the batch, which setup does not see: with ``offload.activations`` unset the first save puts
them on SSD when a window's exceed it, and the warm-step plan counts them as measured)."""


class Probes(Protocol):
    """The measurements the plan may ask for (taken once, at the first ask, and kept)."""

    @property
    def where(self) -> str:
        """The disks probed, as the report names them."""

    @property
    def rates(self) -> tuple[float, float | None]:
        """The optimizer's elements per second on the lane (and on the training thread)."""

    def disk(self, requests: Sequence[int]) -> Bandwidth:
        """The disks' (read, write) bytes/s by request size, probed around ``requests``; raises ``OSError``."""


@dataclass(frozen=True)
class Sized:
    """One candidate unit size, sized by the strategy's planning before anything is placed."""

    costs: list[UnitCost]
    """Its units (no compute: setup sees no batch), the kinds the user placed as placed, the kinds to plan
    on SSD."""
    kept: Mapping[str, list[int]]
    """Per kind, each unit's RAM in the host tier (every slot; this rank's chunk)."""
    slots: int
    """The optimizer state's slots (requests per region: :func:`~.unit_size.requests`)."""
    device_room: int = 0
    """Device memory the plan may give the compute weights (0: none; see ``plan_placement``)."""


@dataclass(frozen=True)
class SetupInputs:
    """Everything :func:`plan_setup` decides from."""

    sizes: Mapping[int, Sized]
    """The candidate unit sizes (one: the user's or ``auto=False``'s, nothing to choose)."""
    planned: frozenset[str]
    """The kinds to place (empty: every kind as given)."""
    budget: int
    """The host budget, bytes."""
    k: int
    lag: int
    """The lag in effect; the first window's is planned where ``lag_planned``: the deepest whose staging
    fits beside the saved activations' share."""
    lag_planned: bool
    alpha: float
    schedule: str
    """The order in effect (``vertical``, ``horizontal``)."""
    schedule_planned: bool
    """The order is the plan's to choose: horizontal where nothing streams (every kind in RAM, no device
    tier: nothing moves per micro-batch for the vertical order to save, and it would hold K micro-batches'
    activations where the horizontal order holds one's, as Lightning does)."""
    clip_norm: bool
    """Gradients wait for the global norm."""
    prefetch_units: int
    buffer_budget_bytes: int | None = None
    """The user's staging budget (None: the staging rule's automatic one)."""


class Scores(NamedTuple):
    """Each scored candidate's roofline plan, its machine (the disks at its request sizes) and SSD bytes a
    step; ``probed``: where the disks were probed (empty: nothing moves, nothing probed)."""

    plans: dict[int, Choice]
    machines: dict[int, Machine]
    ssd_bytes: dict[int, int]
    probed: str = ""


class Placed(NamedTuple):
    """One candidate placed: the first window's lag, the placement (None: nothing planned) and its units
    placed so; ``refused_staging_bytes``: its staging, where that alone exceeds the budget (placed then
    is nothing); ``crowded``: its staging leaves less than the saved activations' share of the budget (no
    candidate where another size leaves it)."""

    lag: int
    plan: PlacementPlan | None
    units: list[UnitCost]
    refused_staging_bytes: int | None = None
    crowded: bool = False


@dataclass(frozen=True)
class SetupChoice:
    """The plan: the unit size, the first window's lag, the placement of the planned kinds (None:
    nothing placed), the order, and the unit sizes' scores (None: nothing to choose) or why the size fell
    back to the smallest (``fallback``)."""

    layers_per_unit: int
    lag: int
    placement: PlacementPlan | None
    schedule: str
    scores: Scores | None = None
    fallback: str | None = None
    refused_staging_bytes: int | None = None
    """The chosen size's staging at ``lag``, where it exceeds the budget: setup refuses the run."""


def lag_in_effect(lag: int, units: int) -> int:
    """The lag a run of ``units`` units runs with: at most ``units``. The optimizer lane holds at most one
    step per unit (a unit's next step waits for its last), so a deeper lag waits no less than this one and
    would only size staging for steps that never wait; the one place this clamp is computed."""
    return min(lag, max(units, 0))


def place(inputs: SetupInputs, sized: Sized) -> Placed:
    """One candidate placed (see :class:`Placed`); its lag the one in effect for its units
    (:func:`lag_in_effect`)."""
    costs = sized.costs
    lag = lag_in_effect(inputs.lag, len(costs))
    if not inputs.planned:
        return Placed(lag, None, costs)

    def staging(lag: int) -> int:
        if inputs.buffer_budget_bytes is not None:
            return inputs.buffer_budget_bytes
        return staging_bytes(costs, lag, inputs.prefetch_units)

    budget = inputs.budget
    if inputs.lag_planned:
        lag = next((lag for lag in sorted({lag_in_effect(lag, len(costs)) for lag in (2, 1, 0)}, reverse=True)
                    if staging(lag) + budget // ACTIVATION_SHARE <= budget), 0)
    if staging(lag) > budget:
        return Placed(lag, None, costs, staging(lag))
    plan = plan_placement(costs, sized.kept, inputs.planned, budget, staging(lag) + budget // ACTIVATION_SHARE,
                          inputs.schedule, inputs.k, clip_norm=inputs.clip_norm,
                          device_room=sized.device_room)
    return Placed(lag, plan, plan.units, crowded=staging(lag) + budget // ACTIVATION_SHARE > budget)


def plan_setup(inputs: SetupInputs, probes: Probes) -> SetupChoice:
    """The plan (see the module). A size whose staging exceeds the budget is no candidate; the smallest
    size is the fallback where none can be scored (every one refused, or nothing fits its room), and
    where the disk cannot be measured (``fallback`` says why)."""
    placed = {lpu: place(inputs, sized) for lpu, sized in inputs.sizes.items()}
    fits = {lpu: p for lpu, p in placed.items() if p.refused_staging_bytes is None}
    # (a size whose staging crowds out the saved activations' share is a candidate only where every one does)
    fits = {lpu: p for lpu, p in fits.items() if not p.crowded} or fits
    k = inputs.k
    lpu, scores, fallback = min(inputs.sizes), None, None
    if len(inputs.sizes) > 1 and fits:
        moved = {lpu: traffic(p.units, inputs.schedule, k, clip_norm=inputs.clip_norm)
                 for lpu, p in fits.items()}
        moving = any(t.read_bytes + t.write_bytes for t in moved.values())  # (else nothing to measure)
        try:
            wanted = [r for lpu, p in fits.items() for r in requests(p.units, inputs.sizes[lpu].slots)]
            bandwidth: Bandwidth = probes.disk(wanted) if moving else lambda size: (math.inf, math.inf)
            rate = probes.rates[0]
        except OSError as e:
            fallback = f"layers_per_unit={lpu}: the offload disk could not be measured ({e})"
        except ValueError as e:  # (a setting the probe refuses: setup refuses it next, on every rank)
            fallback = f"layers_per_unit={lpu} ({e})"
        else:
            machines: dict[int, Machine] = {}
            plans: dict[int, Choice] = {}
            for size, p in fits.items():
                machines[size] = machine_at(p.units, moved[size], bandwidth, rate, inputs.sizes[size].slots)
                room = inputs.budget - (sum(kind.host_bytes for kind in p.plan.kinds.values()) if p.plan else 0)
                plans.update(plans_by_size({size: (p.units, machines[size])}, k, room, 0, alphas=(inputs.alpha,),
                                           lags=(p.lag,), recompute=(True,), activation_placements=("host",),
                                           prefetch_units=inputs.prefetch_units))
            if plans:
                lpu = choose_unit_size(plans)
                scores = Scores(plans, machines, {s: t.read_bytes + t.write_bytes for s, t in moved.items()},
                                probes.where if moving else "")
    lag, plan, units, refused, _ = placed[lpu]
    in_ram = not any(u.on_ssd for u in units)
    schedule = "horizontal" if inputs.schedule_planned and in_ram else inputs.schedule
    return SetupChoice(lpu, lag, plan, schedule, scores, fallback, refused)

