import dataclasses
import math
from typing import Any

import pytest
import torch

from lightning_greedysnake.planner import (
    Machine,
    PlanError,
    UnitCost,
    plan,
    read_ahead_bytes,
    score,
    staging_bytes,
    traffic,
    window_tail,
)

MB = 1 << 20


def layers(n: int = 8, forward_s: float = 0.01, backward_s: float = 0.03, params: int = 1_000_000) -> list[UnitCost]:
    return [UnitCost(forward_s, backward_s, weight_bytes=4 * params, grad_bytes=4 * params, master_bytes=0,
                     state_bytes=8 * params, params=params) for _ in range(n)]


FAST = Machine(read_bytes_per_s=1e13, write_bytes_per_s=1e13, optimizer_elements_per_s=1e12)


def test_a_slow_optimizer_is_split_between_the_phases():
    """Backward is busy with compute; when the optimizer's CPU time exceeds it, deferring part of the
    update into the (lighter) forward phase shortens the step: alpha > 0 wins, with overlap on."""
    slow_cpu = Machine(read_bytes_per_s=1e13, write_bytes_per_s=1e13, optimizer_elements_per_s=6e6)
    choice = plan(layers(), slow_cpu, k=4, host_budget_bytes=10**12, unit_input_bytes=MB)
    assert choice.alpha > 0 and choice.lag > 0
    f0, b0 = score(layers(), slow_cpu, 4, 0.0, choice.lag, MB, "host")
    assert choice.step_s < f0 + b0


def test_a_cheap_optimizer_needs_no_deferral_and_the_step_is_compute_bound():
    choice = plan(layers(), FAST, k=4, host_budget_bytes=10**12, unit_input_bytes=MB)
    compute = 4 * sum(u.forward_s + u.backward_s for u in layers())
    assert choice.step_s == pytest.approx(compute)


def test_without_overlap_the_optimizer_adds_to_the_step():
    f, b = score(layers(), Machine(1e13, 1e13, 8e6), 4, 0.0, 0, MB, "host")
    f2, b2 = score(layers(), Machine(1e13, 1e13, 8e6), 4, 0.0, 2, MB, "host")
    assert f + b > f2 + b2


def test_on_shared_cores_the_background_step_hides_only_its_io():
    """A CPU run (the lane's kernels on the training's cores): with every kind in RAM the background step
    has nothing to hide, and the synchronous step on the training thread's threads wins, as
    Lightning's own step; where the state streams from a disk the background step still hides the I/O.
    On a device (cores not shared) the same RAM run keeps the background step."""
    ram = [dataclasses.replace(u, master_bytes=4 * u.params, on_ssd=frozenset()) for u in layers()]
    cpu = Machine(math.inf, math.inf, optimizer_elements_per_s=2e8, inline_optimizer_elements_per_s=3e8,
                  shared_cores=True)
    assert plan(ram, cpu, k=4, host_budget_bytes=10**12, unit_input_bytes=MB).lag == 0
    f0, b0 = score(ram, cpu, 4, 0.0, 0, MB, "host")
    f1, b1 = score(ram, cpu, 4, 0.0, 1, MB, "host")
    compute = 4 * sum(u.forward_s + u.backward_s for u in ram)
    params = sum(u.params for u in ram)
    assert f0 + b0 == pytest.approx(compute + params / 3e8)  # in line, at the training thread's rate
    assert f1 + b1 == pytest.approx(compute + params / 2e8)  # on the lane, at its own: not hidden
    gpu = dataclasses.replace(cpu, shared_cores=False)
    assert plan(ram, gpu, k=4, host_budget_bytes=10**12, unit_input_bytes=MB).lag > 0
    disk = dataclasses.replace(cpu, read_bytes_per_s=2e9, write_bytes_per_s=2e9)
    assert plan(layers(), disk, k=4, host_budget_bytes=10**12, unit_input_bytes=MB).lag > 0


