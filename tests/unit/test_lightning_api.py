"""Every Lightning internal the strategy relies on (``strategy/lightning_api.py``, and the protected
``Strategy`` members a subclass sets), exercised against the installed Lightning: an upgrade that moves
or changes one fails here, by name."""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities import distributed as fabric_distributed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.strategy import lightning_api
from tests.helpers import SequentialModule, make_trainer


def test_the_process_group_helpers_take_what_the_strategy_passes():
    init = inspect.signature(fabric_distributed._init_dist_connection).parameters
    assert list(init)[:2] == ["cluster_environment", "torch_distributed_backend"]
    # timeout= goes on to torch.distributed.init_process_group
    assert "timeout" in init or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in init.values())
    sync = inspect.signature(fabric_distributed._sync_ddp_if_available).parameters
    assert list(sync)[:2] == ["result", "group"] and "reduce_op" in sync
    # one process, nothing initialized: the reduction is the identity, as the strategy relies on
    t = torch.tensor([3.0])
    assert lightning_api.sync_reduce(t, None, "mean") is t


def test_the_subprocess_launcher_is_built_as_ddp_builds_it():
    launcher = lightning_api.subprocess_launcher(LightningEnvironment(), 2, 1)
    assert launcher.num_processes == 2 and launcher.num_nodes == 1
    assert hasattr(launcher, "launch") and launcher.is_interactive_compatible is False


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
