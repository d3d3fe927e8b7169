"""bf16-mixed: 16-bit compute weights from the tensor manager, fp32 master weights and moments, fp32
gradient accumulation; against a plain-PyTorch loop with the same precision policy."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy, OffloadConfig
from tests.helpers import (
    TinyGPTModule,
    UnitGradients,
    bf16_policy_run,
    make_trainer,
    max_abs_diff,
    token_loader,
)

LR = 3e-3
K = 3
NUM_BATCHES = 9
EPOCHS = 2


POLICY_GRADS: list[dict[str, torch.Tensor]] = []
"""The policy reference's accumulated fp32 gradient of every window (filled by :func:`policy_reference`)."""


def policy_reference() -> dict[str, torch.Tensor]:
    """bf16 copies of the fp32 master weights compute each window under autocast; each micro-batch's
    bf16 gradient is accumulated in fp32; the user's AdamW steps the fp32 master weights."""
    POLICY_GRADS.clear()
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=3, lr=LR)
    POLICY_GRADS.extend(bf16_policy_run(module, list(token_loader(NUM_BATCHES)), K, EPOCHS))
    return {n: p.detach().clone() for n, p in module.named_parameters()}


class ComputeDtype(UnitGradients):
    """The manager's compute dtype and SSD bytes, and every window's gradient as the stepper saw it."""

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        manager = trainer.strategy.tensor_manager
        if manager is not None:
            self.compute_dtype = manager.compute_dtype
            self.ssd_bytes = manager.placement.ssd_bytes()


def greedysnake_bf16(
    strategy: Any, precision: str = "bf16-mixed", epochs: int = EPOCHS
) -> tuple[dict[str, torch.Tensor], Any]:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=3, lr=LR)
    probe = ComputeDtype()
    trainer = make_trainer(strategy, K, max_epochs=epochs, precision=precision, callbacks=[probe])
    trainer.fit(module, token_loader(NUM_BATCHES))
    assert trainer.global_step == epochs * NUM_BATCHES // K
    return {n: p.detach().clone() for n, p in module.named_parameters()}, probe


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return policy_reference()


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("placement", ["ssd", "host"])
def test_bf16_mixed_matches_the_same_policy_in_plain_pytorch(reference, schedule, placement):
    offload = OffloadConfig.everywhere("host") if placement == "host" else None
    got, probe = greedysnake_bf16(GreedySnakeStrategy(auto=False, schedule=schedule, offload=offload))
    assert probe.compute_dtype is torch.bfloat16
    assert all(p.dtype is torch.float32 for p in got.values())  # the master weights come back
    assert max_abs_diff(got, reference) <= 1e-5
    windows = probe.windows()  # and every window's fp32-accumulated gradient
    assert len(windows) == len(POLICY_GRADS)
    for step, (g, r) in enumerate(zip(windows, POLICY_GRADS, strict=True)):
        assert max_abs_diff(g, r) <= (1e-6 if step == 0 else 1e-5), step
    if placement == "ssd":
        # 16-bit compute weights on SSD next to the fp32 master copy
        assert probe.ssd_bytes["weights"] < 0.6 * probe.ssd_bytes["master_weights"]


def test_the_policy_reference_differs_from_fp32_training(reference):
    """Guards the comparison: the bf16 policy lands measurably away from fp32 training."""
    fp32, _ = greedysnake_bf16(GreedySnakeStrategy(auto=False), precision="32-true")
    assert max_abs_diff(fp32, reference) > 1e-4


@pytest.mark.parametrize("strategy", ["instance", "name"])
@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_other_precisions_are_refused_with_the_fix(precision, strategy):
    with pytest.raises(ValueError, match=r"precision=.*not supported by strategy='greedysnake'.*Fix"):
        make_trainer(GreedySnakeStrategy(auto=False) if strategy == "instance" else "greedysnake", 1, precision=precision)


def test_bf16_mixed_with_everything_on_the_device_is_lightnings_own_policy():
    """No tensor manager: fp32 parameters under autocast, as Trainer(strategy='auto') does it."""
    L.seed_everything(0, verbose=False)
    ref = TinyGPTModule(n_layer=3, lr=LR)
    make_trainer("auto", K, max_epochs=1, precision="bf16-mixed").fit(ref, token_loader(NUM_BATCHES))
    got, _ = greedysnake_bf16(GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("device")), epochs=1)
    assert max_abs_diff(got, {n: p.detach() for n, p in ref.named_parameters()}) <= 1e-5


def test_the_precision_plugin_autocasts_on_the_accelerators_device():
    # passed explicitly as plugins=[GreedySnakePrecision("bf16-mixed")] on a GPU, a fixed "cpu" default
    # ran the CUDA forward wholly in bf16 (LayerNorm, softmax) with no error: the device comes from the
    # accelerator unless given
    from lightning_greedysnake.precision import GreedySnakePrecision

    plugin = GreedySnakePrecision("bf16-mixed")
    plugin.on_device(torch.device("cuda", 1))
    assert plugin.device == "cuda"
    given = GreedySnakePrecision("bf16-mixed", device="cpu")
    given.on_device(torch.device("cuda", 0))
    assert given.device == "cpu"  # (an explicit one is kept)


def test_a_precision_plugin_passed_explicitly_on_the_simulated_device_matches(reference, monkeypatch):
    from lightning_greedysnake.offload.device import SIMULATE_ENV
    from lightning_greedysnake.precision import GreedySnakePrecision

    monkeypatch.setenv(SIMULATE_ENV, "1")
    plugin = GreedySnakePrecision("bf16-mixed")
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=3, lr=LR)
    trainer = make_trainer(GreedySnakeStrategy(auto=False), K, max_epochs=EPOCHS, plugins=[plugin])
    trainer.fit(module, token_loader(NUM_BATCHES))
    assert trainer.strategy.precision_plugin is plugin
    assert plugin.device == trainer.strategy.root_device.type
    got = {n: p.detach().clone() for n, p in module.named_parameters()}
    assert max_abs_diff(got, reference) <= 1e-5