def test_a_tight_budget_moves_checkpoints_to_ssd_and_lowers_lag():
    disk = Machine(read_bytes_per_s=2e9, write_bytes_per_s=2e9, optimizer_elements_per_s=1e12)
    roomy = plan(layers(), disk, k=16, host_budget_bytes=10**12, unit_input_bytes=64 * MB)
    assert roomy.activations == "host"  # seven checkpoint writes per micro-batch would cost disk time
    tight_budget = staging_bytes(layers(), 0) + 4 * MB  # (the budget holds its 16 MiB slack) 4 MiB: not lag 1
    tight = plan(layers(), disk, k=16, host_budget_bytes=tight_budget, unit_input_bytes=64 * MB)
    assert tight.activations == "ssd" and tight.lag == 0 and tight.host_bytes <= tight_budget


def test_nothing_fits_is_a_clear_error_with_the_smallest_need():
    with pytest.raises(PlanError, match=r"budget of 1,000 bytes; the smallest needs [\d,]+.*Fix"):
        plan(layers(), FAST, k=4, host_budget_bytes=1000, unit_input_bytes=MB)


@pytest.mark.parametrize("placement", ["ssd", "split"])
def test_the_planners_memory_model_is_the_tensor_managers(placement, tmp_path):
    """One staging rule: the planner's budget (staging_bytes, which setup's plan and the warm-step plan
    take) and the budget the tensor manager takes are the same number, for every lag and number of
    prefetched units, with every kind on SSD and with weights and state split host/SSD."""
    import torch

    from lightning_greedysnake import GPT, GPTConfig, OffloadConfig
    from lightning_greedysnake.config import Split
    from lightning_greedysnake.models import find_layered_model, make_units
    from lightning_greedysnake.strategy.planning.placement import unit_costs
    from lightning_greedysnake.tensor_manager import TieredTensorStore

    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=8))
    _, _, chain = find_layered_model(model)
    units = make_units(chain, 1)
    opt = torch.optim.AdamW(model.parameters())
    kinds = {} if placement == "ssd" else {"weights": Split(host=0.5, ssd=0.5),
                                          "optimizer_states": Split(host=0.5, ssd=0.5)}
    for prefetch_units in (0, 1, 2, 3):
        config = OffloadConfig(prefetch_units=prefetch_units, **kinds).placed()
        for lag in (0, 1, 2):
            manager = TieredTensorStore(units, {}, opt, config, lag=lag)
            try:
                manager.open(tmp_path)
                costs = unit_costs(manager)
                budget = manager.pool.budget_bytes
                assert staging_bytes(costs, lag, prefetch_units) == budget, (prefetch_units, lag)
            finally:
                manager.close()


def test_the_plan_command_measures_and_prints_a_strategy(tmp_path, capsys):
    from lightning_greedysnake.plan import main

    main(["--n-embd", "64", "--n-layer", "2", "--n-head", "2", "--vocab", "128", "--seq", "16", "--k", "4",
          "--offload-dir", str(tmp_path), "--probe-mb", "8", "--precision", "32-true"])
    out = capsys.readouterr().out
    assert "measured: SSD read" in out and "predicted step (s)" in out
    assert "GreedySnakeStrategy(alpha=" in out
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plan_commands_units_are_the_tensor_managers(dtype, tmp_path):
    """One unit-cost model: the plan command sizes a GPT's units as the tensor manager lays them out (the
    embedding in the first unit, the head in the last, regions aligned), not by a formula of its own."""
    from lightning_greedysnake import GPT, GPTConfig, OffloadConfig
    from lightning_greedysnake.models import find_layered_model, make_units
    from lightning_greedysnake.plan import gpt_costs
    from lightning_greedysnake.strategy.planning.placement import unit_costs
    from lightning_greedysnake.tensor_manager import TieredTensorStore

    config = GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=64, block_size=8)
    model = GPT(config)
    _, _, chain = find_layered_model(model)
    manager = TieredTensorStore(make_units(chain, 1), {}, torch.optim.AdamW(model.parameters()),
                                OffloadConfig().placed(), compute_dtype=dtype, lag=0)
    try:
        manager.open(tmp_path)
        sizes = ("weight_bytes", "grad_bytes", "master_bytes", "state_bytes", "params")
        expected = [{f: getattr(c, f) for f in sizes} for c in unit_costs(manager)]
    finally:
        manager.close()
    costs = gpt_costs(config, dtype, 0.5, 1.5, 7)
    assert [{f: getattr(c, f) for f in sizes} for c in costs] == expected
    assert sum(c.params for c in costs) == sum(p.numel() for p in model.parameters())
    assert [(c.forward_s, c.backward_s, c.recompute_s) for c in costs] == [(0.5, 1.5, 0.5)] * 2 + [(0.5, 1.5, 0.0)]


