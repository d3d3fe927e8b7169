"""Exact at the edges: dropout's random draws and buffers updated in the forward (BatchNorm).

Dropout: every micro-batch's forwards draw from their own stream (:mod:`lightning_greedysnake.rng`), in every
order and placement, and :class:`~lightning_greedysnake.MicrobatchRNG` applies the same policy under Lightning's
own strategy: the reference here. Before the policy, with one global generator, the vertical order drew other
masks than Lightning (7.5e-2 on a parameter) and other masks than the horizontal order, so results depended on
what the planner chose.

Buffers: a recomputation puts a unit's buffers back as its forward left them; the vertical order, which runs half
its units' micro-batches in descending order, is refused for a unit that updates buffers (before any step).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_greedysnake import GreedySnakeStrategy, MicrobatchRNG
from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.rng import TrainingRng
from tests.helpers import OptimizerMixin, TinyGPTModule, make_trainer, max_abs_diff, regression_loader, token_loader
from tests.integration.test_equivalence import GradRecorder

K = 4
NUM_BATCHES = 10  # windows of 4, 4, 2: the last one partial
LR = 3e-3
ON_DEVICE = OffloadConfig.everywhere("device")

ORDERS: dict[str, dict[str, Any]] = {
    # Lightning's order on the engine, every unit's graph kept (what the planner picks where all fits in RAM)
    "inline": {"auto": False, "schedule": "horizontal", "recompute": False, "offload": ON_DEVICE},
    "planned": {},
    "horizontal_ssd": {"auto": False, "schedule": "horizontal"},
    "vertical_ssd": {"auto": False, "schedule": "vertical"},
    "vertical_device": {"auto": False, "schedule": "vertical", "offload": ON_DEVICE},
}


class DropoutSequential(OptimizerMixin, L.LightningModule):
    """nn.Dropout modules (the GPT's attention dropout is the functional one)."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        self.lr = LR
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Dropout(p), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(p),
                                 nn.LayerNorm(16), nn.Linear(16, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)


class BatchNormSequential(OptimizerMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lr = LR
        self.net = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 12),
                                 nn.BatchNorm1d(12), nn.Linear(12, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)


def _module(model: str, p: float = 0.3) -> tuple[L.LightningModule, Any]:
    if model == "gpt":  # attention dropout (functional, in scaled_dot_product_attention) and nn.Dropout
        return TinyGPTModule(n_layer=3, dropout=p, lr=LR), token_loader(NUM_BATCHES)
    if model == "batchnorm":
        return BatchNormSequential(), regression_loader(NUM_BATCHES)
    return DropoutSequential(p), regression_loader(NUM_BATCHES)


def fit(strategy: Any, model: str, p: float = 0.3, policy: bool = False, k: int = K, epochs: int = 1) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module, loader = _module(model, p)
    grads = GradRecorder()
    callbacks = [grads, MicrobatchRNG()] if policy else [grads]
    trainer = make_trainer(strategy, k, max_epochs=epochs, callbacks=callbacks)
    trainer.fit(module, loader)
    state = (trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict")
             else trainer.strategy.lightning_module_state_dict())
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
            "state": {n: t.detach().clone() for n, t in state.items()},
            "grads": grads.grads, "rng": torch.get_rng_state()}


def _grads_close(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]], atol: float,
                 steps: int = 3) -> None:
    assert len(a) == len(b) == steps
    for step, (g, r) in enumerate(zip(a, b, strict=True)):
        assert max_abs_diff(g, r) <= atol, step


@pytest.mark.parametrize("model", ["sequential", "gpt"])
def test_dropout_draws_the_same_masks_in_every_order_and_placement(model):
    reference = fit("auto", model, policy=True)
    runs = {name: fit(GreedySnakeStrategy(**settings), model) for name, settings in ORDERS.items()}
    for name, got in runs.items():
        assert max_abs_diff(got["params"], reference["params"]) <= 1e-5, name
        _grads_close(got["grads"], reference["grads"], 1e-5)
    # bit for bit within an order whatever the placement (the orders differ only in summation order)
    for a, b in (("inline", "horizontal_ssd"), ("vertical_ssd", "vertical_device")):
        assert max_abs_diff(runs[a]["params"], runs[b]["params"]) == 0.0, (a, b)
    # the global generator draws only the base seed: the same after any of them as after the reference
    for name, got in runs.items():
        assert torch.equal(got["rng"], reference["rng"]), name
    # and dropout was on: without it, training lands elsewhere
    assert max_abs_diff(fit("auto", model, p=0.0)["params"], reference["params"]) > 1e-3


