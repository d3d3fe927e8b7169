"""The per-unit optimizer in the background (``lag``) with part of each update deferred into the next
forward (``alpha``): results equal Lightning's default strategy, and no forward reads a stale weight."""

from __future__ import annotations

import functools
import time
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_greedysnake import GreedySnakeStrategy, OffloadConfig
from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.io import ThreadedIOEngine
from lightning_greedysnake.offload.regions import FILE_NAMES
from lightning_greedysnake.offload.tiers import SSDRegions
from tests.helpers import RecordingLogger, TinyGPTModule, make_trainer, max_abs_diff, token_loader

LR = 3e-3
ON_DEVICE = OffloadConfig.everywhere("device")
GRADIENTS_FILE = FILE_NAMES[TensorKind.GRADIENTS]


def _fit(strategy: Any, clip: bool, module_factory: Any = None, loader: Any = None, k: int = 3,
         epochs: int = 2) -> tuple[dict[str, torch.Tensor], RecordingLogger]:
    L.seed_everything(0, verbose=False)
    module = module_factory() if module_factory else TinyGPTModule(n_layer=3, lr=LR)
    logger = RecordingLogger()
    kwargs = {"gradient_clip_val": 0.05} if clip else {}
    trainer = make_trainer(strategy, k, logger=logger, max_epochs=epochs, **kwargs)
    trainer.fit(module, loader if loader is not None else token_loader(10))
    assert trainer.global_step >= 4
    return {n: p.detach().clone() for n, p in module.named_parameters()}, logger


@functools.lru_cache(maxsize=None)
def lightning_reference(clip: bool) -> dict[str, torch.Tensor]:
    return _fit("auto", clip)[0]


@functools.lru_cache(maxsize=None)
def resident_reference(clip: bool) -> dict[str, torch.Tensor]:
    return _fit(GreedySnakeStrategy(auto=False, offload=ON_DEVICE), clip)[0]


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip-norm"])
@pytest.mark.parametrize("lag", [0, 2])
@pytest.mark.parametrize("alpha", [0.0, 0.25, 1.0])
def test_matches_lightning_for_every_alpha_and_lag(alpha, lag, clip):
    got, _ = _fit(GreedySnakeStrategy(auto=False, alpha=alpha, lag=lag), clip)
    assert max_abs_diff(got, lightning_reference(clip)) <= 1e-5
    # and bit for bit what the same schedule gives with every tensor resident
    assert max_abs_diff(got, resident_reference(clip)) == 0


