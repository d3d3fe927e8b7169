"""``trainer.estimated_stepping_batches`` in ``configure_optimizers``: the most common scheduler setup
(a OneCycleLR sized from it) trains as under Lightning's default strategy.

Reading it there makes Lightning set the train dataloader up during the strategy's setup, before the
strategy's run exists, and keep that dataloader for the whole fit: the strategy must wrap it for reading
ahead all the same. The train dataloaders it cannot read ahead from get an error naming the cause and the
fix.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.lookahead import LookaheadLoader
from tests.helpers import (
    SequentialModule,
    TinyGPTModule,
    make_trainer,
    max_abs_diff,
    regression_loader,
    token_loader,
)

NUM_BATCHES = 10  # K=2 -> 5 windows an epoch; K=3 -> 3,3,3,1: the epoch's last window is partial
LR = 3e-3


class OneCycle:
    """configure_optimizers as Lightning's docs show it: OneCycleLR over the estimated stepping batches."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=LR)  # type: ignore[attr-defined]
        self.total_steps = self.trainer.estimated_stepping_batches  # type: ignore[attr-defined]
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=LR, total_steps=self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class OneCycleGPT(OneCycle, TinyGPTModule):
    pass


class OneCycleSequential(OneCycle, SequentialModule):
    pass


class Recorder(L.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.train_dataloader: Any = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.train_dataloader = trainer.train_dataloader

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.lrs.append(optimizer.param_groups[0]["lr"])


def run(strategy: Any, model: str, k: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    if model == "gpt":
        module: Any = OneCycleGPT(n_layer=3)
        loader = token_loader(NUM_BATCHES)
    else:
        module, loader = OneCycleSequential(), regression_loader(NUM_BATCHES)
    recorder = Recorder()
    trainer = make_trainer(strategy, k, max_epochs=2, callbacks=[recorder])
    trainer.fit(module, loader)
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "total": module.total_steps, "global_step": trainer.global_step, "lrs": recorder.lrs,
            "loader": recorder.train_dataloader}


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("model", ["gpt", "sequential"])
def test_onecycle_sized_by_estimated_stepping_batches_matches_lightning_default(model, k, schedule):
    ref = run("auto", model, k)
    got = run(GreedySnakeStrategy(schedule=schedule), model, k)
    assert ref["total"] == ref["global_step"] == 2 * -(-NUM_BATCHES // k)  # the estimate is exact here
    assert got["total"] == ref["total"] and got["global_step"] == ref["global_step"]
    assert got["lrs"] == ref["lrs"]  # the same LR schedule, step by step
    assert isinstance(got["loader"], LookaheadLoader)  # the loader set up during setup is read ahead
    initial = run_initial(model)
    assert max_abs_diff(initial, ref["params"]) > 100 * 1e-5  # (the comparison is not vacuous)
    assert max_abs_diff(got["params"], ref["params"]) <= 1e-5


def run_initial(model: str) -> dict[str, torch.Tensor]:
    L.seed_everything(0, verbose=False)
    module = OneCycleGPT(n_layer=3) if model == "gpt" else OneCycleSequential()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_by_name_with_max_epochs():
    """``Trainer(strategy="greedysnake", max_epochs=...)``, the plain spelling the issue reports."""
    ref, got = run("auto", "gpt", 2), run("greedysnake", "gpt", 2)
    assert got["total"] == ref["total"] == 10 and got["lrs"] == ref["lrs"]
    assert max_abs_diff(got["params"], ref["params"]) <= 1e-5


class ReloadedEachEpoch(OneCycleGPT):
    def train_dataloader(self) -> Any:
        return token_loader(NUM_BATCHES, seed=self.trainer.current_epoch)


def test_a_train_dataloader_reloaded_each_epoch():
    """The first set up during the strategy's setup, the next at their epochs' starts: each read ahead."""

    def fit(strategy: Any) -> tuple[L.LightningModule, L.Trainer, list[float]]:
        L.seed_everything(0, verbose=False)
        module, recorder = ReloadedEachEpoch(n_layer=3), Recorder()
        trainer = make_trainer(strategy, 3, max_epochs=3, reload_dataloaders_every_n_epochs=1,
                               callbacks=[recorder])
        trainer.fit(module)
        return module, trainer, recorder.lrs

    (ref, ref_trainer, ref_lrs), (got, trainer, lrs) = fit("auto"), fit(GreedySnakeStrategy(auto=False))
    assert got.total_steps == ref.total_steps == trainer.global_step == ref_trainer.global_step == 12
    assert lrs == ref_lrs
    assert isinstance(trainer.train_dataloader, LookaheadLoader)
    assert max_abs_diff(dict(got.named_parameters()), dict(ref.named_parameters())) <= 1e-5


class FirstOfTwo(TinyGPTModule):
    """Takes the batch of the first train dataloader from a list or dict of them."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch["a"] if isinstance(batch, dict) else batch[0], batch_idx)


@pytest.mark.parametrize("data", ["dict", "list-of-one"])
def test_several_train_dataloaders_are_refused_by_name(data):
    """Before, a dict of loaders trained silently on the last loader's batches read ahead, and a list of one
    failed inside training_step."""
    loaders: Any = ({"a": token_loader(6), "b": token_loader(6, seed=1)} if data == "dict"
                    else [token_loader(6)])
    trainer = make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=1)
    kind = "dict of 2" if data == "dict" else "list of 1"
    with pytest.raises(ValueError, match=f"a single train dataloader, not from a {kind}.*Fix: return one"):
        trainer.fit(FirstOfTwo(n_layer=2), loaders)


def test_train_dataloader_set_up_during_the_sanity_check_names_the_cause():
    """The one place the strategy cannot wrap the train dataloader: Lightning sets it up for
    estimated_stepping_batches while it runs the sanity check (the strategy cannot tell it from a
    validation dataloader there), and keeps it for the fit."""

    class DuringSanityCheck(TinyGPTModule):
        def on_validation_start(self) -> None:
            self.total_steps = self.trainer.estimated_stepping_batches

    trainer = make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=1, num_sanity_val_steps=1)
    with pytest.raises(RuntimeError, match="set up while the trainer was not in its training stage.*sanity "
                                           "check.*Fix: read it in configure_optimizers"):
        trainer.fit(DuringSanityCheck(n_layer=2), token_loader(6), token_loader(2))
