"""What the LightningModule holds after fit, as with ``strategy="auto"``: the trained weights and the
optimizer's state (so a checkpoint saved after fit is complete), the last complete update after an
exception the caller caught, and a clear error on first use where the state could not come back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GPT, GPTConfig, GreedySnakeStrategy
from lightning_greedysnake.checkpoint.plain import plain_checkpoint
from lightning_greedysnake.optim import OptimizerLaneError
from lightning_greedysnake.strategy.after_fit import StateNotReturned
from tests.helpers import TinyGPTModule, UnitGradients, make_trainer, max_abs_diff, token_loader

K = 3


def _params(module: L.LightningModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _fit(strategy: Any, root: Path, epochs: int = 1, ckpt_path: str | None = None, callbacks: list | None = None,
         module: L.LightningModule | None = None) -> tuple[L.LightningModule, L.Trainer]:
    if module is None:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(lr=3e-3)
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(strategy, K, max_epochs=epochs, default_root_dir=root, callbacks=callbacks or [])
    trainer.fit(module, token_loader(9), ckpt_path=ckpt_path)
    return module, trainer


def test_a_checkpoint_saved_after_fit_holds_the_optimizer_state_as_under_auto(tmp_path):
    saved = {}
    for name, strategy in (("auto", "auto"), ("gs", GreedySnakeStrategy(auto=False))):
        _, trainer = _fit(strategy, tmp_path / name)
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")  # after fit returned
        saved[name] = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)
    auto, gs = saved["auto"], saved["gs"]
    assert max_abs_diff(dict(gs["state_dict"]), dict(auto["state_dict"])) <= 1e-5
    auto_state, gs_state = auto["optimizer_states"][0]["state"], gs["optimizer_states"][0]["state"]
    assert gs_state.keys() == auto_state.keys() and len(auto_state) > 0
    for i in auto_state:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(gs_state[i][key].float(), auto_state[i][key].float(), atol=1e-5), (i, key)
    # resumed from those files, each lands where the other does (Adam's moments did not restart)
    resumed_auto, _ = _fit("auto", tmp_path / "ra", epochs=2, ckpt_path=str(tmp_path / "auto.ckpt"))
    resumed_gs, _ = _fit(GreedySnakeStrategy(auto=False), tmp_path / "rg", epochs=2, ckpt_path=str(tmp_path / "gs.ckpt"))
    assert max_abs_diff(_params(resumed_gs), _params(resumed_auto)) <= 1e-5


def test_without_return_weights_saving_or_using_the_model_after_fit_says_where_the_state_went(tmp_path):
    module, trainer = _fit(GreedySnakeStrategy(auto=False, offload={"return_weights": False}), tmp_path)
    with pytest.raises(StateNotReturned, match=r"offload.return_weights=False.*Fix: load a checkpoint"):
        trainer.save_checkpoint(tmp_path / "after.ckpt")
    x = next(iter(token_loader(1)))[0]
    with pytest.raises(StateNotReturned, match=r"return_weights=False"):
        module.model(x)
    assert not (tmp_path / "after.ckpt").exists() and not (tmp_path / "greedysnake_offload").exists()
    module.load_state_dict(TinyGPTModule().state_dict())  # real weights: usable again
    assert torch.isfinite(module.model(x)).all()


class FailAt(L.Callback):
    """Raises when Lightning hands over the batch at ``batch_idx`` (the caller catches it)."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.batch_idx:
            raise RuntimeError("stop here")


def test_an_exception_caught_by_the_caller_leaves_the_last_complete_update_as_under_auto(tmp_path):
    """The failure comes as window 3 starts (after 2 optimizer steps, alpha parts still pending): the
    module holds step 2's weights, as under strategy='auto', and the warning says so."""
    got = {}
    for name, strategy in (("auto", "auto"), ("gs", GreedySnakeStrategy(auto=False))):
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(lr=3e-3)
        with pytest.raises(RuntimeError, match="stop here"), pytest.warns(UserWarning) as caught:
            _fit(strategy, tmp_path / name, callbacks=[FailAt(6)], module=module)
        got[name] = _params(module)
        if name == "gs":
            assert any("last complete optimizer step, optimizer step 2 (trainer.global_step=2)" in str(w.message)
                       for w in caught)
            assert not (tmp_path / name / "greedysnake_offload").exists()  # nothing left behind
    assert all(torch.isfinite(p).all() and p.stride() != (0,) * p.dim() for p in got["gs"].values())
    assert max_abs_diff(got["gs"], got["auto"]) <= 1e-5


class MyModel(TinyGPTModule):
    """A user's LightningModule: messages name it, not the GPT inside."""