def test_the_policy_is_not_lightnings_single_stream():
    """What the run's message says: the masks differ from Lightning's default stream (with K > 1: micro-batch 0
    of the first window aside, each micro-batch starts elsewhere)."""
    plain = fit("auto", "sequential")
    assert max_abs_diff(plain["params"], fit("auto", "sequential", policy=True)["params"]) > 1e-3


class MaskRecorder(nn.Module):
    """Dropout (p=0.5) that keeps every mask it draws in a training forward, with the optimizer step its window
    ends in (``step()``: ``trainer.global_step``). A recomputation draws its forward's mask again: a duplicate."""

    def __init__(self, masks: list[tuple[int, tuple[bool, ...]]]) -> None:
        super().__init__()
        self.masks = masks
        self.step: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = torch.rand_like(x) >= 0.5
        self.masks.append((self.step(), tuple(keep.flatten().tolist())))
        return x * keep / 0.5


class RecordingDropout(OptimizerMixin, L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lr = LR
        self.masks: dict[str, list[tuple[int, tuple[bool, ...]]]] = {"first": [], "second": []}
        self.net = nn.Sequential(nn.Linear(6, 16), MaskRecorder(self.masks["first"]), nn.Tanh(), nn.Linear(16, 16),
                                 MaskRecorder(self.masks["second"]), nn.Linear(16, 3))
        for recorder in (self.net[1], self.net[4]):
            recorder.step = lambda: self.trainer.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)


@pytest.mark.parametrize("run", ["lightning", "lightning_with_policy", "vertical_ssd", "inline"])
def test_every_micro_batch_of_every_window_draws_its_own_masks(run):
    """What the policy promises, checked without its seed function (which the reference callback shares, so the
    equivalence tests cannot see a mistake in it): the K micro-batches of a window draw K different masks, as
    under Lightning's single stream, where each continues from the one before; and no window repeats another
    window's masks, over two epochs (each window of epoch 2 its own, not those of the window at its place in
    epoch 1). Two epochs of two windows of K=4 micro-batches, all of one shape: 16 different masks per
    dropout module."""
    L.seed_everything(0, verbose=False)
    module = RecordingDropout()
    strategy = "auto" if run.startswith("lightning") else GreedySnakeStrategy(**ORDERS[run])
    callbacks = [MicrobatchRNG()] if run == "lightning_with_policy" else []
    trainer = make_trainer(strategy, K, max_epochs=2, callbacks=callbacks)
    trainer.fit(module, regression_loader(2 * K))
    assert trainer.global_step == 4
    for name, masks in module.masks.items():
        by_step: dict[int, set[tuple[bool, ...]]] = {}
        for step, mask in masks:
            by_step.setdefault(step, set()).add(mask)
        assert sorted(by_step) == [0, 1, 2, 3], name
        per_window = [len(by_step[s]) for s in range(4)]
        assert per_window == [K] * 4, f"{name}: {per_window} different masks per window, not {K}: micro-batches share"
        total = len(set().union(*by_step.values()))
        assert total == 4 * K, f"{name}: {total} different masks in 4 windows, not {4 * K}: a window repeats another's"


def test_two_epochs_draw_the_masks_of_lightning_with_the_policy():
    """Each window's streams are keyed on the optimizer step (``trainer.global_step``), not on the window's place in
    its epoch: over two epochs (windows of 4, 4, 2 in each) greedysnake equals the reference, gradients included,
    every step."""
    reference = fit("auto", "sequential", policy=True, epochs=2)
    for name in ("vertical_ssd", "planned"):
        got = fit(GreedySnakeStrategy(**ORDERS[name]), "sequential", epochs=2)
        assert max_abs_diff(got["params"], reference["params"]) <= 1e-5, name
        _grads_close(got["grads"], reference["grads"], 1e-5, steps=6)


