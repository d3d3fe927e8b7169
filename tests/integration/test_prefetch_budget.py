"""The automatic staging budget holds room for every prefetch ``offload.prefetch_units`` asks for (the one
staging rule, :mod:`lightning_greedysnake.planner.staging`), and training stays exact against Lightning.

The units here are larger than the automatic budget's fixed 16 MiB of slack (a block of this GPT holds
about 19.7 MB of fp32 weights), so a budget that held room for fewer prefetches than asked refuses some:
only speed would change, so the refusals are counted."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GPT, GPTConfig, GreedySnakeStrategy
from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.io.engine import ThreadedIOEngine
from lightning_greedysnake.tensor_manager import TieredTensorStore
from tests.helpers import TinyGPTModule, UnitGradients, make_trainer, max_abs_diff, token_loader

K = 2
STEPS = 3


class Refusals(L.Callback):
    """The tensor manager's refused weights prefetches and its units on SSD, at the end of training."""

    def on_train_end(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        assert isinstance(manager, TieredTensorStore)
        manager.drain()
        self.refused = manager.weights.prefetches_refused
        self.weights_on_ssd = sum(manager.on_ssd(TensorKind.WEIGHTS, u) for u in range(manager.num_units))
        self.budget = manager.pool.budget_bytes
        self.prefetch_units = manager.config.prefetch_units


def _module() -> TinyGPTModule:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(lr=1e-3)
    module.model = GPT(GPTConfig(n_layer=6, n_head=2, n_embd=640, vocab_size=32, block_size=8))
    return module


def _fit(strategy: Any, callbacks: list) -> dict[str, torch.Tensor]:
    module = _module()
    trainer = make_trainer(strategy, K, callbacks=callbacks, max_epochs=1)
    trainer.fit(module, token_loader(STEPS * K))
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    module = _module()
    per_step: list[dict[str, torch.Tensor]] = []

    class Grads(L.Callback):
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            per_step.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})

    trainer = make_trainer("auto", K, callbacks=[Grads()], max_epochs=1)
    trainer.fit(module, token_loader(STEPS * K))
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}, per_step


@pytest.mark.parametrize("prefetch_units,auto", [(2, False), (3, False), (2, True)])
def test_the_automatic_budget_never_refuses_a_promised_prefetch_and_training_is_exact(prefetch_units, auto, reference):
    """``auto=False``: every kind on SSD; ``auto=True``: a host budget too small for the state, so the
    planner puts units' weights on SSD. Either way the automatic budget (``buffer_budget_bytes`` unset)
    holds ``prefetch_units`` prefetches: none is refused; weights and every window's gradients match
    Lightning's to 1e-5."""
    weights_ref, grads_ref = reference
    refusals, grads = Refusals(), UnitGradients()
    settings: dict[str, Any] = {"offload": {"prefetch_units": prefetch_units}}
    if auto:
        settings["auto_host_budget_bytes"] = 280 << 20
    weights = _fit(GreedySnakeStrategy(auto=auto, alpha=0.0, **settings), [refusals, grads])
    assert refusals.prefetch_units == prefetch_units
    assert refusals.weights_on_ssd >= prefetch_units  # (the prefetches have units to read)
    assert refusals.refused == 0, (refusals.refused, refusals.budget)
    assert max_abs_diff(weights, weights_ref) < 1e-5
    windows = grads.windows()
    assert len(windows) == STEPS
    for got, want in zip(windows, grads_ref, strict=True):
        assert max_abs_diff(got, {n: want[n] for n in got}) < 1e-5


def test_a_slow_disk_write_does_not_refuse_a_promised_prefetch(monkeypatch, reference):
    """A step's buffers stay in use until their write-behind lands, so for a moment the must-run work
    holds more than the staging rule's minimum. A prefetch the slack allows waits for those writes
    rather than being refused by their timing; here every write is slowed, as a busy disk slows it."""
    write = ThreadedIOEngine._write_piece

    def slow_write(self: ThreadedIOEngine, *args: Any) -> None:
        time.sleep(0.2)
        write(self, *args)

    monkeypatch.setattr(ThreadedIOEngine, "_write_piece", slow_write)
    weights_ref, _ = reference
    refusals = Refusals()
    weights = _fit(GreedySnakeStrategy(auto=False, alpha=0.0, offload={"prefetch_units": 2}), [refusals])
    assert refusals.weights_on_ssd >= 2
    assert refusals.refused == 0, (refusals.refused, refusals.budget)
    assert max_abs_diff(weights, weights_ref) < 1e-5
