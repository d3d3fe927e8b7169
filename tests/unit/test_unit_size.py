"""Choosing ``layers_per_unit`` (:mod:`lightning_greedysnake.planner.unit_size`): setup's scores over each
candidate's placement and the disks' bandwidth at its request sizes, the warm step's suggestion by the same
model and rule, and the probe that measures that bandwidth on a real file."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import astuple
from pathlib import Path
from typing import Any

import pytest

from lightning_greedysnake.config import GreedySnakeConfig
from lightning_greedysnake.planner.measure import PROBE_SIZES, interpolate, probe_sizes, request_bandwidth
from lightning_greedysnake.planner.plan import merge, staging_bytes
from lightning_greedysnake.planner.roofline import Machine, UnitCost, traffic
from lightning_greedysnake.planner.unit_size import choose_unit_size, machine_at, requests, table

LAYER = 256 << 10  # a small layer: 64K parameters, 256 KiB of fp32 weights
FIRST_STEPS = GreedySnakeConfig().resolved()  # alpha 0.25, lag 2: the settings setup scores with
OPTIONS = {"alphas": (0.25,), "lags": (2,), "recompute": (True,), "activation_placements": ("host",),
           "prefetch_units": 1}  # the same, as the warm-step plan's options


def layers(n: int = 8) -> list[UnitCost]:
    return [UnitCost(0.0, 0.0, weight_bytes=LAYER, grad_bytes=LAYER, master_bytes=0, state_bytes=2 * LAYER,
                     params=LAYER // 4) for _ in range(n)]


def disk(latency_s: float, bytes_per_s: float = 2e9):
    """A disk that serves one request in ``latency_s`` plus its bytes at ``bytes_per_s``."""
    def bandwidth(size: int) -> tuple[float, float]:
        rate = size / (latency_s + size / bytes_per_s)
        return rate, rate
    return bandwidth


class Probed:
    """The measurements setup's plan asks for (:class:`~lightning_greedysnake.planner.setup.Probes`), given."""

    def __init__(self, bandwidth, rate: float) -> None:
        self.bandwidth, self.rates, self.where, self.asked = bandwidth, (rate, None), "/mnt/nvme", []

    def disk(self, requests):
        self.asked.append(list(requests))
        return self.bandwidth


def at_setup(bandwidth, costs: list[UnitCost] | None = None, rate: float = 1e9, on_ssd: frozenset[str] | None = None,
             sizes=(1, 2, 4, 8), budget: int = 1 << 30):
    """Setup's plan (:func:`~lightning_greedysnake.planner.setup.plan_setup`, nothing to place) of ``costs``
    (per layer; no compute, as setup sees them) merged into each size: its scores."""
    from lightning_greedysnake.planner.setup import SetupInputs, Sized, plan_setup

    candidates = {}
    for lpu in sizes:
        units = merge(costs or layers(), lpu)
        if on_ssd is not None:
            units = [dataclasses.replace(u, on_ssd=on_ssd) for u in units]
        candidates[lpu] = Sized(units, {}, 2)
    inputs = SetupInputs(candidates, frozenset(), budget, 4, FIRST_STEPS.lag, False, FIRST_STEPS.alpha, "vertical",
                         False, False, FIRST_STEPS.offload.prefetch_units)
    choice = plan_setup(inputs, Probed(bandwidth, rate))
    assert choice.scores is not None and choice.layers_per_unit == choose_unit_size(choice.scores.plans)
    return choice.scores


def test_a_disk_slow_per_request_gets_larger_units():
    slow = at_setup(disk(latency_s=5e-3))
    assert choose_unit_size(slow.plans) > 1
    assert slow.machines[1].read_bytes_per_s < slow.machines[4].read_bytes_per_s  # larger requests, faster
    assert slow.plans[1].step_s > slow.plans[4].step_s  # the same bytes in fewer, larger requests
    chosen = [line.split()[0] for line in table(slow.plans, slow.machines, slow.ssd_bytes,
                                                choose_unit_size(slow.plans)).splitlines() if "<- chosen" in line]
    assert chosen == [str(choose_unit_size(slow.plans))]