def test_a_run_that_draws_says_so_once(caplog):
    messages: list[str] = []
    rng = TrainingRng(torch.device("cpu"), messages.append)
    rng.start()
    streams = rng.window(0)
    for m in range(3):
        with streams.forward_of(m):
            pass  # draws nothing
    assert messages == []
    for m in range(3):
        with streams.forward_of(m):
            torch.rand(1)
    assert messages == [TrainingRng.MESSAGE]
    with caplog.at_level(logging.INFO):
        fit(GreedySnakeStrategy(**ORDERS["vertical_ssd"]), "sequential")
    assert sum(TrainingRng.MESSAGE in r.getMessage() for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO):
        fit(GreedySnakeStrategy(**ORDERS["vertical_ssd"]), "sequential", p=0.0)
    assert not any(TrainingRng.MESSAGE in r.getMessage() for r in caplog.records)


def test_a_stream_continues_across_a_micro_batchs_forwards():
    """Unit by unit, in any interleaving of micro-batches, each micro-batch draws what one forward through the
    whole model on its own stream draws."""
    rng = TrainingRng(torch.device("cpu"))
    rng.start()
    whole = rng.window(5)
    expected = {}
    for m in range(3):
        with whole.forward_of(m):
            expected[m] = torch.rand(6)
    pieces = rng.window(5)
    got: dict[int, list[torch.Tensor]] = {m: [] for m in range(3)}
    before = torch.get_rng_state()
    for part in range(3):
        for m in (range(3) if part % 2 else reversed(range(3))):  # the snake's alternating order
            with pieces.forward_of(m):
                got[m].append(torch.rand(2))
    assert torch.equal(torch.get_rng_state(), before)
    for m in range(3):
        assert torch.equal(torch.cat(got[m]), expected[m])
    with rng.window(6).forward_of(0):  # another step: another stream
        assert not torch.equal(torch.rand(6), expected[0])


@pytest.mark.parametrize("order", ["inline", "planned", "horizontal_ssd", "vertical_k1"])
def test_batchnorm_buffers_equal_lightnings(order):
    """Running statistics equal Lightning's: a recomputed forward does not update them a second time
    (num_batches_tracked was 32 against 16), and the micro-batches update them in Lightning's order."""
    k = 1 if order == "vertical_k1" else K
    settings = ORDERS["vertical_ssd"] if order == "vertical_k1" else ORDERS[order]
    reference = fit("auto", "batchnorm", k=k)
    got = fit(GreedySnakeStrategy(**settings), "batchnorm", k=k)
    assert got["buffers"].keys() == reference["buffers"].keys()
    assert all(torch.equal(got["buffers"][n], reference["buffers"][n]) for n in got["buffers"]
               if "num_batches" in n)
    assert max_abs_diff(got["buffers"], reference["buffers"]) <= 1e-6
    assert max_abs_diff(got["params"], reference["params"]) <= 1e-5
    assert max_abs_diff({n: t for n, t in got["state"].items() if "running" in n},
                        {n: t for n, t in reference["state"].items() if "running" in n}) <= 1e-6


@pytest.mark.parametrize("placement", ["ssd", "device"])
def test_batchnorm_in_the_vertical_order_is_refused_before_any_step(placement):
    settings = ORDERS["vertical_ssd" if placement == "ssd" else "vertical_device"]
    L.seed_everything(0, verbose=False)
    module, loader = _module("batchnorm")
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = make_trainer(GreedySnakeStrategy(**settings), K, max_epochs=1)
    with pytest.raises(ValueError) as err:
        trainer.fit(module, loader)
    message = str(err.value)
    # (block 1's BatchNorm sits in a unit the snake runs 0, 1, 2, 3: followed; block 4's runs 3, 2, 1, 0)
    assert "schedule='vertical'" in message and "block 4 (BatchNorm1d) running_mean" in message
    assert "Fix:" in message and "schedule='horizontal'" in message and "track_running_stats=False" in message
    assert trainer.global_step == 0
    assert max_abs_diff({n: p.detach() for n, p in module.named_parameters()}, before) == 0.0
