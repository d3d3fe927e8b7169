"""Schedules as data: the order in which one accumulation window runs, as a list of ops.

This module is pure Python (no torch) so that the orders can be built, printed and checked in isolation.

Vocabulary. A model is a chain ``pre -> blocks -> post`` grouped into ``num_units`` units; unit 0 also owns
``pre`` and the last unit also owns ``post``. A window is ``num_microbatches`` micro-batches that share one
optimizer step. Ops:

- ``F u.m``: forward of unit ``u`` (never the last unit) on micro-batch ``m``; its output is the saved
  activation that unit ``u + 1`` starts from, and the input of ``u`` is kept for recomputation.
- ``L u.m``: the *fused* last-unit op: forward of the last unit, head and loss on micro-batch ``m`` with
  autograd on, immediately followed by its backward. It produces the activation gradient that the
  backward of unit ``u - 1`` starts from. This is where the user's ``training_step`` runs.
- ``B u.m``: backward of unit ``u`` on micro-batch ``m``, recomputing the unit from its saved activation.
- ``O u``: unit ``u``'s parameter gradient is complete: hand it to the optimizer.

The vertical ("greedy snake") order runs every micro-batch through unit ``u`` before unit ``u + 1`` and
alternates direction between neighbouring units. The snake is anchored at the fused ops, which run in
micro-batch order ``0..M-1`` (Lightning hands the strategy its micro-batches in that order, and each
fused op is one ``training_step``): so unit ``U-2``'s forward runs ``M-1..0`` and ends on micro-batch 0,
the first fused op; the backward of unit ``U-2`` starts at micro-batch ``M-1``, the last fused op. At every
turn the micro-batch that finished one unit starts the next, so its activation is still at hand.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class OpKind(str, enum.Enum):
    FORWARD = "F"
    FUSED = "L"
    BACKWARD = "B"
    OPTIMIZER = "O"


@dataclass(frozen=True)
class Op:
    kind: OpKind
    unit: int
    microbatch: int | None = None  # None only for OPTIMIZER ops

    def __str__(self) -> str:
        if self.kind is OpKind.OPTIMIZER:
            return f"O{self.unit}"
        return f"{self.kind.value}{self.unit}.{self.microbatch}"


class ScheduleKind(str, enum.Enum):
    VERTICAL = "vertical"
    HORIZONTAL = "horizontal"


@dataclass(frozen=True)
class Plan:
    """One window's ops in execution order."""

    schedule: ScheduleKind
    num_units: int
    num_microbatches: int
    ops: tuple[Op, ...]

    def text(self) -> str:
        return " ".join(str(op) for op in self.ops)

    def __str__(self) -> str:
        return self.text()

    def __len__(self) -> int:
        return len(self.ops)