def test_unit_times_take_each_ops_time_with_nothing_beside_it():
    """The plan's compute per unit is the fastest of its micro-batches' ops: the others ran beside the
    optimizer lane or the I/O threads, costs the roofline counts apart (a mean counted them twice)."""
    from lightning_greedysnake.planner.measure import unit_times

    spans = {"compute": [(0.0, 0.010, "F0.0"), (0.010, 0.030, "F0.1"),  # the second slowed by the lane
                         (0.030, 0.035, "L1.0 forward"), (0.035, 0.055, "L1.0 backward"),
                         (0.055, 0.105, "B0.1"), (0.105, 0.135, "B0.0")],
             "optimizer": [(0.012, 0.028, "optimizer")]}
    fwd, bwd = unit_times(spans, 2)
    assert fwd == pytest.approx([0.010, 0.005]) and bwd == pytest.approx([0.030, 0.020])


def test_on_a_disk_bound_machine_deferral_only_costs_and_alpha_stays_zero():
    slow_disk = Machine(read_bytes_per_s=2e8, write_bytes_per_s=2e8, optimizer_elements_per_s=1e12)
    choice = plan(layers(), slow_disk, k=4, host_budget_bytes=10**12, unit_input_bytes=MB)
    assert choice.alpha == 0.0


def test_spare_memory_buys_a_second_optimizer_buffer_that_overlaps_the_optimizers_compute_with_its_io():
    """One working set: the optimizer lane reads a unit, steps it, writes it back, in turn. A second
    one reads the next unit while this one steps: where the lane binds, the step shortens."""
    disk = Machine(read_bytes_per_s=5e8, write_bytes_per_s=5e8, optimizer_elements_per_s=2.5e7)
    lean = score(layers(), disk, 1, 0.0, 2, MB, "host", double_buffered=False)
    double = score(layers(), disk, 1, 0.0, 2, MB, "host", double_buffered=True)
    assert sum(double) < sum(lean)
    roomy = plan(layers(), disk, k=1, host_budget_bytes=10**12, unit_input_bytes=MB)
    assert roomy.buffer_budget_bytes > staging_bytes(layers(), roomy.lag)


@pytest.mark.parametrize("state_units_on_ssd", [8, 3])
def test_one_disk_serves_reads_and_writes_in_turn_and_only_the_bytes_on_ssd(state_units_on_ssd):
    """Where the disk binds, the step is every SSD byte the tensor manager moves (the roofline's traffic
    model, which the tests hold to the manager's counters) over its bandwidth, reads and writes summed
    (a read stream beside a write stream is no faster on one disk), whatever the buffers; regions in
    host memory move nothing."""
    units = [dataclasses.replace(u, on_ssd=u.on_ssd - ({"optimizer_states"} if i < 8 - state_units_on_ssd else set()))
             for i, u in enumerate(_with_state(layers(forward_s=1e-9, backward_s=1e-9)))]
    disk = Machine(read_bytes_per_s=5e8, write_bytes_per_s=2e9, optimizer_elements_per_s=1e15)
    moved = traffic(units, "vertical", k=1)
    ssd_s = moved.read_bytes / disk.read_bytes_per_s + moved.write_bytes / disk.write_bytes_per_s
    for double in (False, True):
        f, b = score(units, disk, 1, 0.0, 1, MB, "host", double_buffered=double)
        assert f + b == pytest.approx(ssd_s, rel=1e-6)


