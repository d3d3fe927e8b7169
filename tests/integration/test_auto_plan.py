"""``auto=True``: plan alpha, lag and the staging budget from the first warm step's measurements (the
second) and go on with them; the math stays exact."""

from __future__ import annotations

import dataclasses
import time

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import RunConfig, TensorKind, Tier
from lightning_greedysnake.strategy.planning.planner import PLAN_STEP
from tests.helpers import TinyGPTModule, make_trainer, max_abs_diff, token_loader


def _fit(strategy: GreedySnakeStrategy, callbacks: list | None = None) -> dict:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=3, lr=3e-3)
    make_trainer(strategy, 3, max_epochs=2, callbacks=callbacks or []).fit(module, token_loader(12))
    return {n: p.detach().clone() for n, p in module.named_parameters()}


ALL_SSD = {kind: "ssd" for kind in ("weights", "master_weights", "optimizer_states", "gradients")}


class Applied(L.Callback):
    """What the tensor manager, the engine and the run's configuration run with after the first-step plan."""

    def on_train_end(self, trainer, module):
        manager, run = trainer.strategy.tensor_manager, trainer.strategy._run
        self.alpha, self.lag, self.budget = manager.stepper.alpha, manager.stepper.lane.lag, manager.pool.budget_bytes
        self.config, self.engine_config = run.config, run.engine.config


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
def test_auto_plans_the_unset_settings_after_the_first_step_and_stays_exact(schedule, caplog):
    strategy, applied = GreedySnakeStrategy(schedule=schedule, auto_host_budget_bytes=1 << 30, offload=ALL_SSD), Applied()
    with caplog.at_level("INFO"):
        got = _fit(strategy, [applied])
    # alpha 0.25, lag 2, in the units setup planned (unit sizes agree up to rounding, not bit for bit)
    ref = _fit(GreedySnakeStrategy(auto=False, schedule=schedule, offload=ALL_SSD,
                                   layers_per_unit=strategy.config.layers_per_unit))
    choice = strategy.plan_choice
    assert choice is not None and 0.0 <= choice.alpha <= 1.0 and choice.lag in (0, 1, 2)
    assert choice.host_bytes <= 1 << 30
    assert (applied.alpha, applied.lag, applied.budget) == (choice.alpha, choice.lag, choice.buffer_budget_bytes)
    assert strategy.config.recompute == choice.recompute  # applied (keeping graphs is a choice too)
    # the plan applied once reaches every part: the run's configuration says what the manager runs with
    config = applied.config
    assert (config.alpha, config.lag, config.offload.buffer_budget_bytes) == (applied.alpha, applied.lag, applied.budget)
    assert applied.engine_config is config
    assert "greedysnake auto plan" in caplog.text and "predicted step (s)" in caplog.text
    assert "binding resource" in caplog.text and "read" in caplog.text  # the disk was measured
    # a CPU run: the lane shares the training's cores, and a synchronous step's rate was measured too
    machine = strategy._run.planner.machine
    assert machine.shared_cores and machine.inline_optimizer_elements_per_s > 0
    assert "on the training thread" in caplog.text
    assert max_abs_diff(got, ref) == 0  # re-splitting the optimizer keeps its state: same numbers


def test_the_plan_measures_the_warm_step_not_the_first(monkeypatch):
    """The first step's compute runs slow (first touches, first calls), here 2 s more in unit 0's
    backward: the plan, after step PLAN_STEP, times that step's compute only."""
    slow = 2.0  # (far above a unit's own time even on a loaded machine: the test is not about timing)

    class FirstStepSlow(L.Callback):
        def on_train_start(self, trainer, module):
            def hook(block, args, output):
                if torch.is_grad_enabled() and trainer.global_step == 0:  # the backward's recompute of step 1
                    time.sleep(slow)
            module.model.blocks[0].register_forward_hook(hook)

    strategy = GreedySnakeStrategy(layers_per_unit=1, auto_host_budget_bytes=1 << 30, offload=ALL_SSD)
    _fit(strategy, [FirstStepSlow()])
    warm = strategy._run.planner
    assert strategy.plan_choice is not None and warm.steps == PLAN_STEP > 1
    fwd, bwd = warm.unit_seconds
    assert len(bwd) == 3 and all(0 < t < slow / 3 for t in bwd + fwd)  # step 1's sleep is not in it

    strategy = GreedySnakeStrategy(auto_host_budget_bytes=1 << 30, offload=ALL_SSD)  # a run too short to plan
    L.seed_everything(0, verbose=False)
    make_trainer(strategy, 3, max_steps=PLAN_STEP - 1).fit(TinyGPTModule(n_layer=3, lr=3e-3), token_loader(12))
    assert strategy.plan_choice is None and strategy._run.planner.pending


