"""``auto=True`` chooses ``layers_per_unit`` at setup when it is unset: printed as a table, applied to
the tensor manager's units, bit-identical to one layer per unit in RAM; a value you set is kept, and
``auto=False`` keeps 1."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.models import find_layered_model
from lightning_greedysnake.offload.regions import placement_of
from lightning_greedysnake.optim.contract import optimizer_contract
from lightning_greedysnake.planner import measure
from lightning_greedysnake.planner.unit_size import CANDIDATES
from lightning_greedysnake.strategy.planning.placement import unit_costs
from lightning_greedysnake.planner.plan import staging_bytes
from lightning_greedysnake.strategy.planning.placement import PlannedState, candidate_layouts
from tests.helpers import TinyGPTModule, bf16_policy_run, make_trainer, max_abs_diff, token_loader
from tests.integration.test_planned_placement import K, Seen

BLOCKS = 8

ON_SSD = {"weights": "ssd", "optimizer_states": "ssd", "gradients": "ssd", "master_weights": "ssd"}


def fit(strategy: GreedySnakeStrategy, precision: str = "32-true") -> tuple[dict[str, torch.Tensor], Seen]:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=BLOCKS, lr=3e-3)
    seen = Seen()
    make_trainer(strategy, K, callbacks=[seen], max_epochs=2, precision=precision).fit(module, token_loader(3 * K))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, seen


def chosen_row(text: str) -> int:
    rows = [line for line in text.splitlines() if line.endswith("<- chosen")]
    assert len(rows) == 1, text
    return int(rows[0].split()[0])


def slow_requests(directory: Any, sizes: list[int], *args: Any, **kwargs: Any) -> dict[int, tuple[float, float]]:
    """A disk that pays 20 ms per request (a network volume, say): what the probes (setup's, the warm
    step's) would measure there.
    The only stand-in in this file; the run, its files and its threads are real."""
    return {size: (size / (0.02 + size / 1e9),) * 2 for size in sizes}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_disk_slow_per_request_gets_larger_units_bit_identical_to_them_in_ram(precision, monkeypatch, caplog):
    monkeypatch.setattr(measure, "request_bandwidth", slow_requests)
    strategy = GreedySnakeStrategy(alpha=0.25, lag=2, offload=ON_SSD)
    with caplog.at_level("INFO"):
        got, seen = fit(strategy, precision)
    lpu = strategy.config.layers_per_unit
    assert "greedysnake unit size" in caplog.text and chosen_row(caplog.text) == lpu
    assert lpu > 1 and len(seen.tiers["weights"]) == -(-BLOCKS // lpu)  # BLOCKS blocks in units of lpu
    resident, ref = fit(GreedySnakeStrategy(auto=False, layers_per_unit=lpu, alpha=0.25, lag=2,
                                            offload=OffloadConfig.everywhere("host")), precision)
    for name, value in resident.items():
        assert torch.equal(got[name], value), name
    for window, ref_window in zip(seen.windows(), ref.windows(), strict=True):
        for name, grad in ref_window.items():
            assert torch.equal(window[name], grad), name
    # and the reference of the same precision policy, within its tolerance: Lightning's own strategy under
    # 32-true, the plain-PyTorch bf16-mixed loop (fp32 master weights and gradient sums) under bf16-mixed
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=BLOCKS, lr=3e-3)
    if precision == "32-true":
        make_trainer("auto", K, max_epochs=2).fit(module, token_loader(3 * K))
    else:
        for g, r in zip(seen.windows(), bf16_policy_run(module, list(token_loader(3 * K)), K, epochs=2), strict=True):
            assert max_abs_diff(g, r) <= 1e-5
    assert max_abs_diff(got, {n: p.detach() for n, p in module.named_parameters()}) <= 1e-5


def test_the_disk_is_measured_and_the_choice_applied(caplog):
    strategy = GreedySnakeStrategy(offload=ON_SSD)
    with caplog.at_level("INFO"):
        _, seen = fit(strategy)
    lpu = strategy.config.layers_per_unit
    assert chosen_row(caplog.text) == lpu and len(seen.tiers["weights"]) == -(-BLOCKS // lpu)


@pytest.mark.parametrize("settings, expected", [({"layers_per_unit": 2}, 2), ({"auto": False}, 1)])
def test_a_set_value_or_auto_false_is_not_planned(settings, expected, monkeypatch, caplog):
    monkeypatch.setattr(measure, "request_bandwidth", slow_requests)
    strategy = GreedySnakeStrategy(offload=ON_SSD, **settings)
    with caplog.at_level("INFO"):
        _, seen = fit(strategy)
    assert "greedysnake unit size" not in caplog.text
    assert strategy.config.layers_per_unit == expected and len(seen.tiers["weights"]) == -(-BLOCKS // expected)


def test_sizes_whose_staging_exceeds_the_budget_are_not_candidates(monkeypatch, caplog):
    monkeypatch.setattr(measure, "request_bandwidth", slow_requests)
    settings = GreedySnakeStrategy(offload=ON_SSD).settings
    module = TinyGPTModule(n_layer=BLOCKS, lr=3e-3)
    _, _, chain = find_layered_model(module, None)
    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    layouts = candidate_layouts(settings, chain, optimizer, optimizer_contract(optimizer), torch.float32, None, [1, 2])
    staging = {lpu: staging_bytes(unit_costs(PlannedState(state, placement_of(state, settings.resolved().offload))), 2)
               for lpu, state in layouts.items()}
    budget = (staging[1] + staging[2]) // 2  # one block per unit fits (at the fixed lag, 2), two do not
    strategy = GreedySnakeStrategy(auto_host_budget_bytes=budget, offload=ON_SSD)
    with caplog.at_level("INFO"):
        fit(strategy)
    rows = [int(line.split()[0]) for line in caplog.text.splitlines() if line[:1].isdigit() and "." in line]
    assert rows == [1] and strategy.config.layers_per_unit == 1


def test_setup_places_each_candidate_size_once_and_runs_the_chosen_ones_placement(monkeypatch, caplog):
    """One pass: each unit size is placed once within the host budget and scored, and setup runs the chosen
    size's placement as scored (it placed the chosen size a second time before)."""
    from lightning_greedysnake.planner import setup as placement

    calls: list[int] = []
    real = placement.plan_placement

    def counted(costs: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(costs))  # (units of the size placed)
        return real(costs, *args, **kwargs)

    monkeypatch.setattr(placement, "plan_placement", counted)
    monkeypatch.setattr(measure, "request_bandwidth", slow_requests)
    strategy = GreedySnakeStrategy()  # every kind's placement planned
    with caplog.at_level("INFO"):
        _, seen = fit(strategy)
    lpu = strategy.config.layers_per_unit
    assert sorted(calls) == sorted(-(-BLOCKS // size) for size in CANDIDATES), calls
    assert "greedysnake unit size" in caplog.text and chosen_row(caplog.text) == lpu
    assert len(seen.tiers["weights"]) == -(-BLOCKS // lpu)


def test_an_error_in_rank_0s_plan_is_broadcast_and_raised(monkeypatch):
    """Setup's plan runs on rank 0 only: an error there goes out in the broadcast every rank waits in, and
    every rank raises it (no rank is left waiting for a plan)."""
    from lightning_greedysnake.strategy.planning import planner

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the plan broke")

    monkeypatch.setattr(planner, "plan_setup", broken)
    strategy = GreedySnakeStrategy(offload=ON_SSD)
    sent: list[Any] = []
    real = strategy.broadcast

    def recording(obj: Any, src: int = 0) -> Any:
        sent.append(obj)
        return real(obj, src)

    strategy.broadcast = recording  # (what setup's context takes for the ranks' broadcast)
    with pytest.raises(RuntimeError, match="the plan broke"):
        fit(strategy)
    assert any(isinstance(obj, RuntimeError) for obj in sent), sent