@pytest.mark.parametrize("offload, where", [
    ({"weights": "host", "master_weights": "host", "optimizer_states": "host", "gradients": "host"},
     "read back from host memory, with"),
    ({"weights": "host", "master_weights": "host", "optimizer_states": "ssd", "gradients": "host"},
     "read back from host memory and the offload files in "),
], ids=["in-ram", "state-on-ssd"])
def test_the_fit_failed_warning_says_where_the_state_was_read_back_from(tmp_path, offload, where):
    """The truth per placement (no "offload files" where every kind is in RAM), naming the user's class."""
    L.seed_everything(0, verbose=False)
    module = MyModel(lr=3e-3)
    with pytest.raises(RuntimeError, match="stop here"), pytest.warns(UserWarning) as caught:
        _fit(GreedySnakeStrategy(auto=False, offload=offload), tmp_path, callbacks=[FailAt(6)], module=module)
    said = [str(w.message) for w in caught if "fit failed" in str(w.message)]
    assert len(said) == 1 and where in said[0] and said[0].startswith("greedysnake: fit failed; MyModel.model holds"), said
    assert ("offload files" in said[0]) == ("ssd" in str(offload))


@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_a_failure_in_the_middle_of_a_windows_backward_says_which_units_are_ahead(tmp_path, alpha):
    """Units are stepped as their gradients complete: a failure in unit 0's backward of window 2 comes
    after units 1 and 2 were updated (with alpha, their deferred parts are completed too: no unit is
    left half updated). The module gets what the tiers hold, and the warning says so."""
    module = TinyGPTModule(lr=3e-3)
    armed = {"on": False}

    class Arm(L.Callback):
        def on_train_batch_start(self, trainer: Any, m: Any, batch: Any, batch_idx: int) -> None:
            armed["on"] = batch_idx == 2 * K - 1  # the last micro-batch of window 2

    def fail_in_recompute(block: Any, args: Any) -> None:
        if armed["on"] and torch.is_grad_enabled():  # unit 0's recomputing backward (its forward is no_grad)
            raise RuntimeError("unit 0 failed")

    module.model.blocks[0].register_forward_pre_hook(fail_in_recompute)
    with pytest.raises(RuntimeError, match="unit 0 failed"), pytest.warns(UserWarning) as caught:
        _fit(GreedySnakeStrategy(auto=False, alpha=alpha), tmp_path, callbacks=[Arm()], module=module)
    assert any("units [1, 2] were already updated by optimizer step 2 (trainer.global_step=1 during it)" in str(w.message)
               and "units hold optimizer step 1 (trainer.global_step=1)" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert not (tmp_path / "greedysnake_offload").exists()


def test_a_failed_optimizer_lane_leaves_a_model_that_fails_on_use_naming_the_fix(tmp_path):
    class Break(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            def observe(name: str, grad: torch.Tensor) -> None:  # on the lane, in the second window
                if trainer.global_step == 1:
                    raise OSError(5, "the disk went away")

            trainer.strategy.register_gradient_hook(observe)

    module = TinyGPTModule(lr=3e-3)
    with pytest.raises(OptimizerLaneError, match="disk went away"):
        _fit(GreedySnakeStrategy(auto=False), tmp_path, callbacks=[Break()], module=module)
    x = next(iter(token_loader(1)))[0]
    with pytest.raises(StateNotReturned, match=r"could not read TinyGPTModule.model's weights back.*Fix: load a checkpoint"):
        module.model(x)
    assert not (tmp_path / "greedysnake_offload").exists()


class Recorder(UnitGradients):
    """Each window's gradients (``param.grad`` under Lightning, the stepper's under greedysnake) and, at
    the last step, a checkpoint saved while the run is open (greedysnake streams it from the tiers)."""

    def __init__(self, save_to: Path) -> None:
        super().__init__()
        self.save_to = save_to
        self.resident: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.resident.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})

    def on_train_end(self, trainer: Any, module: Any) -> None:
        trainer.save_checkpoint(self.save_to)

    @property
    def grads(self) -> list[dict[str, torch.Tensor]]:
        return self.windows() if self.per_name else self.resident


class Twelve(TinyGPTModule):
    """12 blocks: the optimizer's state (317 KiB) is larger than what a small host budget holds."""

    def __init__(self) -> None:
        super().__init__(lr=3e-3)
        self.model = GPT(GPTConfig(n_layer=12, n_head=2, n_embd=16, vocab_size=32, block_size=8))