def test_without_compute_setup_scores_the_ssd_bound_step():
    """Setup's costs carry no compute: the roofline's step is the disk's. One unit re-reads no weights (the
    window's last step leaves unit 0's in memory, the fused last unit's backward follows its forward), so
    even a disk fast per request prefers it; its last optimizer step, which nothing overlaps, grows."""
    fast = at_setup(lambda size: (2e9, 2e9))  # no latency: one bandwidth at every request size
    assert fast.machines[1] == fast.machines[8]
    assert astuple(fast.machines[1])[:3] == pytest.approx((2e9, 2e9, 1e9))
    assert fast.plans[8].step_s < fast.plans[1].step_s * 0.9 and choose_unit_size(fast.plans) == 8
    weights_read = 2 * 7 * LAYER / 2e9  # one layer per unit: 7 of 8 layers read in each phase
    tail_growth = 7 * (LAYER // 4) / 1e9  # unit 0's optimizer step: 8 layers' elements instead of 1's
    assert fast.plans[1].step_s - fast.plans[8].step_s >= weights_read - tail_growth  # (and no deferred range)


def test_everything_in_ram_keeps_one_layer_per_unit():
    s = at_setup(lambda size: (math.inf, math.inf), on_ssd=frozenset())
    assert all(v == 0 for v in s.ssd_bytes.values())
    assert choose_unit_size(s.plans) == 1
    said = table(s.plans, s.machines, s.ssd_bytes, 1)  # (nothing measured: said so, never "inf")
    assert "not probed" in said and "inf" not in said, said


def test_the_table_says_one_disk_speed_the_chosen_sizes():
    """The disk's speeds once, at the chosen size's requests (the figures the warm-step plan uses), not a
    speed per candidate: one probe, one pair of figures in the report."""
    slow = at_setup(disk(latency_s=5e-3))
    chosen = choose_unit_size(slow.plans)
    said = table(slow.plans, slow.machines, slow.ssd_bytes, chosen, "/mnt/nvme")
    assert len(re.findall(r"GB/s\b", said)) == 2 and f"disk (/mnt/nvme): {slow.machines[chosen].disk}" in said, said


def test_a_larger_unit_must_win_by_more_than_the_gain():
    s = at_setup(disk(latency_s=5e-3)).plans
    best = choose_unit_size(s)
    assert choose_unit_size(s, gain=0.99) == 1  # nothing beats 1 by 99%
    assert choose_unit_size({lpu: s[lpu] for lpu in s if lpu >= best}) == best
    near = {1: s[1], 2: dataclasses.replace(s[2], step_s=s[1].step_s * 0.91)}
    assert choose_unit_size(near) == 1 and choose_unit_size(near, gain=0.05) == 2


def test_a_candidate_left_out_by_the_budget_is_not_chosen():
    s = at_setup(disk(latency_s=5e-3)).plans
    best = choose_unit_size(s)
    assert choose_unit_size({lpu: v for lpu, v in s.items() if lpu != best}) != best
    staging = {lpu: staging_bytes(merge(layers(), lpu), lag=2) for lpu in (2, 4)}
    small = at_setup(disk(latency_s=5e-3), budget=sum(staging.values()) // 2)  # too small for 4 layers a unit
    assert sorted(small.plans) == [1, 2] and choose_unit_size(small.plans) == 2


def test_the_machine_weights_each_kind_by_the_bytes_it_moves():
    units = merge(layers(), 2)
    moved = traffic(units, "vertical", 4)
    assert astuple(machine_at(units, moved, lambda size: (3e9, 1e9), 5.0))[:3] == pytest.approx((3e9, 1e9, 5.0))
    per_size = disk(latency_s=1e-3)
    machine = machine_at(units, moved, per_size, 5.0, state_slots=2)
    assert per_size(2 * LAYER)[0] == pytest.approx(machine.read_bytes_per_s)  # every request here is 2 layers
    # a state request twice the others: read faster, weighted by the state's share of the bytes read
    single = machine_at(units, moved, per_size, 5.0, state_slots=1)
    assert per_size(2 * LAYER)[0] < single.read_bytes_per_s < per_size(4 * LAYER)[0]


def test_requests_are_the_regions_on_ssd_state_per_slot():
    units = merge(layers(), 2)
    assert sorted(requests(units, state_slots=2)) == [2 * LAYER] * 3  # weights, gradients, one state slot
    assert requests([dataclasses.replace(u, on_ssd=frozenset({"weights"})) for u in units]) == [2 * LAYER]


def test_probe_sizes_bracket_the_requests():
    assert probe_sizes([300 << 10, 3 << 20]) == [256 << 10, 1 << 20, 4 << 20]
    assert probe_sizes([1 << 10]) == [PROBE_SIZES[0]]
    assert probe_sizes([1 << 40]) == [PROBE_SIZES[-1]]
    bandwidth = interpolate({1 << 20: (1.0, 2.0), 4 << 20: (3.0, 4.0)})
    assert bandwidth(2 << 20) == (2.0, 3.0) and bandwidth(1) == (1.0, 2.0) and bandwidth(1 << 30) == (3.0, 4.0)


def test_the_probe_measures_every_size_on_a_real_file_and_removes_it(tmp_path: Path):
    sizes = [64 << 10, 256 << 10]
    measured = request_bandwidth(tmp_path, sizes, threads=2, chunk_bytes=1 << 20, min_probe_bytes=1 << 20)
    assert sorted(measured) == sizes
    assert all(read > 0 and write > 0 for read, write in measured.values())
    assert list(tmp_path.iterdir()) == []


def test_merged_last_unit_recomputes_nothing():
    timed = [dataclasses.replace(u, forward_s=1.0, backward_s=3.0, recompute_s=1.0) for u in layers(4)]
    timed[-1] = dataclasses.replace(timed[-1], recompute_s=0.0, backward_s=2.0)  # the fused last layer
    first, last = merge(timed, 2)
    assert (first.backward_s, first.recompute_s) == (6.0, 2.0)  # recomputed in its backward
    assert (last.backward_s, last.recompute_s) == (4.0, 0.0)  # fused: its graph is kept, nothing recomputed


def compute_bound(n: int = 8) -> list[UnitCost]:
    """Compute-bound units: a recompute is a quarter of each one's time, but the fused last's."""
    costs = [dataclasses.replace(u, forward_s=0.01, backward_s=0.03, recompute_s=0.01 if i < n - 1 else 0.0,
                                 activation_bytes=1 << 20) for i, u in enumerate(layers(n))]
    costs[-1] = dataclasses.replace(costs[-1], backward_s=0.02)
    return costs


def warm_step(settings: GreedySnakeConfig, costs: list[UnitCost], machine: Machine, budget: int = 1 << 30,
              unit_input_bytes: int = 4096, **options: Any):
    """The run's planner's warm-step suggestion (built as setup builds it, K=4, on the CPU, in one process)."""
    from types import SimpleNamespace

    import torch

    from lightning_greedysnake.strategy.planning import Planner, plan_before_setup
    from lightning_greedysnake.strategy.planning.measurements import Measurements
    from lightning_greedysnake.strategy.setup_context import SetupContext

    def nothing(*args: Any) -> None:
        return None

    ctx = SetupContext(dataclasses.replace(settings, auto_host_budget_bytes=budget), torch.device("cpu"), False,
                       0, 0, 1, 1, 4, Path("."), True, SimpleNamespace(loss_scaler=None), lambda obj: obj, nothing,
                       nothing, nothing, nothing, nothing)
    measurements = Measurements(None, 1 << 16, None, 1, True, [Path(".")], settings.offload)  # (not taken here)
    planner = Planner(ctx, plan_before_setup(ctx, torch.nn.Linear(1, 1)), measurements)
    return planner.larger_units(costs, machine, budget, unit_input_bytes, 1, {**OPTIONS, **options})


def test_the_first_step_plan_finds_larger_units_where_they_save_recompute():
    from lightning_greedysnake.planner import plan

    costs, machine = compute_bound(), Machine(2e9, 2e9, 1e9)
    found = warm_step(GreedySnakeConfig(), costs, machine)
    assert found is not None and found[0].layers_per_unit == 8  # one unit: no recompute at all
    current = plan(costs, machine, 4, 1 << 30, 4096, **OPTIONS)
    assert found[1] == current  # this run's units, as the warm-step plan chose for them
    assert found[0].step_s < 0.9 * current.step_s
    assert warm_step(GreedySnakeConfig(layers_per_unit=1), costs, machine) is None  # the user's setting
    assert warm_step(GreedySnakeConfig(), costs, machine, recompute=(False,)) is None  # kept graphs: nothing to save


@pytest.mark.parametrize("case", ["compute-bound", "compute-bound in RAM", "slow disk", "fast disk", "in RAM"])
def test_setup_and_the_warm_step_choose_the_unit_size_alike_from_the_same_costs_and_machine(case):
    """One model and one rule: given the same per-layer costs and the same machine, setup's choice (its
    candidates' units are those layers merged) is the size the warm step suggests (1: none)."""
    costs = compute_bound() if case.startswith("compute-bound") else layers()
    bandwidth = (lambda size: (math.inf, math.inf)) if case.endswith("in RAM") else (
        lambda size: (2e8, 1e8) if case == "slow disk" else (2e9, 2e9))
    if case.endswith("in RAM"):
        costs = [dataclasses.replace(u, on_ssd=frozenset()) for u in costs]
    machine = Machine(*bandwidth(1), 1e9)
    setup = choose_unit_size(at_setup(bandwidth, costs).plans)
    found = warm_step(GreedySnakeConfig(), costs, machine, unit_input_bytes=0)
    assert setup == (1 if found is None else found[0].layers_per_unit)
    assert setup == {"compute-bound": 8, "compute-bound in RAM": 8, "slow disk": 8, "fast disk": 8, "in RAM": 1}[case]


def test_nothing_to_plan_is_a_clear_plan_error():
    from lightning_greedysnake.planner import Machine, PlanError, plan

    with pytest.raises(PlanError, match="activation bytes measured"):  # kept graphs only, none measured
        plan(layers(), Machine(2e9, 2e9, 1e9), 4, 1 << 30, 4096, recompute=(False,))
