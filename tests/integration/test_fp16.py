"""16-mixed: fp16 compute weights, fp32 master weights, moments and gradient accumulation, and dynamic
loss scaling with torch.amp.GradScaler's semantics; against a plain-PyTorch loop with the same policy
(autocast fp16 over fp16 copies of the master weights, the same accumulation, GradScaler's rules)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_greedysnake import GreedySnakePrecision, GreedySnakeStrategy, OffloadConfig
from tests.helpers import (
    TinyGPTModule,
    UnitGradients,
    make_trainer,
    max_abs_diff,
    mixed_policy_start,
    policy_window,
    token_loader,
)

LR = 3e-3
K = 3
NUM_BATCHES = 9
EPOCHS = 2
HUGE = {4}
FACTOR = {"huge": 1e6, "nan": float("nan")}
"""Global micro-batch indices whose loss is multiplied by 1e6: the scaled gradient overflows fp16 in
the middle of the second window."""
SCALER = {"init_scale": 2.0**10, "growth_interval": 2}


class HugeLoss(TinyGPTModule):
    factor = FACTOR["huge"]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        index = self.trainer.current_epoch * NUM_BATCHES + batch_idx
        return loss * self.factor if index in HUGE else loss


def reference(clip: tuple[str, float] | None = None,
              factor: float = FACTOR["huge"]) -> tuple[dict[str, torch.Tensor], list[float], list[int], list]:
    """fp16 copies of the fp32 master weights compute each window under autocast; the loss (over K) is
    multiplied by the scale; each micro-batch's fp16 gradient is accumulated in fp32; then GradScaler's
    rules: a window with an inf or NaN is skipped and the scale backs off, otherwise the gradients are
    unscaled, clipped and stepped, and the scale grows every ``growth_interval`` good windows."""
    L.seed_everything(0, verbose=False)
    module = HugeLoss(n_layer=3, lr=LR)
    optimizer, scheduler, master, compute = mixed_policy_start(module, torch.float16)
    batches = list(token_loader(NUM_BATCHES))
    scale, tracker = SCALER["init_scale"], 0
    scales, skipped, grads = [], [], []
    step = 0
    for epoch in range(EPOCHS):
        for start in range(0, len(batches), K):
            def backward_of(i: int, loss: torch.Tensor, first: int = epoch * NUM_BATCHES + start,
                            scale: float = scale) -> torch.Tensor:
                if first + i in HUGE:
                    loss = loss * factor
                return (loss / K) * scale

            acc = policy_window(compute, master, batches[start : start + K], torch.float16, backward_of)
            step += 1
            if not all(bool(torch.isfinite(a).all()) for a in acc):
                skipped.append(step)
                scale, tracker = scale * 0.5, 0
            else:
                for m, a in zip(master, acc, strict=True):
                    m.grad = a * (1.0 / scale)
                grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
                if clip is not None and clip[0] == "norm":
                    torch.nn.utils.clip_grad_norm_(master, clip[1])
                elif clip is not None:
                    torch.nn.utils.clip_grad_value_(master, clip[1])
                optimizer.step()
                optimizer.zero_grad()
                tracker += 1
                if tracker == SCALER["growth_interval"]:
                    scale, tracker = scale * 2.0, 0
            scheduler.step()
            scales.append(scale)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, scales, skipped, grads


class Scales(UnitGradients):
    def __init__(self) -> None:
        super().__init__()
        self.scales: list[float] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        super().on_train_start(trainer, module)
        manager = trainer.strategy.tensor_manager
        self.speculative = manager.speculative if manager is not None else None

    def on_train_end(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        manager.drain()
        self.steps_completed = list(manager.stepper.steps_completed)

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if (trainer.fit_loop.epoch_loop.batch_idx + 1) % K == 0:
            self.scales.append(trainer.precision_plugin.loss_scaler.scale)


def plugin() -> GreedySnakePrecision:
    return GreedySnakePrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", **SCALER))


def greedysnake(strategy: Any, epochs: int = EPOCHS, factor: float = FACTOR["huge"],
                **kwargs: Any) -> tuple[dict[str, torch.Tensor], Scales, Any]:
    L.seed_everything(0, verbose=False)
    module = HugeLoss(n_layer=3, lr=LR)
    module.factor = factor
    seen = Scales()
    ckpt_path = kwargs.pop("ckpt_path", None)
    trainer = make_trainer(strategy, K, max_epochs=epochs, plugins=[kwargs.pop("precision", plugin())],
                           callbacks=[seen, *kwargs.pop("callbacks", [])], **kwargs)
    trainer.fit(module, token_loader(NUM_BATCHES), ckpt_path=ckpt_path)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, seen, trainer


@pytest.fixture(scope="module")
def plain() -> tuple:
    return reference()


SETTINGS = {
    "defaults": {},
    "synchronous": {"alpha": 0.0, "lag": 0},
    "alpha_half_lag_2": {"alpha": 0.5, "lag": 2},
    "horizontal": {"schedule": "horizontal"},
    "host": {"offload": OffloadConfig.everywhere("host")},
    "device_weights": {"offload": {"weights": "device"}},  # (two slots of them on the simulated device)
}


@pytest.mark.parametrize("settings", list(SETTINGS.values()), ids=list(SETTINGS))
def test_an_overflow_mid_window_is_skipped_as_gradscaler_skips_it(plain, settings):
    ref_params, ref_scales, ref_skipped, ref_grads = plain
    assert ref_skipped == [2] and len(set(ref_scales)) > 2  # (the reference backs off and grows)
    got, seen, trainer = greedysnake(GreedySnakeStrategy(auto=False, **settings))
    assert seen.speculative  # (steps as gradients complete, undone on overflow)
    assert trainer.precision_plugin.loss_scaler.skipped_steps == ref_skipped
    assert set(seen.steps_completed) == {EPOCHS * NUM_BATCHES // K - len(ref_skipped)}  # (the undone one uncounted)
    assert seen.scales == ref_scales
    assert max_abs_diff(got, ref_params) <= 1e-5
    # every stepped window's unscaled gradient (speculative steps also show the skipped window's)
    windows = [w for w in seen.windows() if all(bool(torch.isfinite(g).all()) for g in w.values())]
    assert len(windows) == len(ref_grads)
    for step, (g, r) in enumerate(zip(windows, ref_grads, strict=True)):
        assert max_abs_diff(g, r) <= 1e-6 * max(1.0, max(float(v.abs().max()) for v in r.values())), step


@pytest.mark.parametrize("clip", [("norm", 0.05), ("value", 0.01)], ids=["norm", "value"])
def test_clipping_sees_the_unscaled_gradients(clip):
    ref_params, ref_scales, ref_skipped, ref_grads = reference(clip)
    got, seen, trainer = greedysnake(GreedySnakeStrategy(auto=False), gradient_clip_val=clip[1],
                                     gradient_clip_algorithm=clip[0])
    assert seen.speculative == (clip[0] == "value")  # (norm clipping waits for the whole backward)
    assert trainer.precision_plugin.loss_scaler.skipped_steps == ref_skipped and seen.scales == ref_scales
    windows = [w for w in seen.windows() if all(bool(torch.isfinite(g).all()) for g in w.values())]
    assert len(windows) == len(ref_grads)
    for step, (g, r) in enumerate(zip(windows, ref_grads, strict=True)):  # (unscaled, before clipping)
        assert max_abs_diff(g, r) <= 1e-6 * max(1.0, max(float(v.abs().max()) for v in r.values())), step
    assert max_abs_diff(got, ref_params) <= 1e-5


def test_the_reference_is_fp16(plain):
    """Guards the comparison: fp16 lands measurably away from bf16 and from fp32 on the same data."""
    ref_params = plain[0]
    L.seed_everything(0, verbose=False)
    module = HugeLoss(n_layer=3, lr=LR)
    make_trainer(GreedySnakeStrategy(auto=False), K, max_epochs=EPOCHS, precision="bf16-mixed").fit(
        module, token_loader(NUM_BATCHES))
    assert max_abs_diff({n: p.detach() for n, p in module.named_parameters()}, ref_params) > 1e-4


def test_a_resume_right_after_an_overflow_lands_on_the_uninterrupted_run(plain, tmp_path: Path):
    """The scale and its growth tracker are saved with the plugin's state: resuming from the checkpoint
    taken at the end of the first epoch (after the overflow of step 2) continues the same scale history."""
    uninterrupted, seen_a, _ = greedysnake(GreedySnakeStrategy(auto=False))
    every = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    greedysnake(GreedySnakeStrategy(auto=False), epochs=1, callbacks=[every], enable_checkpointing=True,
                default_root_dir=tmp_path)
    resumed, seen_b, trainer = greedysnake(GreedySnakeStrategy(auto=False), callbacks=[ModelCheckpoint(dirpath=tmp_path)],
                                           enable_checkpointing=True, default_root_dir=tmp_path,
                                           ckpt_path=str(tmp_path / "last.ckpt"))
    assert trainer.global_step == EPOCHS * NUM_BATCHES // K
    assert seen_b.scales == seen_a.scales[NUM_BATCHES // K :]
    assert max_abs_diff(resumed, uninterrupted) == 0


def test_settings_come_from_lightnings_plugin_and_bad_ones_are_refused():
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    got = GreedySnakePrecision.from_plugin(MixedPrecision("16-mixed", "cuda", scaler=scaler)).loss_scaler
    assert (got.scale, got.growth_factor, got.backoff_factor, got.growth_interval) == (8.0, 4.0, 0.25, 7)
    assert GreedySnakePrecision.from_plugin(MixedPrecision("16-mixed", "cuda", scaler=None)).loss_scaler.scale == 2**16
    from lightning_greedysnake.loss_scale import LossScaler

    with pytest.raises(ValueError, match=r"growth_interval=0 must be a positive integer\. Fix: e\.g\. 2000"):
        LossScaler(growth_interval=0)
    with pytest.raises(ValueError, match=r"disabled GradScaler.*Fix"):
        GreedySnakePrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", enabled=False))
    with pytest.raises(ValueError, match=r"16-mixed' with every kind of tensor on 'device'.*strategy='auto'"):
        greedysnake(GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("device")))


def test_the_loss_scale_is_logged_and_an_overflow_is_said(plain, caplog):
    from tests.helpers import RecordingLogger

    logger = RecordingLogger()
    with caplog.at_level("INFO"):
        _, seen, _ = greedysnake(GreedySnakeStrategy(auto=False), logger=logger)
    assert [v for _, v in logger.series("greedysnake/loss_scale")] == seen.scales == plain[1]
    assert [v for _, v in logger.series("greedysnake/skipped_steps")] == [0, 1, 1, 1, 1, 1]
    assert ("fp16 gradients overflowed in optimizer step 2 (trainer.global_step=1 during it): step skipped, loss "
            "scale 1024 -> 512") in caplog.text


@pytest.mark.parametrize("on_nonfinite", ["warn", "skip"])
def test_a_nan_loss_backs_the_scale_off_as_gradscaler_does(on_nonfinite):
    """A NaN loss makes NaN gradients: GradScaler skips the step and backs off. So does greedysnake, also
    where ``on_nonfinite='skip'`` drops the window before any gradient exists."""
    ref_params, ref_scales, ref_skipped, _ = reference(factor=FACTOR["nan"])
    with pytest.warns(UserWarning, match=r"the loss of micro-batch 1 of optimizer step 2 "
                                         r"\(trainer.global_step=1 during it\) is nan") as said:
        got, seen, trainer = greedysnake(GreedySnakeStrategy(auto=False, on_nonfinite=on_nonfinite), factor=FACTOR["nan"])
    text = " ".join(str(w.message) for w in said)
    assert ("loss scaler skips that step" in text) == (on_nonfinite == "warn") and "will be NaN" not in text
    assert trainer.precision_plugin.loss_scaler.skipped_steps == ref_skipped == [2]
    assert seen.scales == ref_scales
    assert max_abs_diff(got, ref_params) <= 1e-5
