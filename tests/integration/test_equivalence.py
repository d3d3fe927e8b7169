"""greedysnake against Lightning's default strategy: same optimizer, same accumulate_grad_batches.

The tolerance: summation order of a unit's gradient differs only by micro-batch order (the snake runs
some units K-1..0), and Adam turns those last-bit differences into parameter differences of order
lr * 1e-3; the learning rate is chosen so that a real mistake (a missing or doubled micro-batch, a stale
weight) moves parameters by about lr per step, orders of magnitude above the tolerance.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from tests.helpers import (
    RecordingLogger,
    SequentialModule,
    TinyGPTModule,
    UnitGradients,
    assert_series_close,
    make_trainer,
    max_abs_diff,
    regression_loader,
    token_loader,
)

ON_DEVICE = OffloadConfig.everywhere("device")
"""Everything resident: Lightning steps the user's optimizer and param.grad is populated."""
NUM_BATCHES = 10  # K=3 -> windows 3,3,3,1; K=4 -> 4,4,2: the epoch's last window is partial
LR = 3e-3


class GradRecorder(UnitGradients):
    """Gradients as the optimizer sees them (after the whole window's backward, before clipping): from
    ``param.grad`` where Lightning steps resident parameters, else from the tensor manager's stepper."""

    def __init__(self) -> None:
        super().__init__()
        self._resident: list[dict[str, torch.Tensor]] = []
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self._resident.append({n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None})
        self.lrs.append(optimizer.param_groups[0]["lr"])

    @property
    def grads(self) -> list[dict[str, torch.Tensor]]:
        """Per optimizer step, every parameter's gradient."""
        return self.windows() if self.per_name else self._resident


def _make(model: str, **overrides: Any) -> tuple[L.LightningModule, Any]:
    if model == "gpt":
        return TinyGPTModule(n_layer=3, lr=LR, **overrides), token_loader(NUM_BATCHES)
    return SequentialModule(lr=LR, **overrides), regression_loader(NUM_BATCHES)


def run(strategy: Any, model: str, k: int, trainer_kwargs: dict | None = None, callbacks: tuple = (),
        **overrides: Any) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module, loader = _make(model, **overrides)
    logger, grads = RecordingLogger(), GradRecorder()
    trainer = make_trainer(strategy, k, logger=logger, callbacks=[grads, *callbacks], **(trainer_kwargs or {}))
    trainer.fit(module, loader)
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "logger": logger,
        "grads": grads,
        "global_step": trainer.global_step,
        "state_dict": (trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict")
                       else trainer.strategy.lightning_module_state_dict()),
    }


@functools.lru_cache(maxsize=None)
def reference(model: str, k: int) -> dict[str, Any]:
    return run("auto", model, k)


def assert_matches(got: dict[str, Any], ref: dict[str, Any], atol: float = 1e-5) -> None:
    assert got["global_step"] == ref["global_step"]
    assert max_abs_diff(got["params"], ref["params"]) <= atol
    for key in ("train_loss_step", "train_loss_epoch"):
        assert_series_close(got["logger"].series(key), ref["logger"].series(key), atol)
    # every window's gradients (param.grad with everything on the device; the tensor manager's own
    # accumulators with offloading), the first before any optimizer step amplifies rounding
    got_grads, ref_grads = got["grads"].grads, ref["grads"].grads
    assert len(got_grads) == len(ref_grads) == got["global_step"]
    for step, (g, r) in enumerate(zip(got_grads, ref_grads, strict=True)):
        assert g.keys() == r.keys(), step
        assert max_abs_diff(g, r) <= (1e-6 if step == 0 else atol), step
    assert got["grads"].lrs == ref["grads"].lrs


@pytest.mark.parametrize("placement", ["ssd", "device"])
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("layers_per_unit", [1, 2])
@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("model", ["gpt", "sequential"])
def test_matches_lightning_default(model, k, layers_per_unit, schedule, placement):
    ref = reference(model, k)
    offload = ON_DEVICE if placement == "device" else None
    got = run(GreedySnakeStrategy(auto=False, schedule=schedule, layers_per_unit=layers_per_unit, offload=offload), model, k)
    assert_matches(got, ref)
    if placement == "device":
        assert got["grads"].grads[0], "param.grad must be visible with everything on the device"
    # the strategy's state dict (what checkpoints store) is the trained model
    assert max_abs_diff({k_: v for k_, v in got["state_dict"].items() if k_ in got["params"]}, got["params"]) == 0


