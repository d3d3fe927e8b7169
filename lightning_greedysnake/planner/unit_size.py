"""Choosing ``layers_per_unit``: one model and one rule for setup and the warm step. Pure arithmetic.

Each candidate size is scored by the roofline (:func:`~lightning_greedysnake.planner.plan.plan`) over
its units' costs (:func:`~lightning_greedysnake.strategy.planning.placement.unit_costs`) on its machine; the
smallest wins unless a larger one is predicted :data:`LARGER_UNIT_GAIN` faster than every smaller one.

- **At setup** no batch has run: the costs carry no compute, so the score is the SSD-bound step (plus
  the window's last optimizer step, which nothing overlaps). Each candidate has its own placement within
  the host budget (small units stage less, so more can stay in RAM) and its own machine: the disks
  measured at its request sizes (every region of a unit moves as one request; small ones pay the disk's
  per-request latency), :func:`machine_at`.
- **After the warm step** the costs carry this run's measured compute (larger units recompute less: the
  fused last unit not at all) and the machine is the one measured then; the candidates are this run's
  units merged. A larger size is only reported, for the next run (the files are shaped by the unit size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_greedysnake.planner.plan import Choice, PlanError, plan
from lightning_greedysnake.planner.roofline import Machine, Traffic, UnitCost

CANDIDATES = (1, 2, 4, 8)
"""The unit sizes considered (blocks per unit; those up to the model's number of blocks)."""

LARGER_UNIT_GAIN = 0.1
"""How much faster (a fraction of the smaller's predicted step) a larger unit must be to be preferred,
at setup and after the warm step alike: a measurement's noise must not buy memory (a larger unit stages
more) nor a new layout."""

Bandwidth = Callable[[int], tuple[float, float]]
"""``bandwidth(request_bytes) -> (read, write)`` bytes/s of the offload disks together, by request size."""


def request_bytes(units: Sequence[UnitCost], state_slots: int = 1) -> dict[str, int]:
    """Each kind's request (bytes): its mean region per unit (0 where a kind has none), the optimizer
    state's per slot (each slot is read and written as its own range)."""
    sizes = {"weights": [u.weight_bytes for u in units], "master_weights": [u.master_bytes for u in units],
             "optimizer_states": [u.state_bytes for u in units], "gradients": [u.grad_bytes for u in units]}
    return {kind: sum(s) // max(1, sum(1 for x in s if x)) // (max(1, state_slots) if kind == "optimizer_states" else 1)
            for kind, s in sizes.items()}


def requests(units: Sequence[UnitCost], state_slots: int = 1) -> list[int]:
    """The request sizes (bytes) a step of ``units`` makes of the disks: those of the kinds on SSD."""
    return [size for kind, size in request_bytes(units, state_slots).items()
            if size and any(kind in u.on_ssd for u in units)]


def machine_at(units: Sequence[UnitCost], traffic: Traffic, bandwidth: Bandwidth, optimizer_elements_per_s: float,
               state_slots: int = 1) -> Machine:
    """The machine ``units`` see: the disks at their request sizes, each kind's bandwidth weighted by the
    bytes it moves a step (``traffic``, the units' placement's), and the optimizer's rate."""
    sizes = request_bytes(units, state_slots)
    seconds, moved = {"read": 0.0, "write": 0.0}, {"read": 0, "write": 0}
    for name, nbytes in traffic.terms.items():
        op, kind = name.split("/", 1)
        seconds[op] += nbytes / bandwidth(max(1, sizes[kind]))[op == "write"]
        moved[op] += nbytes
    fallback = bandwidth(max(1, *sizes.values()))  # (a direction that moves nothing: any size will do)
    return Machine(moved["read"] / seconds["read"] if seconds["read"] else fallback[0],
                   moved["write"] / seconds["write"] if seconds["write"] else fallback[1], optimizer_elements_per_s)


def plans_by_size(candidates: Mapping[int, tuple[list[UnitCost], Machine]], k: int, budget: int,
                  unit_input_bytes: int, **options: Any) -> dict[int, Choice]:
    """The roofline's best plan of each candidate (``layers_per_unit -> (its units' costs, its
    machine)``) within ``budget`` over ``options`` (:func:`~lightning_greedysnake.planner.plan.plan`'s);
    a candidate that fits none is left out."""
    out = {}
    for lpu, (units, machine) in candidates.items():
        try:
            best = plan(units, machine, k, budget, unit_input_bytes, **options)
        except PlanError:
            continue
        out[lpu] = dataclasses.replace(best, layers_per_unit=lpu)
    return out


def choose_unit_size(plans: Mapping[int, Choice], gain: float | None = None) -> int:
    """The smallest candidate, or a larger one predicted ``gain`` (:data:`LARGER_UNIT_GAIN`) faster than
    every smaller one."""
    gain = LARGER_UNIT_GAIN if gain is None else gain
    best: int | None = None
    for lpu in sorted(plans):
        if best is None or plans[lpu].step_s < plans[best].step_s * (1 - gain):
            best = lpu
    assert best is not None, "no candidate unit size"
    return best


def table(plans: Mapping[int, Choice], machines: Mapping[int, Machine], ssd_bytes: Mapping[int, int],
          chosen: int, probed: str = "") -> str:
    """Each candidate's SSD bytes a step and its predicted step, under one line with the disk's speeds: the
    one probe's (``probed``: where it ran), at the chosen size's request sizes, the figures the warm-step
    plan uses (a candidate's own requests, smaller for smaller units, are in its step)."""
    machine = machines[chosen]
    if not machine.disk_probed:
        rows = ["disk: not probed (no SSD traffic at any candidate: the state is in RAM)"]
    else:
        rows = [f"disk{f' ({probed})' if probed else ''}: {machine.disk} at the chosen size's requests (smaller "
                "requests are slower: each step below counts its own)"]
    rows.append(f"{'layers_per_unit':<17}{'SSD GB/step':>12}{'step (s)':>10}")
    for lpu in sorted(plans):
        rows.append(f"{lpu:<17}{ssd_bytes[lpu] / 1e9:>12.3f}{plans[lpu].step_s:>10.3f}"
                    + ("   <- chosen" if lpu == chosen else ""))
    return "\n".join(rows)
