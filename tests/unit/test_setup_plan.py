"""Setup's plan in one call (:func:`lightning_greedysnake.planner.setup.plan_setup`): each candidate size
placed within the host budget and scored as placed, the disks asked at most once and only where there is a
choice and bytes to move, a size whose staging exceeds the budget refused, the smallest size where the
disk cannot be measured, the horizontal order where nothing streams. Pure: the inputs are given here as the
strategy's planning sizes them (the integration tests run it inside a fit)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_greedysnake.planner.plan import merge, staging_bytes
from lightning_greedysnake.planner.setup import SetupInputs, Sized, plan_setup
from tests.unit.test_unit_size import LAYER, Probed, disk, layers

KINDS = ("weights", "master_weights", "optimizer_states", "gradients")


def sized(lpu: int, n: int = 8, on_ssd: frozenset[str] | None = None) -> Sized:
    units = merge(layers(n), lpu)  # (every unit but the first defers a quarter of its gradient, as alpha 0.25)
    units = [dataclasses.replace(u, alpha_grad_bytes=u.grad_bytes // 4 if i else 0) for i, u in enumerate(units)]
    if on_ssd is not None:
        units = [dataclasses.replace(u, on_ssd=on_ssd) for u in units]
    kept = {"weights": [u.weight_bytes for u in units], "master_weights": [u.master_bytes for u in units],
            "optimizer_states": [u.state_bytes for u in units], "gradients": [u.grad_bytes for u in units]}
    return Sized(units, kept, 2)


def inputs(sizes=(1, 2, 4, 8), planned=frozenset(), budget: int = 1 << 30, schedule_planned: bool = False,
           on_ssd: frozenset[str] | None = None, lag_planned: bool = False) -> SetupInputs:
    return SetupInputs({lpu: sized(lpu, on_ssd=on_ssd) for lpu in sizes}, frozenset(planned), budget, 4, 2,
                       lag_planned, 0.25, "vertical", schedule_planned, False, 1)


def test_the_disk_is_asked_once_and_only_where_there_is_a_choice_and_bytes_move():
    probes = Probed(disk(latency_s=5e-3), 1e9)
    choice = plan_setup(inputs(), probes)
    assert len(probes.asked) == 1 and choice.scores is not None and choice.layers_per_unit > 1
    # every candidate's requests in the one ask: the optimizer state's per slot, the smallest unit's
    assert min(probes.asked[0]) == 2 * LAYER // 2 and max(probes.asked[0]) == 8 * 2 * LAYER // 2
    one = Probed(disk(latency_s=5e-3), 1e9)
    assert plan_setup(inputs(sizes=(2,)), one).layers_per_unit == 2 and not one.asked  # the user's size
    ram = Probed(disk(latency_s=5e-3), 1e9)
    choice = plan_setup(inputs(on_ssd=frozenset()), ram)
    assert not ram.asked and choice.layers_per_unit == 1 and choice.scores.probed == ""


def test_a_disk_that_cannot_be_measured_leaves_the_smallest_size_and_says_why():
    class Broken(Probed):
        def disk(self, requests):
            raise OSError(28, "No space left on device")

    choice = plan_setup(inputs(), Broken(None, 1e9))
    assert choice.layers_per_unit == 1 and choice.scores is None
    assert "could not be measured" in choice.fallback and "No space left" in choice.fallback


def test_a_size_whose_staging_exceeds_the_budget_is_refused_and_no_candidate():
    need = {lpu: staging_bytes(merge(layers(), lpu), 2) for lpu in (1, 2)}
    budget = (need[1] + need[2]) // 2 * 8 // 7  # one layer a unit fits, two do not (an eighth: activations)
    probes = Probed(disk(latency_s=5e-3), 1e9)
    choice = plan_setup(inputs(planned=KINDS, budget=budget), probes)
    assert max(probes.asked[0]) == LAYER  # (one layer's requests: the larger sizes' are not asked for)
    assert choice.refused_staging_bytes is None and choice.layers_per_unit == 1 and sorted(choice.scores.plans) == [1]
    refused = plan_setup(inputs(sizes=(2,), planned=KINDS, budget=(need[1] + need[2]) // 2), Probed(None, 1e9))
    assert (refused.refused_staging_bytes, refused.lag, refused.layers_per_unit) == (need[2], 2, 2)


def test_a_size_whose_staging_crowds_out_the_saved_activations_is_no_candidate_beside_one_that_leaves_room():
    """Two layers a unit fit the budget by their staging alone but leave less than the saved activations'
    eighth (which the warm-step plan then needs, for them or for kept graphs): one layer a unit is chosen,
    though the disk favours larger requests; where every size crowds it out, they are still scored."""
    need = {lpu: staging_bytes(merge(layers(), lpu), 2) for lpu in (1, 2)}
    budget = need[2] * 15 // 14  # two fit by staging, not beside an eighth; one does
    assert need[2] <= budget < need[2] + budget // 8 and need[1] + budget // 8 <= budget
    choice = plan_setup(inputs(planned=KINDS, budget=budget), Probed(disk(latency_s=5e-3), 1e9))
    assert choice.refused_staging_bytes is None and choice.layers_per_unit == 1 and sorted(choice.scores.plans) == [1]
    crowded = plan_setup(inputs(sizes=(2,), planned=KINDS, budget=budget), Probed(disk(latency_s=5e-3), 1e9))
    assert crowded.refused_staging_bytes is None and crowded.layers_per_unit == 2


@pytest.mark.parametrize("share", [0.4, 0.7])
def test_each_size_is_scored_as_it_is_placed(share):
    """The SSD bytes a candidate is scored with are those of its own placement (the planned kinds moved off
    the SSD by whole units), not those of every kind on SSD."""
    total = sum(sum(b) for b in sized(1).kept.values())
    budget = int((staging_bytes(merge(layers(), 2), 2) + share * total) * 8 / 7)  # (an eighth: activations)
    choice = plan_setup(inputs(sizes=(1, 2), planned=KINDS, budget=budget), Probed(disk(latency_s=5e-3), 1e9))
    lpu, placement = choice.layers_per_unit, choice.placement
    held = [k for k in placement.kinds.values() if k.total_bytes]  # (no master weights here: fp32)
    assert any(k.host_units for k in held) and any(k.host_units < k.num_units for k in held), placement
    moved = placement.traffic.read_bytes + placement.traffic.write_bytes
    assert choice.scores.ssd_bytes[lpu] == moved < placement.all_ssd.read_bytes + placement.all_ssd.write_bytes


@pytest.mark.parametrize("planned_order", [True, False])
def test_the_horizontal_order_only_where_nothing_streams_and_the_order_is_the_plans(planned_order):
    roomy = plan_setup(inputs(planned=KINDS, schedule_planned=planned_order), Probed(disk(5e-3), 1e9))
    assert all(k.host_units == k.num_units for k in roomy.placement.kinds.values())  # all in RAM
    assert roomy.schedule == ("horizontal" if planned_order else "vertical")
    half = int((staging_bytes(merge(layers(), 1), 2) + 4 * LAYER * 8 / 2) * 8 / 7)  # half of the state fits
    tight = plan_setup(inputs(sizes=(1,), planned=KINDS, budget=half, schedule_planned=planned_order), Probed(None, 1e9))
    assert tight.schedule == "vertical"  # (something streams)


def test_the_first_windows_lag_is_the_deepest_whose_staging_fits():
    need = {lag: staging_bytes(merge(layers(), 1), lag) for lag in (0, 1, 2)}
    budget = need[1] * 8 // 7 + 8  # lag 1's staging and the saved activations' eighth fit, lag 2's do not
    choice = plan_setup(inputs(sizes=(1,), planned=KINDS, budget=budget, lag_planned=True), Probed(None, 1e9))
    assert choice.refused_staging_bytes is None and choice.lag == 1
    assert plan_setup(inputs(sizes=(1,), planned=KINDS, budget=budget), Probed(None, 1e9)).lag == 2  # (yours)
