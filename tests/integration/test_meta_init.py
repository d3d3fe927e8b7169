"""Models larger than RAM: built on the meta device (``trainer.init_module(empty_init=True)``) and
materialized one unit at a time straight into the tensor manager."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GPT, GreedySnakeStrategy, OffloadConfig
from tests.helpers import (
    SequentialModule,
    TinyGPTModule,
    make_trainer,
    max_abs_diff,
    regression_loader,
    token_loader,
)


class InitialWeights(L.Callback):
    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.state = trainer.strategy.full_state_dict()


def _fit(strategy: Any, empty_init: bool, callbacks: list | None = None) -> tuple[dict, L.Trainer]:
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(strategy, 2, max_epochs=1, callbacks=callbacks or [])
    with trainer.init_module(empty_init=empty_init):
        module = TinyGPTModule(n_layer=3, lr=3e-3)
    if empty_init:
        assert all(p.is_meta for p in module.parameters())
    trainer.fit(module, token_loader(6))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, trainer


@pytest.mark.parametrize("placement", ["ssd", "host"])
def test_meta_model_initializes_like_the_eager_one_and_trains_identically(placement):
    offload = OffloadConfig.everywhere("host") if placement == "host" else None
    eager_init, meta_init = InitialWeights(), InitialWeights()
    eager, _ = _fit(GreedySnakeStrategy(auto=False, offload=offload), False, [eager_init])
    meta, trainer = _fit(GreedySnakeStrategy(auto=False, offload=offload), True, [meta_init])
    assert eager_init.state.keys() == meta_init.state.keys()
    assert max_abs_diff(eager_init.state, meta_init.state) == 0
    assert trainer.global_step == 3
    assert max_abs_diff(eager, meta) == 0


def test_only_one_unit_is_ever_materialized_at_once(monkeypatch):
    """A spy on the real initializer: when a unit is initialized, no parameter of any other unit holds
    real memory (they are all memory-less stand-ins or already back in the tiers)."""
    real_elements: list[int] = []
    unit_sizes: list[int] = []
    original = GPT.init_modules

    def spy(self: GPT, modules: Any, generator: torch.Generator) -> None:
        backed = sum(p.numel() for p in self.parameters() if 0 not in p.stride() or p.dim() == 0)
        real_elements.append(backed)
        unit_sizes.append(sum(p.numel() for m in modules for p in m.parameters()))
        original(self, modules, generator)

    monkeypatch.setattr(GPT, "init_modules", spy)
    _fit(GreedySnakeStrategy(auto=False), True)
    assert len(real_elements) == 3  # one call per unit
    assert real_elements == unit_sizes  # only the unit being initialized has memory


def test_models_without_an_initializer_use_reset_parameters():
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=1)
    with trainer.init_module(empty_init=True):
        module = SequentialModule(lr=1e-2)
    trainer.fit(module, regression_loader(4))
    assert trainer.global_step == 2
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in module.parameters())


def test_meta_model_with_everything_on_the_device_is_refused():
    strategy = GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("device"))
    trainer = make_trainer(strategy, 2, max_epochs=1)
    with torch.device("meta"):
        module = TinyGPTModule(n_layer=2)
    with pytest.raises(ValueError, match=r"meta device.*Fix"):
        trainer.fit(module, token_loader(4))