@pytest.mark.parametrize("placement", ["ssd", "host"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_overlap_is_exact_on_every_tier_and_precision(placement, precision):
    offload = OffloadConfig.everywhere("host") if placement == "host" else None

    def fit(strategy: Any) -> dict[str, torch.Tensor]:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(n_layer=3, lr=LR)
        make_trainer(strategy, 3, max_epochs=1, precision=precision).fit(module, token_loader(12))
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    synchronous = fit(GreedySnakeStrategy(auto=False, alpha=0.0, lag=0, offload=offload))
    overlapped = fit(GreedySnakeStrategy(auto=False, alpha=0.5, lag=2, offload=offload))
    assert max_abs_diff(synchronous, overlapped) == 0


class WideEmbedding(L.LightningModule):
    """Unit 0 is a big embedding table: its optimizer step (12.8M elements of fp32 state from SSD) takes
    far longer than its forward (a gather of a few rows), so a forward that did not wait for its unit's
    update would read the previous step's weights; the large learning rate makes that visible."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(200_000, 64), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1).mean(-1), y)
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.1)


def _wide_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50, (16, 4), generator=g)  # a few hot rows, so every step moves them
    y = torch.randn(16, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=2)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_no_forward_reads_a_stale_or_half_updated_unit(alpha):
    ref, ref_log = _fit(GreedySnakeStrategy(auto=False, offload=ON_DEVICE), False, WideEmbedding, _wide_loader(), k=2, epochs=1)
    got, got_log = _fit(GreedySnakeStrategy(auto=False, alpha=alpha, lag=2), False, WideEmbedding, _wide_loader(), k=2,
                        epochs=1)
    assert got_log.series("train_loss") == ref_log.series("train_loss") != []
    assert max_abs_diff(got, ref) == 0
    # the guard itself: every step moves the hot rows by about the learning rate, so a forward that
    # read the previous step's rows would compute a visibly different loss
    L.seed_everything(0, verbose=False)
    initial = WideEmbedding().net[0].weight[:50].detach()
    assert (ref["net.0.weight"][:50] - initial).abs().mean() > 0.1


def test_a_failed_background_step_surfaces_in_the_training_thread(tmp_path):
    """An optimizer-state file truncated under the run: the background read fails; training stops with
    that error (named file and offset) instead of hanging or training on."""
    import os

    from lightning_greedysnake.io import ShortReadError
    from lightning_greedysnake.optim import OptimizerLaneError

    class Truncate(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            if trainer.global_step == 1:
                trainer.strategy.tensor_manager.drain()
                os.truncate(trainer.strategy.tensor_manager.offload_dirs[0] / "optimizer_states.bin", 0)

    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False, offload_dir=tmp_path, lag=2), 2, max_epochs=1, callbacks=[Truncate()])
    with pytest.raises(OptimizerLaneError) as info:
        trainer.fit(TinyGPTModule(lr=LR), token_loader(8))
    assert isinstance(info.value.__cause__, ShortReadError)
    assert "optimizer_states.bin" in str(info.value)
    import threading

    assert not [t for t in threading.enumerate() if t.name.startswith("greedysnake")]


@pytest.mark.parametrize("settings,words", [
    ({"alpha": 1.5}, ["alpha=1.5", "Fix"]),
    ({"alpha": "x"}, ["alpha='x'"]),
    ({"lag": -1}, ["lag=-1", "Fix"]),
    ({"lag": 1.5}, ["lag=1.5"]),
])
def test_bad_alpha_and_lag(settings, words):
    with pytest.raises(ValueError) as info:
        GreedySnakeStrategy(auto=False, **settings)
    for w in words:
        assert w in str(info.value)


def test_step_telemetry_accounts_for_every_step_and_byte():
    strategy = GreedySnakeStrategy(auto=False, alpha=0.25, lag=2)
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(strategy, 2, max_epochs=1)
    trainer.fit(TinyGPTModule(lr=LR), token_loader(8))
    history = strategy.step_telemetry
    assert [e.step for e in history] == [1, 2, 3, 4] == list(range(1, trainer.global_step + 1))
    for e in history:
        for lane in (e.ssd_read_busy_s, e.ssd_write_busy_s, e.optimizer_busy_s):
            assert 0 <= lane <= e.wall_s  # busy intervals are merged and clipped to the step
        assert 0 <= e.io_wait_s and 0 <= e.optimizer_unhidden_s and e.compute_s <= e.wall_s
        metrics = e.as_metrics()
        assert metrics["read_bytes/weights"] > 0 and "optimizer_unhidden_s" in metrics
    # every step after the first reads each unit's weights the same number of times
    assert len({e.bytes_read["weights"] for e in history[1:]}) == 1


def test_synchronous_steps_count_as_unhidden_optimizer_time():
    strategy = GreedySnakeStrategy(auto=False, alpha=0.0, lag=0)
    L.seed_everything(0, verbose=False)
    make_trainer(strategy, 2, max_epochs=1).fit(TinyGPTModule(lr=LR), token_loader(4))
    for e in strategy.step_telemetry:
        # the training thread runs each step itself: the lane's busy time is all unhidden (same clock)
        assert e.optimizer_unhidden_s > 0 and e.optimizer_unhidden_s >= e.optimizer_busy_s - 1e-3


class CustomClipping(TinyGPTModule):
    """Clips by norm itself, through Lightning's own API (no Trainer flag)."""

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


def test_a_configure_gradient_clipping_override_through_clip_gradients_is_honoured():
    def fit(strategy: Any) -> dict[str, torch.Tensor]:
        L.seed_everything(0, verbose=False)
        module = CustomClipping(n_layer=3, lr=LR)
        make_trainer(strategy, 3, max_epochs=2).fit(module, token_loader(10))
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    ref = fit("auto")
    with pytest.warns(UserWarning, match="configure_gradient_clipping.*param.grad is not populated"):
        got = fit(GreedySnakeStrategy(auto=False))
    assert max_abs_diff(got, ref) <= 1e-5
    assert max_abs_diff(ref, lightning_reference(False)) > 1e-4  # the clipping was active


def test_step_telemetry_reaches_the_trainers_loggers(tmp_path):
    import csv

    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=1, logger=CSVLogger(tmp_path, name="logs"),
                           log_every_n_steps=1)
    trainer.fit(TinyGPTModule(lr=LR), token_loader(8))
    (path,) = list((tmp_path / "logs").rglob("metrics.csv"))
    rows = list(csv.DictReader(path.open()))
    logged = [r for r in rows if r.get("greedysnake/optimizer_unhidden_s")]
    assert len(logged) == trainer.global_step == 4
    assert all(float(r["greedysnake/read_bytes/weights"]) > 0 for r in logged)
    assert {"greedysnake/ssd_read_busy_s", "greedysnake/compute_s", "train_loss_step"} <= set(rows[0])


def test_the_automatic_budget_reads_the_last_step_ahead_from_what_the_minimum_reserves():
    """Unit 0 here is a 12.8M-element embedding: its state (100 MB) is far beyond a budget with one
    working set's slack (one unit's weights and 16 MiB: 280 MB against a 205 MB minimum; the automatic
    budget holds a second working set, which would pay for it), so the slack cannot pay for its
    read-ahead. But when unit 0's backward starts, every other step has run (synchronous steps here),
    and the staging the minimum budget reserves for them is free: the window's last step reads ahead
    from that, every step after the first (which has no state yet), and the result is exact."""
    seen = {}

    class Count(L.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            manager = trainer.strategy.tensor_manager
            seen.update(ahead=manager.stepper.parts.read_ahead_by_unit.get(0, 0), steps=trainer.global_step,
                        slack=manager.pool.budget_bytes - manager.arena.budget.minimum_bytes,
                        state=manager.region_bytes(TensorKind.OPTIMIZER_STATES, 0))

    ref, _ = _fit(GreedySnakeStrategy(auto=False, offload=ON_DEVICE), False, WideEmbedding, _wide_loader(), k=2, epochs=1)
    L.seed_everything(0, verbose=False)
    module = WideEmbedding()
    make_trainer(GreedySnakeStrategy(auto=False, alpha=0.0, lag=0, offload={"buffer_budget_bytes": 280_000_000}), 2,
                 max_epochs=1, callbacks=[Count()]).fit(
        module, _wide_loader())
    assert seen["state"] > seen["slack"]
    assert seen["ahead"] == seen["steps"] - 1 >= 3
    assert max_abs_diff({n: p.detach() for n, p in module.named_parameters()}, ref) == 0


class StepsDoneAtBackward(L.Callback):
    """Per window: how many of its unit steps had run by its last backward, and by its end."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.before = 0
        self.at_backward: list[int] = []
        self.at_end: list[int] = []

    @staticmethod
    def _done(trainer: L.Trainer) -> int:
        return sum(trainer.strategy.tensor_manager.stepper.steps_completed)

    def _last_microbatch(self, trainer: L.Trainer) -> bool:
        return (trainer.fit_loop.epoch_loop.batch_idx + 1) % self.k == 0

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self._last_microbatch(trainer):
            self.at_backward.append(self._done(trainer) - self.before)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._last_microbatch(trainer):
            self.at_end.append(self._done(trainer) - self.before)
            self.before = self._done(trainer)


@pytest.mark.parametrize(("placement", "schedule", "held"), [
    ("host", "vertical", True), ("host", "horizontal", True), ("ssd", "vertical", False),
    ("state-on-ssd", "vertical", False),
])
def test_a_synchronous_step_in_host_memory_runs_once_the_backward_is_done(placement, schedule, held):
    """``lag=0``: a unit's step that stages nothing (all in RAM) waits for the end of the window's
    backward, Lightning's order (its temporaries then reuse what the backward freed); one that holds
    staging buffers (state on SSD) runs at once, so they come back. Both exact."""
    offload = {"host": OffloadConfig.everywhere("host"), "ssd": None,
               "state-on-ssd": OffloadConfig.everywhere("host", optimizer_states="ssd")}[placement]
    watch = StepsDoneAtBackward(k=3)
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=3, lr=LR)
    make_trainer(GreedySnakeStrategy(auto=False, alpha=0.0, lag=0, schedule=schedule, offload=offload), 3,
                 max_epochs=1, callbacks=[watch]).fit(module, token_loader(12))
    units = len(watch.at_end) and watch.at_end[0]
    assert units > 0 and watch.at_end == [units] * 4
    assert watch.at_backward == ([0] * 4 if held else [units] * 4)
    L.seed_everything(0, verbose=False)
    reference = TinyGPTModule(n_layer=3, lr=LR)
    make_trainer("auto", 3, max_epochs=1).fit(reference, token_loader(12))
    got = {n: p.detach() for n, p in module.named_parameters()}
    assert max_abs_diff(got, {n: p.detach() for n, p in reference.named_parameters()}) <= 1e-5


@pytest.mark.parametrize("lag", [0, 2])
def test_a_deferred_part_waits_for_its_gradients_read(monkeypatch, lag):
    """A deferred (alpha) part reads its gradient range from the gradients file, issued with its own reads: it
    must wait for that read. Here each read of the gradients file fills its bytes of the buffer with NaN when it
    is submitted (until a read lands, what the buffer holds is undefined: a stale gradient as a rule) and lands
    late, its request held on the real I/O thread; so a part that steps without waiting computes with NaN, every
    time, and one that waits equals Lightning."""
    submit_read = SSDRegions.submit_read
    read_piece = ThreadedIOEngine._read_piece
    delayed: list[int] = []

    def poisoned(self, unit, buf, label=None, byte_range=None):  # type: ignore[no-untyped-def]
        if self.path.name == GRADIENTS_FILE:
            lo, hi = byte_range if byte_range is not None else (0, self.layout.sizes[unit])
            buf.tensor[lo:hi].fill_(0xFF)  # NaN in fp32
        return submit_read(self, unit, buf, label, byte_range)

    def late(self, file, offset, buffer, buffer_offset, nbytes):  # type: ignore[no-untyped-def]
        if file.path.name == GRADIENTS_FILE:
            time.sleep(0.1)
            delayed.append(nbytes)
        return read_piece(self, file, offset, buffer, buffer_offset, nbytes)

    monkeypatch.setattr(SSDRegions, "submit_read", poisoned)
    monkeypatch.setattr(ThreadedIOEngine, "_read_piece", late)
    got, _ = _fit(GreedySnakeStrategy(auto=False, alpha=0.5, lag=lag), False)
    assert delayed, "no read of the gradients file: the test delays nothing"
    assert max_abs_diff(got, lightning_reference(False)) <= 1e-5