def test_checkpoints_stay_in_host_memory_when_they_fit():
    """Checkpoints on SSD are read on the backward's critical path: with room for them in host memory,
    the planner keeps them there even when compute would hide the bytes."""
    disk = Machine(read_bytes_per_s=2e9, write_bytes_per_s=2e9, optimizer_elements_per_s=1e12)
    choice = plan(layers(backward_s=1.0), disk, k=8, host_budget_bytes=10**12, unit_input_bytes=MB)
    assert choice.activations == "host"


def _with_graphs(units: list[UnitCost], activation_bytes: int) -> list[UnitCost]:
    last = len(units) - 1
    return [dataclasses.replace(u, recompute_s=u.forward_s if i < last else 0.0, activation_bytes=activation_bytes)
            for i, u in enumerate(units)]


def test_keeping_the_graphs_is_chosen_when_they_fit_and_saves_the_recompute():
    units = _with_graphs(layers(), activation_bytes=4 * MB)
    choice = plan(units, FAST, k=4, host_budget_bytes=10**12, unit_input_bytes=MB)
    assert not choice.recompute and choice.activations == "none"
    recompute_s = sum(u.recompute_s for u in units)
    assert choice.step_s == pytest.approx(4 * (sum(u.forward_s + u.backward_s for u in units) - recompute_s))
    # its memory: every recomputed unit's graph for every micro-batch
    assert choice.host_bytes >= 4 * 7 * 4 * MB


def test_graphs_that_do_not_fit_mean_recompute():
    units = _with_graphs(layers(), activation_bytes=64 * MB)
    budget = staging_bytes(units, 2) + 4 * 7 * MB + 10 * MB  # host checkpoints fit, graphs do not
    choice = plan(units, FAST, k=4, host_budget_bytes=budget, unit_input_bytes=MB)
    assert choice.recompute and choice.host_bytes <= budget


def test_graphs_too_large_for_memory_go_to_ssd_where_compute_binds():
    """Graphs larger than the budget, saved activations on SSD: where compute binds (a fast disk) the graphs'
    saved tensors go to SSD (no recompute; more bytes, hidden), where the disk binds the units recompute from
    their inputs (fewer bytes). Its memory: every unit's input kept for every micro-batch, two graphs staged."""
    units = _with_graphs(layers(), activation_bytes=64 * MB)
    budget = staging_bytes(units, 2) + 4 * 7 * MB + 2 * 64 * MB + 10 * MB  # graphs on SSD fit, in memory not
    fast = plan(units, FAST, k=4, host_budget_bytes=budget, unit_input_bytes=MB, activation_placements=("ssd",))
    assert not fast.recompute and fast.activations == "ssd"
    assert fast.host_bytes - fast.buffer_budget_bytes == 4 * 7 * MB + 2 * 64 * MB
    recompute_s = sum(u.recompute_s for u in units)
    moved = 4 * 7 * 64 * MB / 1e13  # written in the forward, read for the backward (counted on its path)
    assert fast.step_s == pytest.approx(4 * (sum(u.forward_s + u.backward_s for u in units) - recompute_s)
                                        + moved, rel=1e-3)
    slow_disk = Machine(read_bytes_per_s=1e8, write_bytes_per_s=1e8, optimizer_elements_per_s=1e12)
    slow = plan(units, slow_disk, k=4, host_budget_bytes=budget, unit_input_bytes=MB, activation_placements=("ssd",))
    assert slow.recompute and slow.activations == "ssd"
    # and only where saved activations are on SSD
    held = plan(units, FAST, k=4, host_budget_bytes=budget, unit_input_bytes=MB, activation_placements=("host",))
    assert held.recompute


