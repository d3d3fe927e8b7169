"""Every Lightning internal the strategy relies on (``strategy/lightning_api.py``, and the protected
``Strategy`` members a subclass sets), exercised against the installed Lightning: an upgrade that moves
or changes one fails here, by name."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, Strategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.strategy.lightning_api import last_checkpoint_candidates, redirect_checkpoint_load
from tests.helpers import SequentialModule, make_trainer


def test_in_one_process_the_strategy_is_ddp_without_its_wrapper_launcher_or_sampler():
    """Built on DDPStrategy: in one process, no launcher, no process group, no DistributedDataParallel
    wrapper, and a shuffled dataloader keeps its RandomSampler (Lightning would put in a DistributedSampler
    for any DDPStrategy: the switch ``keep_dataloader_samplers`` sets is the one Lightning reads)."""
    assert Trainer(accelerator="cpu", logger=False)._accelerator_connector.use_distributed_sampler is True
    assert "_setup_model" in vars(Strategy) and "setup_distributed" in vars(DDPStrategy)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g))
    module = SequentialModule()
    trainer = make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=1)
    trainer.fit(module, DataLoader(data, batch_size=4, shuffle=True))
    assert trainer.strategy.launcher is None and not torch.distributed.is_initialized()
    assert trainer.strategy.model is module
    assert type(trainer.train_dataloader.sampler) is RandomSampler
    # the ddp names stay DDP's
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy
    assert StrategyRegistry["greedysnake"]["strategy"] is GreedySnakeStrategy


def test_setup_places_the_model_and_lightnings_model_to_device_leaves_it():
    """Lightning's setup moves the model in ``model_to_device``; greedysnake's setup has placed it before
    (all of it but the units the tensor manager keeps in its tiers), so its ``model_to_device`` moves
    nothing (a meta device shows what would have moved)."""
    import inspect

    from lightning_greedysnake.strategy.manager_setup import move_all_but_units

    assert "self.model_to_device()" in inspect.getsource(Strategy.setup)
    module = SequentialModule()
    move_all_but_units(module, [module.net[0]], torch.device("meta"))  # (net[0] stands for a unit)
    assert not any(p.is_meta for p in module.net[0].parameters())
    assert all(p.is_meta for p in module.net[2].parameters()) and module.device.type == "meta"
    strategy = GreedySnakeStrategy(auto=False)
    strategy.parallel_devices = [torch.device("meta")]  # (as Lightning's accelerator connector fills it)
    strategy.model = placed = SequentialModule()
    strategy.model_to_device()
    assert not any(p.is_meta for p in placed.parameters())


def test_the_protected_strategy_members_are_what_lightning_reads():
    strategy = GreedySnakeStrategy(auto=False)
    strategy._launcher = "marker"  # what _configure_launcher sets
    assert Strategy.launcher.fget(strategy) == "marker"  # type: ignore[attr-defined]
    plugin = Precision()
    strategy.precision_plugin = plugin  # translated into greedysnake's own plugin
    assert strategy._precision_plugin is strategy.precision_plugin
    assert "_wrap_closure" not in vars(type(strategy.precision_plugin))  # the public optimizer_step is used


class _DoublingData(L.LightningDataModule):
    """Doubles every input in ``on_before_batch_transfer``: the hook the look-ahead must run too."""

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)),
                          batch_size=4)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return 2 * x, y


class _Recording(SequentialModule):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, float]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        # the batch index the strategy took from the public on_train_batch_start hook, Lightning's own,
        # and the sum of the (doubled) inputs this step computed on
        self.seen.append((self.trainer.strategy._batch_idx, self.trainer.fit_loop.epoch_loop.batch_idx,
                          float(x.sum())))
        return loss


def test_read_ahead_batches_get_the_datamodules_hook_and_batch_indices_match_lightnings():
    module = _Recording()
    make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=1).fit(module, datamodule=_DoublingData())
    expected = [float(2 * x.sum()) for x, _ in _DoublingData().train_dataloader()]
    assert [s for _, _, s in module.seen] == expected
    assert all(ours == lightnings for ours, lightnings, _ in module.seen)
    assert [i for i, _, _ in module.seen] == [0, 1, 2, 3]


def test_the_last_checkpoint_candidates_and_the_loaded_path_are_lightnings(tmp_path):
    """What ``last_checkpoint_candidates`` lists is what Lightning's own ``ckpt_path="last"`` chooses from, and
    the path ``redirect_checkpoint_load`` changes is what ``trainer.ckpt_path`` reads."""
    for name in ("last.ckpt", "last-v1.ckpt", "epoch=0-step=2.ckpt"):
        (tmp_path / name).write_bytes(b"")
    os.utime(tmp_path / "last.ckpt", (1e9, 1e9))  # last-v1.ckpt the newest
    on_exception = OnExceptionCheckpoint(dirpath=tmp_path / "exception")
    trainer = Trainer(accelerator="cpu", logger=False, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True),
                                                                  on_exception])
    assert last_checkpoint_candidates(trainer) == {str(tmp_path / "last.ckpt"), str(tmp_path / "last-v1.ckpt"),
                                                   str(on_exception.ckpt_path)}
    connector = trainer._checkpoint_connector
    resolved = connector._parse_ckpt_path(TrainerFn.FITTING, "last", model_provided=True, model_connected=False)
    assert resolved == str(tmp_path / "last-v1.ckpt")
    connector._ckpt_path = resolved  # as resume_start sets it before strategy.load_checkpoint
    redirect_checkpoint_load(trainer, tmp_path / "other.ckpt", "elsewhere")  # not the path loaded: no change
    assert trainer.ckpt_path == resolved
    redirect_checkpoint_load(trainer, resolved, str(tmp_path / "epoch=0-step=2.ckpt"))
    assert trainer.ckpt_path == str(tmp_path / "epoch=0-step=2.ckpt")