def test_the_first_step_plan_keeps_every_setting_given():
    applied = Applied()
    strategy = GreedySnakeStrategy(alpha=0.1, lag=1, recompute=True, auto_host_budget_bytes=1 << 30,
                                   offload={**ALL_SSD, "buffer_budget_bytes": 48 << 20})
    _fit(strategy, [applied])
    choice = strategy.plan_choice
    assert choice is None  # nothing was left to plan
    strategy = GreedySnakeStrategy(alpha=0.1, lag=1, auto_host_budget_bytes=1 << 30, offload=ALL_SSD)
    _fit(strategy, [applied])
    choice = strategy.plan_choice
    assert (choice.alpha, choice.lag, applied.alpha, applied.lag) == (0.1, 1, 0.1, 1)
    assert applied.budget == choice.buffer_budget_bytes  # (the budget and recompute were planned)
    strategy = GreedySnakeStrategy(recompute=True, auto_host_budget_bytes=1 << 30,
                                   offload={**ALL_SSD, "buffer_budget_bytes": 48 << 20})
    _fit(strategy, [applied])
    assert strategy.plan_choice.recompute and strategy.config.recompute and applied.budget == 48 << 20


def test_auto_false_keeps_the_fixed_defaults(caplog):
    applied = Applied()
    strategy = GreedySnakeStrategy(auto=False)
    with caplog.at_level("INFO"):
        _fit(strategy, [applied])
    assert strategy.plan_choice is None and strategy.placement_plan is None
    assert "plan" not in caplog.text
    assert (applied.alpha, applied.lag) == (0.25, 2)
    assert all(strategy.config.offload.tier(TensorKind(kind)) is Tier.SSD for kind in ALL_SSD)


def test_bad_auto_settings():
    with pytest.raises(ValueError, match="auto='yes'"):
        GreedySnakeStrategy(auto="yes")
    with pytest.raises(ValueError, match=r"auto_host_budget_bytes=-1.*Fix"):
        GreedySnakeStrategy(auto_host_budget_bytes=-1)


def test_reconfiguring_alpha_and_lag_mid_run_keeps_the_optimizer_state():
    """The mechanism auto=True uses, forced: re-split every unit's optimizer after step 1."""

    class Switch(L.Callback):
        fired = False

        def on_train_batch_end(self, trainer, module, *args):
            manager = trainer.strategy.tensor_manager
            if trainer.global_step == 1 and manager.stepper.alpha == 0.5:
                manager.reconfigure(alpha=0.0, lag=2, offload=dataclasses.replace(manager.config,
                                                                              buffer_budget_bytes=manager.pool.budget_bytes))
                Switch.fired = True

    ref = _fit(GreedySnakeStrategy(auto=False, alpha=0.5, lag=0))
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=3, lr=3e-3)
    strategy = GreedySnakeStrategy(auto=False, alpha=0.5, lag=0)
    make_trainer(strategy, 3, max_epochs=2, callbacks=[Switch()]).fit(module, token_loader(12))
    got = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert Switch.fired and strategy.config.alpha == 0.5  # (the manager's, not the config's, changed)
    assert max_abs_diff(got, ref) == 0


