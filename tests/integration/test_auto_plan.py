"""``auto=True``: plan alpha, lag and the staging budget from the first step's measurements and go on
with them; the math stays exact."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest

from lightning_greedysnake import GreedySnakeStrategy
from tests.helpers import TinyGPTModule, make_trainer, max_abs_diff, token_loader


def _fit(strategy: GreedySnakeStrategy) -> dict:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=3, lr=3e-3)
    make_trainer(strategy, 3, max_epochs=2).fit(module, token_loader(12))
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("start", [{"alpha": 0.5, "lag": 0}, {"alpha": 0.0, "lag": 2}])
def test_auto_plans_after_the_first_step_and_stays_exact(start, caplog):
    ref = _fit(GreedySnakeStrategy(**start))
    strategy = GreedySnakeStrategy(auto=True, auto_host_budget_bytes=1 << 30, **start)
    with caplog.at_level("INFO"):
        got = _fit(strategy)
    choice = strategy.plan_choice
    assert choice is not None and 0.0 <= choice.alpha <= 1.0 and choice.lag in (0, 1, 2)
    assert choice.host_bytes <= 1 << 30
    assert strategy.config.recompute == choice.recompute  # applied (keeping graphs is a choice too)
    assert "greedysnake auto plan" in caplog.text and "predicted step (s)" in caplog.text
    assert max_abs_diff(got, ref) == 0  # re-splitting the optimizer keeps its state: same numbers


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
            if trainer.global_step == 1 and manager.alpha == 0.5:
                manager.reconfigure(alpha=0.0, lag=2, buffer_budget_bytes=manager.pool.budget_bytes)
                Switch.fired = True

    ref = _fit(GreedySnakeStrategy(alpha=0.5, lag=0))
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=3, lr=3e-3)
    strategy = GreedySnakeStrategy(alpha=0.5, lag=0)
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
                strategy.config = dataclasses.replace(strategy.config, recompute=False)
                strategy.engine.config = strategy.config

    def fit(callbacks: list) -> dict:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(n_layer=3, lr=3e-3, dropout=0.2)
        make_trainer(GreedySnakeStrategy(), 3, max_epochs=2, callbacks=callbacks).fit(module, token_loader(12))
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    switched = fit([Switch()])
    assert Switch.fired
    assert max_abs_diff(switched, fit([])) <= 1e-6