PLACEMENTS = {
    "ssd": None,  # the default: weights, optimizer state and waiting gradients on SSD, checkpoints in RAM
    "ssd-everything": OffloadConfig.everywhere("ssd"),
    "host": OffloadConfig.everywhere("host"),
    "ssd-weights-host-state": {"optimizer_states": "host", "gradients": "host"},
    # split between RAM and SSD by units, two units' weights prefetched ahead
    "split-prefetch-2": {"weights": {"host": 0.5, "ssd": 0.5}, "optimizer_states": {"host": 0.5, "ssd": 0.5},
                         "gradients": {"host": 0.5, "ssd": 0.5}, "prefetch_units": 2},
    # the defaults (auto=True) under a host budget of 1 MiB of staging and room for three 4 KiB regions:
    # the planner splits the kinds between RAM and SSD, and plans alpha, lag and recompute after step 1
    "planned": {"buffer_budget_bytes": 1 << 20},
}
PLANNED_BUDGET = ((1 << 20) + 3 * 4096) * 8 // 7 + 8
CLIPPING = {
    "none": {},
    "norm": {"gradient_clip_val": 0.05},
    "value": {"gradient_clip_val": 0.001, "gradient_clip_algorithm": "value"},
}


@functools.lru_cache(maxsize=None)
def on_device(model: str, schedule: str, clipping: str) -> dict[str, Any]:
    return run(GreedySnakeStrategy(auto=False, schedule=schedule, offload=ON_DEVICE), model, 3,
               trainer_kwargs=CLIPPING[clipping])


@pytest.mark.parametrize("clipping", list(CLIPPING))
@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("model", ["gpt", "sequential"])
def test_offloaded_equals_in_memory_exactly(model, schedule, placement, clipping):
    """The tensor manager steps the user's optimizer class unit by unit over streamed state: bit for bit
    what Lightning's step on resident parameters gives, for every placement and clipping mode."""
    ref = on_device(model, schedule, clipping)
    # (one block per unit, as the in-memory run: the planned unit size is tested in test_unit_plan.py)
    planned = ({"auto_host_budget_bytes": PLANNED_BUDGET, "layers_per_unit": 1} if placement == "planned"
               else {"auto": False})
    strategy = GreedySnakeStrategy(schedule=schedule, offload=PLACEMENTS[placement], **planned)
    got = run(strategy, model, 3, trainer_kwargs=CLIPPING[clipping])
    if placement == "planned":
        kinds = strategy.placement_plan.kinds.values()
        assert any(k.host_units for k in kinds) and any(k.host_units < k.num_units for k in kinds)
    assert got["global_step"] == ref["global_step"]
    assert max_abs_diff(got["params"], ref["params"]) == 0
    for g, r in zip(got["grads"].grads, ref["grads"].grads, strict=True):  # the gradients, bit for bit
        assert g.keys() == r.keys() and max_abs_diff(g, r) == 0
    assert_series_close(got["logger"].series("train_loss_step"), ref["logger"].series("train_loss_step"), 0.0)


def test_reference_run_really_trains():
    """Guards the comparison itself: parameters move by far more than the tolerance."""
    L.seed_everything(0, verbose=False)
    initial = {n: p.detach().clone() for n, p in _make("gpt")[0].named_parameters()}
    assert max_abs_diff(initial, reference("gpt", 3)["params"]) > 100 * 1e-5


@pytest.mark.parametrize("strategy_name", ["greedysnake", "greedysnake_horizontal"])
def test_by_name(strategy_name):
    got = run(strategy_name, "gpt", 3)
    assert_matches(got, reference("gpt", 3))


@pytest.mark.parametrize(
    "overrides",
    [
        {"optimizer_name": "adam"},
        {"optimizer_name": "sgd"},
        {"scheduler_interval": "epoch"},
    ],
    ids=["adam", "sgd-momentum", "epoch-scheduler"],
)
def test_optimizers_and_schedulers(overrides):
    ref = run("auto", "gpt", 3, **overrides)
    got = run(GreedySnakeStrategy(auto=False), "gpt", 3, **overrides)
    assert_matches(got, ref)


@pytest.mark.parametrize("algorithm,value", [("norm", 0.05), ("value", 0.001)])
def test_gradient_clipping(algorithm, value):
    trainer_kwargs = {"gradient_clip_val": value, "gradient_clip_algorithm": algorithm}
    ref = run("auto", "gpt", 4, trainer_kwargs=trainer_kwargs)
    got = run(GreedySnakeStrategy(auto=False), "gpt", 4, trainer_kwargs=trainer_kwargs)
    assert_matches(got, ref)
    unclipped = reference("gpt", 4)
    assert max_abs_diff(ref["params"], unclipped["params"]) > 1e-4  # clipping was active