def test_auto_can_switch_to_kept_graphs_mid_run_exactly():
    """With room for the graphs and dropout on, a run that starts recomputing and then keeps graphs
    (as auto=True may decide after step 1) lands where recomputing all along lands."""

    class Switch(L.Callback):
        fired = False

        def on_train_batch_end(self, trainer, module, *args):
            strategy = trainer.strategy
            if trainer.global_step == 1 and strategy.config.recompute:
                Switch.fired = True
                assert set(strategy.engine.activation_bytes) >= {0, 1}  # measured at the first recompute
                assert all(v > 0 for v in strategy.engine.activation_bytes.values())
                budget = dataclasses.replace(strategy.config.offload,
                                             buffer_budget_bytes=strategy.tensor_manager.pool.budget_bytes)
                strategy._run.apply(dataclasses.replace(strategy.config, recompute=False, offload=budget))

    def fit(callbacks: list) -> dict:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(n_layer=3, lr=3e-3, dropout=0.2)
        make_trainer(GreedySnakeStrategy(auto=False), 3, max_epochs=2, callbacks=callbacks).fit(module, token_loader(12))
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    switched = fit([Switch()])
    assert Switch.fired
    assert max_abs_diff(switched, fit([])) <= 1e-6


def test_a_plan_for_kept_graphs_on_ssd_moves_the_saved_activations_there_exactly(monkeypatch, caplog):
    """The warm-step plan's choice of kept graphs on SSD (where compute binds and the graphs do not fit in
    memory: forced here, the tiny model's graphs fit) with the saved activations in host memory until then
    (unset, and a window's fit their share): from the next window on they go to SSD, each graph's saved
    tensors with them, and the run lands where recomputing all along lands (dropout on: the same masks)."""
    from lightning_greedysnake.strategy.planning import planner as planning

    def kept_on_ssd(*args, **kwargs):
        assert kwargs["graphs_on_ssd"] and kwargs["activation_placements"] == ("host",)
        return dataclasses.replace(plan(*args, **kwargs), recompute=False, activations="ssd")

    plan = planning.plan
    monkeypatch.setattr(planning, "plan", kept_on_ssd)

    class Seen(L.Callback):
        def on_train_end(self, trainer, module):
            self.tier = trainer.strategy.tensor_manager.activations.tier
            self.stats = trainer.strategy.io_stats()
            self.config = trainer.strategy._run.engine.config

    def fit(strategy: GreedySnakeStrategy, callbacks: list) -> dict:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(n_layer=3, lr=3e-3, dropout=0.2)
        make_trainer(strategy, 3, max_epochs=2, callbacks=callbacks).fit(module, token_loader(12))
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    seen = Seen()
    with caplog.at_level("INFO"):
        got = fit(GreedySnakeStrategy(offload=ALL_SSD), [seen])
    assert "saved activations in host memory" in caplog.text  # (at the first save, before the plan)
    assert not seen.config.recompute and seen.config.offload.activations is Tier.SSD and seen.tier is Tier.SSD
    assert seen.stats["ssd/activations/bytes_written"] > 0
    # (1e-5: the plan changed alpha and lag too, which reorder fp32 sums; the masks are the same draws)
    assert max_abs_diff(got, fit(GreedySnakeStrategy(auto=False, offload=ALL_SSD), [])) <= 1e-5


def test_kept_graphs_go_to_ssd_only_where_the_disk_was_measured(monkeypatch, tmp_path):
    """With every kind in host memory the disk is never measured (the plan's machine has unbounded bandwidth):
    SSD would look free, and kept graphs there would win every tie on memory. They are not offered; with every
    kind on SSD (the disk measured) they are."""
    from lightning_greedysnake.strategy.planning import planner as planning

    offered: list[bool] = []

    def record(*args, **kwargs):
        offered.append(kwargs["graphs_on_ssd"])
        return plan(*args, **kwargs)

    plan = planning.plan
    monkeypatch.setattr(planning, "plan", record)
    # (an offload directory given, as benchmarks/compare.py gives one: nothing placed on it)
    _fit(GreedySnakeStrategy(offload_dir=tmp_path, offload={kind: "host" for kind in ALL_SSD}))
    in_ram, offered[:] = list(offered), []
    _fit(GreedySnakeStrategy(offload=ALL_SSD))
    assert in_ram and not any(in_ram) and offered and all(offered)  # (every plan the run made)