def _check_sizes(num_units: int, num_microbatches: int) -> None:
    if num_units < 1:
        raise ValueError(f"num_units must be >= 1, got {num_units}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _snake_order(unit: int, num_units: int, num_microbatches: int) -> list[int]:
    """Micro-batch order for ``unit``'s forward and backward: descending on the unit just before the last
    one, alternating from there towards unit 0."""
    ascending = list(range(num_microbatches))
    descending = ascending[::-1]
    return descending if (num_units - 2 - unit) % 2 == 0 else ascending


def build_vertical_plan(num_units: int, num_microbatches: int) -> Plan:
    """GreedySnake's layer-major order for one window."""
    _check_sizes(num_units, num_microbatches)
    last = num_units - 1
    ops: list[Op] = []
    for unit in range(last):
        ops += [Op(OpKind.FORWARD, unit, m) for m in _snake_order(unit, num_units, num_microbatches)]
    ops += [Op(OpKind.FUSED, last, m) for m in range(num_microbatches)]
    ops.append(Op(OpKind.OPTIMIZER, last))
    for unit in range(last - 1, -1, -1):
        ops += [Op(OpKind.BACKWARD, unit, m) for m in _snake_order(unit, num_units, num_microbatches)]
        ops.append(Op(OpKind.OPTIMIZER, unit))
    plan = Plan(ScheduleKind.VERTICAL, num_units, num_microbatches, tuple(ops))
    check_plan(plan)
    return plan


def build_horizontal_plan(num_units: int, num_microbatches: int) -> Plan:
    """The usual (ZeRO-Infinity, and Lightning's) order: each micro-batch through all units, forward then
    backward. Every unit's gradient is complete only in the last micro-batch's backward: each unit is
    stepped right after it there (as vertically, right after its last backward), so the background
    optimizer overlaps the rest of that backward."""
    _check_sizes(num_units, num_microbatches)
    last = num_units - 1
    ops: list[Op] = []
    for m in range(num_microbatches):
        final = m == num_microbatches - 1
        ops += [Op(OpKind.FORWARD, unit, m) for unit in range(last)]
        ops.append(Op(OpKind.FUSED, last, m))
        if final:
            ops.append(Op(OpKind.OPTIMIZER, last))
        for unit in range(last - 1, -1, -1):
            ops.append(Op(OpKind.BACKWARD, unit, m))
            if final:
                ops.append(Op(OpKind.OPTIMIZER, unit))
    plan = Plan(ScheduleKind.HORIZONTAL, num_units, num_microbatches, tuple(ops))
    check_plan(plan)
    return plan


def build_plan(schedule: ScheduleKind | str, num_units: int, num_microbatches: int) -> Plan:
    kind = ScheduleKind(schedule)
    if kind is ScheduleKind.VERTICAL:
        return build_vertical_plan(num_units, num_microbatches)
    return build_horizontal_plan(num_units, num_microbatches)


class PlanError(AssertionError):
    """A plan breaks an invariant: a bug in a plan builder, never a user error."""


def check_plan(plan: Plan) -> None:
    """Checks the data dependencies every executor relies on.

    - every (unit, micro-batch) pair has exactly one forward-side op (F, or L for the last unit) and, below
      the last unit, exactly one B;
    - F u.m comes after F u-1.m; L m after F U-2.m; B U-2.m after L m; B u.m after B u+1.m;
    - every unit has exactly one O, after all of its unit's backward-side ops (L for the last unit, B else);
    - the fused ops run in micro-batch order.
    """
    last = plan.num_units - 1
    position: dict[tuple[OpKind, int, int | None], int] = {}
    for i, op in enumerate(plan.ops):
        key = (op.kind, op.unit, op.microbatch)
        if key in position:
            raise PlanError(f"op {op} appears twice")
        if not 0 <= op.unit <= last:
            raise PlanError(f"op {op} names a unit outside 0..{last}")
        if op.kind is OpKind.FUSED and op.unit != last:
            raise PlanError(f"fused op {op} is not on the last unit {last}")
        if op.kind in (OpKind.FORWARD, OpKind.BACKWARD) and op.unit == last:
            raise PlanError(f"op {op} runs the last unit outside a fused op")
        position[key] = i

    def at(kind: OpKind, unit: int, m: int | None) -> int:
        try:
            return position[(kind, unit, m)]
        except KeyError:
            raise PlanError(f"missing op {Op(kind, unit, m)}") from None

    for m in range(plan.num_microbatches):
        for u in range(last):
            f = at(OpKind.FORWARD, u, m)
            if u > 0 and f < at(OpKind.FORWARD, u - 1, m):
                raise PlanError(f"F{u}.{m} runs before F{u - 1}.{m}")
            b = at(OpKind.BACKWARD, u, m)
            upstream = at(OpKind.FUSED, last, m) if u == last - 1 else at(OpKind.BACKWARD, u + 1, m)
            if b < upstream:
                raise PlanError(f"B{u}.{m} runs before the backward of unit {u + 1}")
        fused = at(OpKind.FUSED, last, m)
        if last > 0 and fused < at(OpKind.FORWARD, last - 1, m):
            raise PlanError(f"L{last}.{m} runs before F{last - 1}.{m}")
    fused = [op.microbatch for op in plan.ops if op.kind is OpKind.FUSED]
    if fused != sorted(fused):  # (each is one training_step, which Lightning calls in micro-batch order)
        raise PlanError(f"fused ops out of micro-batch order: {fused}")
    for u in range(plan.num_units):
        o = at(OpKind.OPTIMIZER, u, None)
        kind = OpKind.FUSED if u == last else OpKind.BACKWARD
        for m in range(plan.num_microbatches):
            if o < at(kind, u, m):
                raise PlanError(f"O{u} runs before {Op(kind, u, m)} completed unit {u}'s gradient")
    expected = plan.num_microbatches * (2 * plan.num_units - 1) + plan.num_units
    if len(plan.ops) != expected:
        raise PlanError(f"plan has {len(plan.ops)} ops, expected {expected}")


def weight_loads_per_window(plan: Plan) -> dict[int, int]:
    """How many times each unit's weights must be brought in, when consecutive ops on the same unit share
    one load. Vertical: 2 per unit (forward pass, backward pass; 1 for the last unit, whose forward and
    backward are fused); horizontal: 2 per micro-batch. This is what the SSD tier will pay."""
    loads = {u: 0 for u in range(plan.num_units)}
    previous_unit: int | None = None
    for op in plan.ops:
        if op.kind is OpKind.OPTIMIZER:
            continue
        if op.unit != previous_unit:
            loads[op.unit] += 1
        previous_unit = op.unit
    return loads


def gradient_spills(plan: Plan) -> dict[int, int]:
    """How many times each unit's gradient is left incomplete: between two of its backward-side ops (B, or
    L for the last unit) another forward or backward op runs, so the partial sum must wait on its tier.
    Vertical: 0 (a unit's backward ops run back to back, then its O); horizontal: one fewer than the
    micro-batches."""
    runs = {u: 0 for u in range(plan.num_units)}
    previous: Op | None = None
    for op in plan.ops:
        if op.kind is OpKind.OPTIMIZER:
            continue
        backward_side = op.kind in (OpKind.BACKWARD, OpKind.FUSED)
        if backward_side and not (previous is not None and previous.unit == op.unit
                                  and previous.kind in (OpKind.BACKWARD, OpKind.FUSED)):
            runs[op.unit] += 1
        previous = op
    return {u: max(0, n - 1) for u, n in runs.items()}


def live_microbatches(plan: Plan) -> int:
    """The most micro-batches one unit holds an input (or, keeping graphs, a graph) for at once: from its
    forward until its backward. Vertical: all of them; horizontal: one."""
    live = {u: 0 for u in range(plan.num_units)}
    most = 0
    for op in plan.ops:
        if op.kind is OpKind.FORWARD:
            live[op.unit] += 1
            most = max(most, live[op.unit])
        elif op.kind is OpKind.BACKWARD:
            live[op.unit] -= 1
    return most


@dataclass(frozen=True)
class WindowFacts:
    """What a window's order means for the costs, derived from its ops (the planner's and the tensor
    manager's, never a schedule's name)."""

    weight_loads: tuple[int, ...]
    """Per unit, the times its weights are brought in (:func:`weight_loads_per_window`)."""
    gradient_spills: tuple[int, ...]
    """Per unit, the times its partial gradient waits on its tier (:func:`gradient_spills`)."""
    live_microbatches: int
    """:func:`live_microbatches`."""

    @property
    def completes_gradients_at_once(self) -> bool:
        """Whether every unit's gradient is complete when its unit is released: none waits partial."""
        return not any(self.gradient_spills)


@functools.cache
def window_facts(schedule: ScheduleKind | str, num_units: int, num_microbatches: int) -> WindowFacts:
    """:class:`WindowFacts` of ``schedule``'s window (built once per shape)."""
    plan = build_plan(schedule, num_units, num_microbatches)
    loads, spills = weight_loads_per_window(plan), gradient_spills(plan)
    return WindowFacts(tuple(loads[u] for u in range(num_units)), tuple(spills[u] for u in range(num_units)),
                       live_microbatches(plan))