def test_the_horizontal_order_holds_one_microbatchs_graphs():
    """Horizontally one micro-batch's graphs are alive at a time: a budget that holds them, not K's, keeps
    the graphs there and recomputes vertically."""
    units = _with_graphs(layers(), activation_bytes=64 * MB)
    graphs = sum(u.activation_bytes for u in units[:-1])
    budget = staging_bytes(units, 2) + 2 * graphs  # one micro-batch's graphs fit, four do not
    # (saved activations in host memory: on SSD the vertical order would keep its graphs' saved tensors there)
    vertical = plan(units, FAST, k=4, host_budget_bytes=budget, unit_input_bytes=MB, activation_placements=("host",))
    horizontal = plan(units, FAST, k=4, host_budget_bytes=budget, unit_input_bytes=MB, schedule="horizontal",
                      activation_placements=("host",))
    assert vertical.recompute and not horizontal.recompute
    assert horizontal.host_bytes - horizontal.buffer_budget_bytes == graphs  # staging aside: one micro-batch's


def test_graphs_are_not_kept_when_their_size_was_not_measured():
    choice = plan(layers(), FAST, k=4, host_budget_bytes=10**12, unit_input_bytes=MB)
    assert choice.recompute


def test_saved_bytes_count_activations_not_weights():
    """What keeping a graph costs: a linear layer saves its input (and a view of its weight, which the
    tensor manager keeps as a reference, so it is not counted)."""
    import torch

    from lightning_greedysnake.engine import SavedBytes

    layer = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64, requires_grad=True)
    counter = SavedBytes(list(layer.parameters()))
    with counter.hooks():
        layer(x).relu()
    assert counter.nbytes == 8 * 64 * 4 + 8 * 32 * 4  # the input, and relu's output


def _with_state(units: list[UnitCost]) -> list[UnitCost]:
    """bf16-mixed sizes: 16-bit weights, fp32 master, gradient and two moments."""
    return [dataclasses.replace(u, weight_bytes=2 * u.params, master_bytes=4 * u.params) for u in units]


def test_the_windows_last_step_waits_in_line_unless_read_ahead():
    """With the optimizer in the background, the first unit's step ends the window and the next forward
    starts with that unit: its reads and compute add to the step. Read ahead during the unit's backward,
    the reads hide behind it (here the backward is longer than the reads: only the compute is left)."""
    units = _with_state(layers(backward_s=0.5))
    disk = Machine(read_bytes_per_s=1e9, write_bytes_per_s=1e9, optimizer_elements_per_s=1e8)
    reads = (units[0].master_bytes + units[0].state_bytes) / 1e9
    cpu = units[0].params / 1e8
    assert window_tail(units, disk, 4, 1, read_ahead=False) == pytest.approx(reads + cpu)
    assert window_tail(units, disk, 4, 1, read_ahead=True) == pytest.approx(cpu)
    assert window_tail(units, disk, 4, 0, read_ahead=False) == 0.0  # lag 0: already in the backward phase
    lean = score(units, disk, 4, 0.0, 1, MB, "host")
    ahead = score(units, disk, 4, 0.0, 1, MB, "host", read_ahead=True)
    assert sum(lean) - sum(ahead) == pytest.approx(reads)


def test_a_last_step_whose_state_is_in_ram_reads_nothing_from_the_disk():
    units = _with_state(layers(backward_s=0.0))
    units[0] = dataclasses.replace(units[0], on_ssd=frozenset({"weights", "gradients"}))
    disk = Machine(read_bytes_per_s=1e9, write_bytes_per_s=1e9, optimizer_elements_per_s=1e8)
    assert window_tail(units, disk, 4, 1, read_ahead=False) == pytest.approx(units[0].params / 1e8)


