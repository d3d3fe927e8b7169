import pytest

from lightning_greedysnake.schedule import (
    Op,
    OpKind,
    Plan,
    PlanError,
    ScheduleKind,
    build_horizontal_plan,
    build_plan,
    build_vertical_plan,
    check_plan,
    gradient_spills,
    live_microbatches,
    weight_loads_per_window,
    window_facts,
)

GOLDEN = {
    ("vertical", 3, 2): "F0.0 F0.1 F1.1 F1.0 L2.0 L2.1 O2 B1.1 B1.0 O1 B0.0 B0.1 O0",
    ("vertical", 4, 3): (
        "F0.2 F0.1 F0.0 F1.0 F1.1 F1.2 F2.2 F2.1 F2.0 L3.0 L3.1 L3.2 O3 "
        "B2.2 B2.1 B2.0 O2 B1.0 B1.1 B1.2 O1 B0.2 B0.1 B0.0 O0"
    ),
    ("vertical", 1, 3): "L0.0 L0.1 L0.2 O0",
    ("vertical", 2, 1): "F0.0 L1.0 O1 B0.0 O0",
    ("horizontal", 3, 2): "F0.0 F1.0 L2.0 B1.0 B0.0 F0.1 F1.1 L2.1 O2 B1.1 O1 B0.1 O0",
    ("horizontal", 1, 2): "L0.0 L0.1 O0",
}


@pytest.mark.parametrize("key", sorted(GOLDEN))
def test_golden_text(key):
    schedule, units, microbatches = key
    assert build_plan(schedule, units, microbatches).text() == GOLDEN[key]


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("units", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 4, 7])
def test_invariants_hold(schedule, units, microbatches):
    plan = build_plan(schedule, units, microbatches)
    check_plan(plan)  # raises on violation
    assert len(plan) == microbatches * (2 * units - 1) + units


@pytest.mark.parametrize("units", [2, 3, 6])
@pytest.mark.parametrize("microbatches", [2, 3, 5])
def test_vertical_is_a_snake(units, microbatches):
    """At every turn the micro-batch that ends one unit's pass starts the next one."""
    plan = build_vertical_plan(units, microbatches)
    passes: list[list[int]] = []
    for op in plan.ops:
        if op.kind is OpKind.OPTIMIZER:
            continue
        key = (op.kind is OpKind.BACKWARD, op.unit)
        if not passes or passes[-1][0] != key:
            passes.append([key, []])
        passes[-1][1].append(op.microbatch)
    for (_, a), (_, b) in zip(passes, passes[1:]):
        assert a[-1] == b[0]
    # the fused ops run in Lightning's micro-batch order
    fused = [op.microbatch for op in plan.ops if op.kind is OpKind.FUSED]
    assert fused == list(range(microbatches))


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("units", [2, 4])
def test_steps_each_unit_right_after_its_last_backward(schedule, units):
    """Either order hands a unit to the optimizer as soon as its gradient is complete (horizontally: in
    the last micro-batch's backward), so the background optimizer overlaps the rest of the backward."""
    plan = build_plan(schedule, units, 3)
    ops = list(plan.ops)
    for u in range(units):
        o = ops.index(Op(OpKind.OPTIMIZER, u))
        kind = OpKind.FUSED if u == units - 1 else OpKind.BACKWARD
        assert ops[o - 1] == Op(kind, u, ops[o - 1].microbatch)


@pytest.mark.parametrize("units,k", [(3, 1), (4, 4), (6, 8)])
def test_weight_loads(units, k):
    vertical = weight_loads_per_window(build_vertical_plan(units, k))
    assert vertical == {**{u: 2 for u in range(units - 1)}, units - 1: 1}
    horizontal = weight_loads_per_window(build_horizontal_plan(units, k))
    assert horizontal[units - 1] == k
    assert all(horizontal[u] >= k for u in range(units - 1))  # the vertical count does not grow with k


def test_checker_catches_a_backward_before_its_upstream():
    good = build_vertical_plan(3, 2)
    ops = list(good.ops)
    i, j = ops.index(Op(OpKind.BACKWARD, 0, 0)), ops.index(Op(OpKind.BACKWARD, 1, 1))
    ops[i], ops[j] = ops[j], ops[i]
    with pytest.raises(PlanError):
        check_plan(Plan(ScheduleKind.VERTICAL, 3, 2, tuple(ops)))


def test_checker_catches_an_early_optimizer_op():
    ops = list(build_vertical_plan(3, 2).ops)
    o = ops.pop(ops.index(Op(OpKind.OPTIMIZER, 1)))
    ops.insert(0, o)
    with pytest.raises(PlanError, match="O1"):
        check_plan(Plan(ScheduleKind.VERTICAL, 3, 2, tuple(ops)))


def test_checker_catches_missing_and_duplicate_ops():
    ops = list(build_horizontal_plan(2, 2).ops)
    with pytest.raises(PlanError, match="missing"):
        check_plan(Plan(ScheduleKind.HORIZONTAL, 2, 2, tuple(ops[1:])))
    with pytest.raises(PlanError, match="twice"):
        check_plan(Plan(ScheduleKind.HORIZONTAL, 2, 2, tuple(ops + ops[:1])))


def test_checker_catches_fused_ops_out_of_micro_batch_order():
    """Each fused op is one training_step, which Lightning calls in micro-batch order: an order that runs them
    otherwise is a builder's bug (the engine would wait for a training_step that never comes)."""
    ops = list(build_vertical_plan(1, 3).ops)
    ops[0], ops[1] = ops[1], ops[0]
    with pytest.raises(PlanError, match="micro-batch order"):
        check_plan(Plan(ScheduleKind.VERTICAL, 1, 3, tuple(ops)))


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("units", [1, 2, 5])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_what_an_order_costs_is_derived_from_its_ops(schedule, units, k):
    """What the planner and the tensor manager rely on, from the op list (never the schedule's name): the
    weight loads, how often a partial gradient waits, and how many micro-batches' inputs (or graphs) a unit
    holds at once, as each builder documents them; identical op lists give identical facts."""
    plan = build_plan(schedule, units, k)
    facts = window_facts(schedule, units, k)
    loads = weight_loads_per_window(plan)
    assert facts.weight_loads == tuple(loads[u] for u in range(units))
    last = units - 1
    if schedule == "vertical" or units == 1 or k == 1:
        # (one unit or one micro-batch: both orders are the same ops)
        assert facts.weight_loads == (*[2] * last, 1) and facts.completes_gradients_at_once
        assert facts.live_microbatches == (k if units > 1 else 0)
    else:
        assert facts.weight_loads == (k + 1, *[2 * k] * (last - 1), k)
        assert facts.gradient_spills == (k - 1,) * units and not facts.completes_gradients_at_once
        assert facts.live_microbatches == 1
    if units == 1 or k == 1:
        other = "horizontal" if schedule == "vertical" else "vertical"
        assert build_plan(other, units, k).ops == plan.ops and window_facts(other, units, k) == facts
    assert gradient_spills(plan) == dict(enumerate(facts.gradient_spills)) and live_microbatches(plan) == facts.live_microbatches


@pytest.mark.parametrize("bad", [(0, 2), (2, 0), (-1, 1)])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        build_vertical_plan(*bad)


def test_unknown_schedule():
    with pytest.raises(ValueError):
        build_plan("diagonal", 2, 2)