def test_max_steps_and_limit_train_batches():
    trainer_kwargs = {"max_steps": 3, "limit_train_batches": 7, "max_epochs": -1}
    ref = run("auto", "gpt", 3, trainer_kwargs=trainer_kwargs)
    got = run(GreedySnakeStrategy(auto=False), "gpt", 3, trainer_kwargs=trainer_kwargs)
    assert got["global_step"] == 3
    assert_matches(got, ref)


def test_validation_runs_layer_by_layer_and_matches():
    def with_val(strategy: Any) -> RecordingLogger:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(lr=LR)
        logger = RecordingLogger()
        trainer = make_trainer(strategy, 3, logger=logger, val_check_interval=5)
        trainer.fit(module, token_loader(NUM_BATCHES), token_loader(3, seed=1))
        return logger

    ref, got = with_val("auto"), with_val(GreedySnakeStrategy(auto=False))
    assert len(ref.series("val_loss")) == 4  # mid-window validation included (after batch 5 of windows of 3)
    assert_series_close(got.series("val_loss"), ref.series("val_loss"), 1e-5)


def test_validate_test_predict_without_fit():
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule()
    loader = token_loader(2)
    x = next(iter(loader))[0]
    expected = module.model(x).detach()
    trainer = make_trainer(GreedySnakeStrategy(auto=False, layers_per_unit=2), 1)
    module.predict_step = lambda batch, batch_idx: module.model(batch[0])  # type: ignore[method-assign]
    predictions = trainer.predict(module, loader)
    torch.testing.assert_close(predictions[0], expected, rtol=0, atol=0)
    assert trainer.validate(module, loader, verbose=False)[0]["val_loss"] > 0


class WeightLoads(L.Callback):
    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.loads = dict(trainer.strategy.store.weights.weight_loads)
        self.steps = trainer.global_step


@pytest.mark.parametrize("k", [1, 4])
def test_weight_loads_per_window(k):
    """Vertical brings each unit's weights in twice per window (once for the fused last unit) whatever K
    is; horizontal 2K times."""
    loads = {}
    for schedule in ("vertical", "horizontal"):
        L.seed_everything(0, verbose=False)
        counter = WeightLoads()
        trainer = make_trainer(GreedySnakeStrategy(auto=False, schedule=schedule), k, callbacks=[counter], max_epochs=1)
        trainer.fit(TinyGPTModule(n_layer=3, lr=LR), token_loader(4 * k))
        assert counter.steps == 4
        loads[schedule] = {u: n / counter.steps for u, n in counter.loads.items()}
    assert loads["vertical"] == {0: 2, 1: 2, 2: 1}
    assert loads["horizontal"][2] == k and loads["horizontal"][1] == 2 * k


class GatedBlock(L.Callback):
    """Block 1 gets an extra parameter that its output uses only in even optimizer steps: in the odd ones
    it has no gradient (``param.grad`` stays None under Lightning; torch's optimizers skip it)."""

    def __init__(self, module: L.LightningModule) -> None:
        block = module.model.blocks[1]
        block.gate = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 16))
        self.on = True
        block.register_forward_hook(lambda m, args, out: out + m.gate if self.on else out)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.on = trainer.global_step % 2 == 0


@pytest.mark.parametrize("clipping", ["none", "norm"])
@pytest.mark.parametrize("placement", ["host", "ssd"])
def test_a_parameter_without_a_gradient_in_some_windows(placement, clipping):
    """An accumulator is not zeroed when it starts (each parameter's first gradient is copied in): where
    no gradient came (here a whole parameter, every other window, after a window where one did) it must
    still read as zero to everything that reads it whole (the norm, the gradient hook), and the step must
    skip that parameter as torch does."""

    def gated(strategy: Any) -> dict[str, Any]:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(n_layer=3, lr=LR)
        grads = GradRecorder()
        trainer = make_trainer(strategy, 3, callbacks=[GatedBlock(module), grads], **CLIPPING[clipping])
        trainer.fit(module, token_loader(NUM_BATCHES))
        return {"params": {n: p.detach().clone() for n, p in module.named_parameters()}, "grads": grads.grads}

    ref = gated("auto")
    got = gated(GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere(placement)))
    assert max_abs_diff(got["params"], ref["params"]) <= 1e-5
    gate = "model.blocks.1.gate"
    assert [gate in r for r in ref["grads"]] == [s % 2 == 0 for s in range(len(ref["grads"]))]
    assert len(got["grads"]) == len(ref["grads"]) >= 4
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        assert max_abs_diff({n: g[n] for n in r}, r) <= (1e-6 if step == 0 else 1e-5), step
        if gate not in r:
            assert torch.count_nonzero(g[gate]) == 0, (step, g[gate])