def test_larger_units_predicted_faster_are_suggested_for_the_next_run_and_the_units_stay(monkeypatch, caplog):
    """The files are laid out by the unit size: where the warm-step plan finds larger units faster, the
    report names the ``layers_per_unit`` to set; this run keeps its units. Stand-ins: setup's choice is
    pinned to one block, and every larger size counts as faster."""
    from lightning_greedysnake.planner import setup, unit_size

    monkeypatch.setattr(setup, "choose_unit_size", min)  # (setup's: the smallest scored size)
    monkeypatch.setattr(unit_size, "LARGER_UNIT_GAIN", -10.0)
    strategy = GreedySnakeStrategy(auto_host_budget_bytes=1 << 30, offload=ALL_SSD)
    with caplog.at_level("INFO"):
        _fit(strategy)
    assert "larger units are faster here" in caplog.text and "Set layers_per_unit=" in caplog.text
    assert strategy.config.layers_per_unit == 1 and strategy.tensor_manager is None  # (torn down after fit)


def test_the_engine_the_tensor_manager_and_the_plans_see_the_one_resolved_config(monkeypatch):
    """The settings in effect are resolved once at setup (the placement planned) and once more by the
    warm-step plan, each time into one object that every part reads: the engine's config is the
    strategy's, the tensor manager's offload settings are its ``offload``, and the warm-step plan is
    handed the one in effect and returns the next."""
    from lightning_greedysnake.strategy.planning import Planner

    handed: list[tuple[object, object]] = []
    real_run = Planner.plan_warm_step

    def run(self, manager, activation_bytes, config, *args, **kwargs):
        out = real_run(self, manager, activation_bytes, config, *args, **kwargs)
        handed.append((config, out))
        return out

    monkeypatch.setattr(Planner, "plan_warm_step", run)

    class Seen(L.Callback):
        configs: list = []

        def on_train_batch_end(self, trainer, module, *args):
            strategy = trainer.strategy
            config = strategy.config
            assert isinstance(config, RunConfig) and strategy.engine.config is config
            assert strategy.tensor_manager.config is config.offload
            if not Seen.configs or Seen.configs[-1] is not config:
                Seen.configs.append(config)

    strategy = GreedySnakeStrategy(auto_host_budget_bytes=1 << 30, offload={"weights": "ssd"})
    _fit(strategy, [Seen()])
    assert strategy.placement_plan is not None and strategy.plan_choice is not None  # both plans ran
    assert len(handed) == 1 and len(Seen.configs) == 2
    assert handed[0] == (Seen.configs[0], Seen.configs[1])
    assert handed[0][0] is Seen.configs[0] and handed[0][1] is Seen.configs[1]
    assert (Seen.configs[1].alpha, Seen.configs[1].lag) == (strategy.plan_choice.alpha, strategy.plan_choice.lag)


def test_every_plan_of_a_run_is_made_within_the_one_host_budget_measured_at_setup(monkeypatch):
    """The default budget (half of the memory available) is measured once, at setup: the unit size, the
    placement, the checkpoints' tier and the warm-step plan all plan within it, not within what is
    available when each runs (the run's own allocations lower it: planning again would count them twice)."""
    from lightning_greedysnake.strategy.planning import placement

    calls = []

    def available() -> int:
        calls.append(len(calls))
        return 8 << 30 if len(calls) == 1 else 1 << 20  # (later: as if the run had taken all but 1 MiB)

    monkeypatch.setattr(placement, "available_memory_bytes", available)
    strategy = GreedySnakeStrategy()
    _fit(strategy)
    run = strategy._run
    assert len(calls) == 1
    assert run.placement is not None and run.placement.budget_bytes == 4 << 30
    assert run.planner.host_budget_bytes == 4 << 30 and strategy.plan_choice is not None
    assert run.tensor_manager is None or run.tensor_manager.activations.tier is Tier.HOST
