"""A loss or gradient that is not finite is named (step, micro-batch, unit), and ``on_nonfinite`` decides
what happens: warn and train on (as Lightning does), raise, or drop the window's update."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.strategy.nonfinite import NonFiniteError
from tests.helpers import SequentialModule, TinyGPTModule, make_trainer, max_abs_diff, regression_loader, token_loader

K = 3
BAD_BATCH = 4  # micro-batch 1 of the second window (optimizer step 2)


class NaNLossAt(TinyGPTModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        return loss * float("nan") if batch_idx == BAD_BATCH else loss


class NaNGradientAt(TinyGPTModule):
    """A finite loss whose gradient is NaN (through a hook on the logits)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        if batch_idx == BAD_BATCH:
            logits.register_hook(lambda g: g * float("nan"))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def _fit(strategy: Any, module_cls: type = NaNLossAt, callbacks: list | None = None) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    module = module_cls(lr=3e-3)
    make_trainer(strategy, K, max_epochs=1, callbacks=callbacks or []).fit(module, token_loader(9))
    return module


def test_warn_names_the_first_nonfinite_loss_and_trains_on_like_lightning():
    with pytest.warns(UserWarning, match=r"loss of micro-batch 1 of optimizer step 2 \(trainer.global_step=1 during it\) is nan.*on_nonfinite='warn'"):
        module = _fit(GreedySnakeStrategy(auto=False))
    assert all(torch.isnan(p).any() for p in module.parameters())  # as under strategy="auto"


def test_raise_stops_at_the_first_nonfinite_loss_and_keeps_the_last_good_weights():
    L.seed_everything(0, verbose=False)
    module = NaNLossAt(lr=3e-3)
    trainer = make_trainer(GreedySnakeStrategy(auto=False, on_nonfinite="raise"), K, max_epochs=1)
    # the failing step and the weights left are named in one count: the step's ordinal and global_step
    with pytest.raises(NonFiniteError, match=r"micro-batch 1 of optimizer step 2 \(trainer.global_step=1 during it\) "
                       r"is nan.*Fix"), \
            pytest.warns(UserWarning, match=r"NaNLossAt.model holds the last complete optimizer step, optimizer step 1 "
                         r"\(trainer.global_step=1\)"):
        trainer.fit(module, token_loader(9))
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert not (Path.cwd() / "greedysnake_offload").exists()  # nothing left behind


class DropStep(L.Callback):
    """The reference for 'skip' under strategy='auto': that window's gradients never reach the step."""

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if trainer.global_step == 1:
            module.zero_grad(set_to_none=True)


def test_skip_drops_the_windows_update_and_equals_lightning_with_that_step_dropped():
    with pytest.warns(UserWarning, match=r"optimizer step 2 \(trainer.global_step=1 during it\) is nan; on_nonfinite='skip' dropped"):
        got = _fit(GreedySnakeStrategy(auto=False, on_nonfinite="skip"))
    ref = _fit("auto", callbacks=[DropStep()])
    params = {n: p.detach() for n, p in got.named_parameters()}
    assert all(torch.isfinite(p).all() for p in params.values())
    assert max_abs_diff(params, {n: p.detach() for n, p in ref.named_parameters()}) <= 1e-5


def test_a_nonfinite_gradient_under_a_finite_loss_is_named_by_unit():
    """(lag=0: every unit is stepped before the step ends, so the report comes with that step.)"""
    with pytest.warns(UserWarning, match=r"gradient of units \[0, 1, 2\] is not finite \(found by optimizer step 2 "
                                         r"\(trainer.global_step=1 during it\)"):
        _fit(GreedySnakeStrategy(auto=False, lag=0), NaNGradientAt)
    with pytest.raises(NonFiniteError, match=r"gradient of units \[0, 1, 2\] is not finite.*Fix"):
        _fit(GreedySnakeStrategy(auto=False, lag=0, on_nonfinite="raise"), NaNGradientAt)


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match=r"on_nonfinite='ignore' is not valid.*Fix"):
        GreedySnakeStrategy(auto=False, on_nonfinite="ignore")


@pytest.mark.parametrize("lag", [0, None])
def test_after_a_raise_on_a_nonfinite_gradient_the_note_says_what_the_module_holds(lag):
    """The gradient check runs once the step's units are stepped: the update of optimizer step 2, made with
    the NaN gradient, landed before the raise (Lightning never counted it; trainer.global_step stays 1). The
    after-fit note says that step's update and that the parameters are not finite, and they are not (was:
    'holds the last complete optimizer step, optimizer step 1')."""
    L.seed_everything(0, verbose=False)
    module = NaNGradientAt(lr=3e-3)
    strategy = GreedySnakeStrategy(auto=False, on_nonfinite="raise", **({} if lag is None else {"lag": lag}))
    trainer = make_trainer(strategy, K, max_epochs=1)
    with pytest.raises(NonFiniteError, match=r"gradient of units? \[.*\] is not finite"), \
            pytest.warns(UserWarning, match="fit failed") as seen:
        trainer.fit(module, token_loader(9))
    note = next(str(w.message) for w in seen if "fit failed" in str(w.message))
    assert "last complete optimizer step" not in note, note
    stepped = r"optimizer step (\d+)'s update in every unit \(trainer.global_step=(\d+): fit raised"
    found = re.search(stepped, note)
    assert found and int(found.group(1)) == int(found.group(2)) + 1, note
    assert "were stepped with a non-finite gradient" in note, note
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    if finite:
        assert "its parameters are finite" in note, note
    else:
        claimed = re.search(r"the parameters of units? \[([\d, ]+)\] are not finite", note)
        assert claimed, note
        units = [int(u) for u in claimed.group(1).split(",")]
        for unit, block in enumerate(module.model.blocks):  # (one block a unit)
            assert (unit in units) == (not all(bool(torch.isfinite(p).all()) for p in block.parameters())), (unit, note)


class SequentialNaNLossAt(SequentialModule):
    """A Sequential whose Tanh is a unit without parameters (never stepped)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        return loss * float("nan") if batch_idx == BAD_BATCH else loss


def test_after_a_raise_a_unit_without_parameters_is_no_mix():
    """A unit the optimizer never steps (a Tanh's) counts no steps: the note after a raise on a non-finite loss
    says the module holds the last complete optimizer step, as it does (was: 'a mix: units [0, 2, 3, 4] were
    already updated'), and those are the weights of a run stopped after that step."""
    def fit(module: L.LightningModule, batches: int, raise_: bool) -> Any:
        strategy = GreedySnakeStrategy(auto=False, on_nonfinite="raise") if raise_ else GreedySnakeStrategy(auto=False)
        return make_trainer(strategy, K, max_epochs=1, limit_train_batches=batches).fit(
            module, regression_loader(9))

    L.seed_everything(0, verbose=False)
    module = SequentialNaNLossAt()
    with pytest.raises(NonFiniteError), pytest.warns(UserWarning, match="fit failed") as seen:
        fit(module, 9, raise_=True)
    note = next(str(w.message) for w in seen if "fit failed" in str(w.message))
    assert "holds the last complete optimizer step, optimizer step 1" in note and "a mix" not in note, note
    L.seed_everything(0, verbose=False)
    good = SequentialNaNLossAt()
    fit(good, K, raise_=False)  # the first window only
    assert max_abs_diff(dict(module.named_parameters()), dict(good.named_parameters())) == 0
