"""Choosing ``layers_per_unit`` at setup (:mod:`lightning_greedysnake.planner.unit_size`): the arithmetic
over each candidate's placement and the disks' bandwidth at its request sizes, and the probe that
measures that bandwidth on a real file."""

from __future__ import annotations

import dataclasses
from typing import Any
import math
from pathlib import Path

import pytest

from lightning_greedysnake.planner.measure import PROBE_SIZES, interpolate, probe_sizes, request_bandwidth
from lightning_greedysnake.planner.plan import merge
from lightning_greedysnake.planner.roofline import UnitCost, traffic
from lightning_greedysnake.planner.unit_size import choose_unit_size, requests, score_unit_size, table

LAYER = 256 << 10  # a small layer: 64K parameters, 256 KiB of fp32 weights


def layers(n: int = 8) -> list[UnitCost]:
    return [UnitCost(0.0, 0.0, weight_bytes=LAYER, grad_bytes=LAYER, master_bytes=0, state_bytes=2 * LAYER,
                     params=LAYER // 4) for _ in range(n)]


def disk(latency_s: float, bytes_per_s: float = 2e9):
    """A disk that serves one request in ``latency_s`` plus its bytes at ``bytes_per_s``."""
    def bandwidth(size: int) -> tuple[float, float]:
        rate = size / (latency_s + size / bytes_per_s)
        return rate, rate
    return bandwidth


def scores(bandwidth, rate: float = 1e9, on_ssd: frozenset[str] | None = None, sizes=(1, 2, 4, 8)):
    out = {}
    for lpu in sizes:
        units = merge(layers(), lpu)
        if on_ssd is not None:
            units = [dataclasses.replace(u, on_ssd=on_ssd) for u in units]
        out[lpu] = score_unit_size(lpu, units, traffic(units, "vertical", 4), bandwidth, rate, state_slots=2)
    return out


def test_a_disk_slow_per_request_gets_larger_units_a_fast_one_the_smallest():
    slow = scores(disk(latency_s=5e-3))
    assert choose_unit_size(slow) > 1
    assert slow[1].ssd_s > slow[4].ssd_s  # the same bytes in fewer, larger requests
    fast = scores(disk(latency_s=0.0))
    assert choose_unit_size(fast) == 1  # nothing to gain; the fill and the last step grow with the unit
    assert fast[8].fill_s == pytest.approx(fast[8].ssd_s)  # one unit: nothing overlaps its transfers
    assert fast[1].tail_s < fast[8].tail_s
    chosen = [line.split()[0] for line in table(slow, choose_unit_size(slow)).splitlines() if "<- chosen" in line]
    assert chosen == [str(choose_unit_size(slow))]


def test_everything_in_ram_keeps_one_layer_per_unit():
    s = scores(lambda size: (math.inf, math.inf), on_ssd=frozenset())
    assert all(v.ssd_bytes == 0 and v.ssd_s == 0 for v in s.values())
    assert choose_unit_size(s) == 1


def test_a_larger_unit_must_win_by_more_than_the_tolerance():
    s = scores(disk(latency_s=5e-3))
    best = choose_unit_size(s)
    assert choose_unit_size(s, tolerance=0.99) == 1  # nothing beats 1 by 99%
    assert choose_unit_size({lpu: s[lpu] for lpu in s if lpu >= best}) == best


def test_a_candidate_left_out_by_the_budget_is_not_chosen():
    s = scores(disk(latency_s=5e-3))
    best = choose_unit_size(s)
    assert choose_unit_size({lpu: v for lpu, v in s.items() if lpu != best}) != best


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


def test_the_first_step_plan_finds_larger_units_where_they_save_recompute():
    from types import SimpleNamespace

    from lightning_greedysnake.config import GreedySnakeConfig
    from lightning_greedysnake.planner import Machine, plan
    from lightning_greedysnake.strategy.auto_plan import WarmStepPlan

    # compute-bound units: a recompute is a quarter of each one's time, but the fused last's
    costs = [dataclasses.replace(u, forward_s=0.01, backward_s=0.03, recompute_s=0.01 if i < 7 else 0.0,
                                 activation_bytes=1 << 20) for i, u in enumerate(layers())]
    costs[-1] = dataclasses.replace(costs[-1], backward_s=0.02)
    machine, k, budget, manager = Machine(2e9, 2e9, 1e9), 4, 1 << 30, SimpleNamespace(checkpoint_bytes=4096)

    def larger(settings: GreedySnakeConfig, recompute: bool) -> tuple[Any, int] | None:
        options = {"alphas": (0.25,), "lags": (2,), "recompute": (recompute,), "checkpoint_placements": ("host",)}
        choice = plan(costs, machine, k, budget, manager.checkpoint_bytes, layers_per_unit=(1,), **options)
        return WarmStepPlan(settings, budget).larger_units(costs, machine, k, budget, manager, choice, 1, options)

    found = larger(GreedySnakeConfig(), recompute=True)
    assert found is not None and found[1] == 8  # one unit: no recompute at all
    assert found[0].step_s < 0.95 * plan(costs, machine, k, budget, 4096, layers_per_unit=(1,), alphas=(0.25,),
                                         lags=(2,), recompute=(True,), checkpoint_placements=("host",)).step_s
    assert larger(GreedySnakeConfig(layers_per_unit=1), recompute=True) is None  # the user's setting
    assert larger(GreedySnakeConfig(), recompute=False) is None  # kept graphs: nothing left to save


def test_nothing_to_plan_is_a_clear_plan_error():
    from lightning_greedysnake.planner import Machine, PlanError, plan

    with pytest.raises(PlanError, match="activation bytes measured"):  # kept graphs only, none measured
        plan(layers(), Machine(2e9, 2e9, 1e9), 4, 1 << 30, 4096, recompute=(False,))