def test_the_planner_buys_read_ahead_with_spare_memory_and_does_without_when_tight():
    units = _with_state(layers(backward_s=0.5))
    disk = Machine(read_bytes_per_s=1e9, write_bytes_per_s=1e9, optimizer_elements_per_s=1e8)
    roomy = plan(units, disk, k=4, host_budget_bytes=10**12, unit_input_bytes=MB, lags=(1,))
    assert roomy.read_ahead
    assert roomy.buffer_budget_bytes >= staging_bytes(units, 1) + read_ahead_bytes(units)
    tight_budget = staging_bytes(units, 1) + 7 * 4 * MB + read_ahead_bytes(units) // 2
    tight = plan(units, disk, k=4, host_budget_bytes=tight_budget, unit_input_bytes=MB,
                 lags=(1,), activation_placements=("host",))
    assert not tight.read_ahead and tight.host_bytes <= tight_budget
    assert tight.step_s > roomy.step_s


def test_the_optimizer_rate_is_measured_on_the_users_own_optimizer():
    """The plan's optimizer rate is the user's optimizer class with its settings (torchao's 8-bit AdamW
    steps some 20x fewer elements per second than fused AdamW on a CPU), not a stand-in."""
    from lightning_greedysnake.planner.measure import optimizer_rate

    stepped: list[float] = []

    class Counting(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            stepped.append(self.param_groups[0]["momentum"])
            return super().step(closure)

    user = Counting([torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    assert optimizer_rate(1 << 12, repeats=2, optimizer=user) > 0
    assert stepped == [0.9] * 3  # its class, its settings: one step to create the state, two timed


def test_the_expected_peak_is_the_process_rss_and_what_the_tensor_manager_holds_not_the_host_budget():
    """The peak the report expects: the process's RSS at setup (the model as built in it) plus what the tensor
    manager will hold (its RAM regions and its staging while training, or the hand-back at the end, whichever
    is more; without a budget for the hand-back, what comes back on top), never the whole host budget."""
    from lightning_greedysnake.strategy.host_memory import HostMemory, UnitBytes

    units = [UnitBytes(weights=100, state=200, gradient_regions=400, weight_regions=600, state_regions=800)] * 2
    budget, rss = 1 << 30, 10_000

    def memory(pool: int, bounded: bool = True) -> HostMemory:
        return HostMemory(budget, built_bytes=100, units=units, staging_bytes=300, return_weights=True,
                          bounded=bounded, pool_bytes=pool, process_bytes=rss)

    assert memory(5000).peak_bytes == rss + 3600 + 5000  # training: the regions and the staging
    assert memory(0).peak_bytes == rss + memory(0).hand_back_peak(True)  # the hand-back, in their place
    assert memory(5000, bounded=False).peak_bytes == rss + 3600 + 5000 + 2 * (100 + 200)  # all comes back on top
    report = memory(5000).report()
    assert "peak near 18.16 KiB: its RSS at setup (9.77 KiB" in report and "holds (8.4 KiB)" in report, report


def test_the_end_of_fit_hand_back_counts_the_staging_of_the_unit_in_flight():
    """``HostMemory.hand_back_peak``: the trained state comes back unit by unit in place of the tensor
    manager's RAM regions, while the unit in flight holds staging (its regions off the host, read back
    through the pool). A budget the regions and what came back fit in, but not with that staging, must
    not be planned to take it all back: teardown would go over the host budget (the OOM the plan guards)."""
    from lightning_greedysnake.strategy.host_memory import HostMemory, UnitBytes

    units = [UnitBytes(weights=100, state=200, gradient_regions=400, weight_regions=600, state_regions=800)] * 2

    def memory(budget: int) -> HostMemory:
        return HostMemory(budget, built_bytes=0, units=units, staging_bytes=300, return_weights=True, bounded=True)

    # the first unit's weights back, its gradients freed: 3200 held + 100 back; then its staging, 300, and
    # a transient copy of its weights, 100
    assert memory(0).hand_back_peak(True) == 3200 + 100 + 300 + 100
    assert memory(3700).hand_back.complete
    short = memory(3650).hand_back  # (room for all of it but the staging)
    assert not short.weights and not short.state and "3,700 bytes" in short.why