def _fit_twelve(strategy: Any, root: Path) -> tuple[L.LightningModule, L.Trainer, Recorder]:
    L.seed_everything(0, verbose=False)
    module, recorder = Twelve(), Recorder(root / "last.ckpt")
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(strategy, K, max_epochs=1, default_root_dir=root, callbacks=[recorder])
    trainer.fit(module, token_loader(2 * K))
    return module, trainer, recorder


def _moments(state: dict[int, dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {f"{i}.{key}": torch.as_tensor(entry[key]).float() for i, entry in state.items()
            for key in ("exp_avg", "exp_avg_sq", "step")}


def _same_training(got: Recorder, ref: Recorder) -> None:
    assert len(got.grads) == len(ref.grads) == 2
    for window, ref_window in zip(got.grads, ref.grads, strict=True):
        assert window.keys() == ref_window.keys() and max_abs_diff(window, ref_window) <= 1e-5


STAGING = 256 << 10
SMALL_BUDGET = STAGING * 8 // 7 + 8  # room for the staging and the checkpoints' share: every kind on SSD
"""The weights (158 KiB) come back within it, with the optimizer's state (317 KiB more) they would not."""


def test_what_does_not_fit_the_host_budget_is_said_at_setup_and_refused_after_fit(tmp_path, caplog):
    """The end of fit is planned within the host budget: the weights come back (as Lightning's), the
    optimizer's state does not, the report and a warning say so at setup with the fixes, and the
    optimizer refuses ``state_dict`` and ``step`` after fit, naming them. The fix it names, a checkpoint
    at the last step, holds the moments Lightning's optimizer holds."""
    strategy = GreedySnakeStrategy(auto_host_budget_bytes=SMALL_BUDGET, layers_per_unit=1,
                                   offload={"buffer_budget_bytes": STAGING})
    with caplog.at_level("INFO"), pytest.warns(UserWarning) as caught:
        module, trainer, got = _fit_twelve(strategy, tmp_path / "gs")
    ref_module, ref_trainer, ref = _fit_twelve("auto", tmp_path / "auto")
    report = next(line for line in caplog.text.splitlines() if "greedysnake host memory:" in line)
    assert "The optimizer's state (316.8 KiB) does not come back at the end of fit" in report, report
    assert "the weights do (158.4 KiB)" in report and "ModelCheckpoint" in report, report
    said = [str(w.message) for w in caught if "does not come back" in str(w.message)]
    assert len(said) == 1 and "raise auto_host_budget_bytes" in said[0], said
    assert max_abs_diff(_params(module), _params(ref_module)) <= 1e-5
    _same_training(got, ref)
    optimizer = trainer.optimizers[0]
    assert not optimizer.state  # (nothing came back)
    for use in (optimizer.state_dict, optimizer.step, lambda: trainer.save_checkpoint(tmp_path / "after.ckpt")):
        with pytest.raises(StateNotReturned, match=r"optimizer's state .* does not come back.*ModelCheckpoint"):
            use()
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)  # the weights, as the message says
    saved = torch.load(tmp_path / "weights.ckpt", weights_only=False)["state_dict"]
    assert max_abs_diff(dict(saved), _params(ref_module)) <= 1e-5
    last = plain_checkpoint(tmp_path / "gs" / "last.ckpt")  # the fix: streamed from the tiers during fit
    ref_state = ref_trainer.optimizers[0].state_dict()["state"]
    assert max_abs_diff(_moments(last["optimizer_states"][0]["state"]), _moments(ref_state)) <= 1e-5
    optimizer.load_state_dict(last["optimizer_states"][0])  # a state loaded: usable again
    assert optimizer.state_dict()["state"].keys() == ref_state.keys()


def test_where_everything_fits_the_host_budget_the_weights_and_moments_come_back_as_under_auto(tmp_path, caplog):
    strategy = GreedySnakeStrategy(auto_host_budget_bytes=4 * SMALL_BUDGET, layers_per_unit=1,
                                   offload={"buffer_budget_bytes": STAGING})
    with caplog.at_level("INFO"):
        module, trainer, got = _fit_twelve(strategy, tmp_path / "gs")
    ref_module, ref_trainer, ref = _fit_twelve("auto", tmp_path / "auto")
    report = next(line for line in caplog.text.splitlines() if "greedysnake host memory:" in line)
    assert "the trained weights and the optimizer's state come back" in report and "within the budget" in report
    assert max_abs_diff(_params(module), _params(ref_module)) <= 1e-5
    _same_training(got, ref)
    got_state, ref_state = trainer.optimizers[0].state_dict()["state"], ref_trainer.optimizers[0].state_dict()["state"]
    assert got_state.keys() == ref_state.keys() and len(ref_state) > 0
    assert max_abs_diff(_moments(got_state), _moments(ref_state)) <= 1e-5
