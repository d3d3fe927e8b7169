"""The placement plan: which kinds the host budget keeps in RAM (pure arithmetic over region sizes)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from lightning_greedysnake.config import GreedySnakeConfig, Tier
from lightning_greedysnake.layout import unit_tiers
from lightning_greedysnake.planner.placement import KINDS, host_units_within, plan_placement
from lightning_greedysnake.planner.roofline import UnitCost
from lightning_greedysnake.strategy.planning.placement import (
    as_placement,
    available_memory_bytes,
    host_budget_bytes,
)

MB = 1 << 20
N = 6


def units(master: bool = True, alpha: float = 0.25) -> list[UnitCost]:
    """N blocks: 2 MB of 16-bit weights (1M params), 4 MB of gradient, 4 MB of master, 8 MB of state."""
    return [UnitCost(0.0, 0.0, weight_bytes=2 * MB if master else 4 * MB, grad_bytes=4 * MB,
                     master_bytes=4 * MB if master else 0, state_bytes=8 * MB, params=MB,
                     alpha_weight_bytes=int(alpha * 2 * MB) if u else 0, alpha_grad_bytes=int(alpha * 4 * MB) if u else 0)
            for u in range(N)]


def kept(costs: list[UnitCost]) -> dict[str, list[int]]:
    return {"weights": [u.weight_bytes for u in costs], "master_weights": [u.master_bytes for u in costs],
            "optimizer_states": [u.state_bytes for u in costs], "gradients": [u.grad_bytes for u in costs]}


def test_a_budget_for_everything_keeps_everything_in_ram_and_moves_no_bytes():
    costs = units()
    plan = plan_placement(costs, kept(costs), KINDS, budget_bytes=10**12, reserved_bytes=64 * MB,
                          schedule="vertical", k=4)
    assert all(k.host_units == N for k in plan.kinds.values())
    assert plan.traffic.read_bytes == plan.traffic.write_bytes == 0
    assert plan.all_ssd.read_bytes > 0


def test_no_room_keeps_everything_on_ssd():
    costs = units()
    plan = plan_placement(costs, kept(costs), KINDS, budget_bytes=64 * MB, reserved_bytes=64 * MB,
                          schedule="vertical", k=4)
    assert all(k.host_units == 0 for k in plan.kinds.values())
    assert plan.traffic == plan.all_ssd


def test_weights_come_first_then_state_and_master_and_the_budget_is_never_exceeded():
    """Weights move three times their bytes a step (two reads, one write), master weights and state
    twice, gradients only their deferred range: RAM goes to them in that order."""
    costs = units()
    reserved = 10 * MB
    for room_mb in range(0, 120, 3):
        budget = reserved + room_mb * MB
        plan = plan_placement(costs, kept(costs), KINDS, budget, reserved, "vertical", k=4)
        assert plan.host_bytes <= budget
        w, m, s, g = (plan.kinds[k].host_units for k in ("weights", "master_weights", "optimizer_states", "gradients"))
        if w < N:  # nothing else before the weights are all in
            assert m == s == g == 0 and w == room_mb // 2
        if g or s:
            assert m == N  # (master before state on a tie; gradients may take what the next state unit can't)
        moved = plan.traffic.read_bytes + plan.traffic.write_bytes
        if room_mb:
            assert moved < plan.all_ssd.read_bytes + plan.all_ssd.write_bytes
    # enough for the weights and part of the next kind: the weights all in, the rest a prefix
    plan = plan_placement(costs, kept(costs), KINDS, reserved + 30 * MB, reserved, "vertical", k=4)
    assert plan.kinds["weights"].host_units == N and 0 < plan.kinds["master_weights"].host_units + plan.kinds[
        "optimizer_states"].host_units


def test_the_users_kinds_are_kept_and_their_ram_counts_against_the_budget():
    costs = units()
    reserved = 10 * MB
    # the user keeps the state on SSD, and 3 units of the weights in RAM
    costs = [dataclasses.replace(u, on_ssd=u.on_ssd - {"weights"} if i < 3 else u.on_ssd) for i, u in enumerate(costs)]
    plan = plan_placement(costs, kept(costs), ("master_weights", "gradients"), reserved + 20 * MB, reserved,
                          "vertical", k=4)
    assert plan.kinds["optimizer_states"].host_units == 0 and not plan.kinds["optimizer_states"].planned
    assert plan.kinds["weights"].host_units == 3 and not plan.kinds["weights"].planned
    # 6 MB of the 20 are the user's weights: 14 MB left, 3 master units (12 MB)
    assert plan.kinds["master_weights"].host_units == 3 and plan.kinds["master_weights"].planned
    assert plan.host_bytes <= reserved + 20 * MB


def test_a_kind_with_no_bytes_goes_to_ram_and_one_that_moves_nothing_stays_put():
    costs = units(master=False, alpha=0.0)  # 32-true: no master copy; alpha 0: gradients never wait
    plan = plan_placement(costs, kept(costs), KINDS, 10 * MB, 10 * MB, "vertical", k=4)
    assert plan.kinds["master_weights"].host_units == N  # nothing to keep: no file for it
    plan = plan_placement(costs, kept(costs), KINDS, 10**12, 10 * MB, "vertical", k=4)
    assert plan.kinds["gradients"].host_units == 0  # would take RAM and save nothing
    horizontal = plan_placement(costs, kept(costs), KINDS, 10**12, 10 * MB, "horizontal", k=4)
    assert horizontal.kinds["gradients"].host_units == N  # partial sums go out and back every micro-batch


def test_the_config_value_keeps_exactly_the_planned_units():
    rng = random.Random(0)
    for _ in range(2000):
        sizes = [rng.choice([0, 4096, 8192, 3 * 4096, 1 << 20]) for _ in range(rng.randint(1, 9))]
        h = rng.randint(0, len(sizes))
        tiers = unit_tiers(sizes, as_placement(sizes, h))
        # every unit that holds bytes is where the plan put it (one of 0 bytes holds nothing anywhere)
        assert [t is Tier.HOST for t, size in zip(tiers, sizes) if size] == [u < h for u, size in enumerate(sizes) if size]
        d = rng.randint(0, h)  # and three ways: a device prefix, then RAM, then SSD
        placement = as_placement(sizes, h, d)
        GreedySnakeConfig(offload={"weights": placement})  # (a valid setting)
        tiers = unit_tiers(sizes, placement)
        want = [Tier.DEVICE if u < d else Tier.HOST if u < h else Tier.SSD for u, size in enumerate(sizes) if size]
        assert [t for t, size in zip(tiers, sizes) if size] == want


def test_on_a_gpu_the_compute_weights_go_to_the_device_first_and_take_no_ram():
    costs = units()
    reserved = 10 * MB
    plan = plan_placement(costs, kept(costs), KINDS, reserved + 8 * MB, reserved, "vertical", k=4, device_room=7 * MB)
    w = plan.kinds["weights"]
    assert (w.device_units, w.host_units, w.device_bytes) == (3, N, 6 * MB)  # 3 on the device, 3 in RAM
    # the units placed so, as the roofline scores the plan: the device's weights stage a step's new values
    assert [("weights" in u.on_device, "weights" in u.on_ssd) for u in plan.units] == [(True, False)] * 3 + [
        (False, False)] * 3
    assert w.host_bytes == 6 * MB and plan.host_bytes <= reserved + 8 * MB
    assert plan.kinds["master_weights"].host_units == 0  # (2 MB left: not one 4 MB master unit)
    assert "device 3/6 units, host 3/6 units" in plan.table() and "device room for weights" in plan.table()
    # the user's weights are kept as given (and on the device they take no RAM)
    on_device = [dataclasses.replace(u, on_ssd=u.on_ssd - {"weights"}, on_device=frozenset({"weights"})) for u in costs]
    given = plan_placement(on_device, kept(costs), ("master_weights", "optimizer_states", "gradients"),
                           reserved + 8 * MB, reserved, "vertical", k=4, device_room=7 * MB)
    assert given.kinds["weights"].device_units == N and given.kinds["master_weights"].host_units == 2
    assert given.traffic.read_bytes < plan.traffic.read_bytes


def test_host_units_within_is_a_prefix():
    assert host_units_within([4, 4, 4], 8) == 2
    assert host_units_within([4, 9, 1], 12) == 1  # a prefix: the small last unit does not jump the queue
    assert host_units_within([4], 0) == 0


def test_the_default_budget_is_half_the_available_memory_shared_by_the_processes():
    assert host_budget_bytes(GreedySnakeConfig(auto_host_budget_bytes=123 << 20), 4) == 123 << 20
    available = available_memory_bytes()
    assert 0 < available
    got = host_budget_bytes(GreedySnakeConfig(), 2)
    assert abs(got - available // 4) < available // 20  # (memory moves a little between the two reads)


@pytest.mark.parametrize("value", [{"host": 0.5, "ssd": 0.5}, "device"])
def test_checkpoints_are_not_split(value):
    if value == "device":
        GreedySnakeConfig(offload={"activations": "device"})
        return
    with pytest.raises(ValueError, match="activations"):
        GreedySnakeConfig(offload={"activations": value})
