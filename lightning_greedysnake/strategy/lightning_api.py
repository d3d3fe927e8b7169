"""The Lightning internals the strategy cannot do without, in one place.

Lightning offers no public route for these. Nothing else in this package touches them, and
``tests/unit/test_lightning_api.py`` exercises each against the installed Lightning, so an upgrade that
moves or changes one fails there, by name, instead of in the middle of someone's run. (The protected
``Strategy`` members a subclass is meant to override or set, ``_configure_launcher``, ``_setup_model`` and
``_precision_plugin``, are the strategy's own, as in Lightning's own strategies.)
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint


def keep_dataloader_samplers(trainer: Any) -> None:
    """In one process, the dataloaders keep their own samplers. Lightning's Trainer puts a
    ``DistributedSampler`` in whenever the strategy is a ``DDPStrategy``, one process or not (it asks the
    class, not the process count), which would reorder a shuffled dataset. The switch is the Trainer's
    ``use_distributed_sampler``, held by its private accelerator connector."""
    trainer._accelerator_connector.use_distributed_sampler = False


def before_batch_transfer(module: LightningModule, batch: Any) -> Any:
    """The ``on_before_batch_transfer`` hook of whichever defines it (the datamodule's, else the
    module's), as Lightning's training loop runs it before ``batch_to_device``. Which of the two applies
    is decided by the Trainer's private data-hook selector, hence the private call."""
    return module._on_before_batch_transfer(batch, dataloader_idx=0)


def record_module_device(module: torch.nn.Module, device: torch.device) -> None:
    """Set what ``LightningModule.device`` answers (for this module and its Lightning submodules), as
    ``module.to(device)`` would, for a move that leaves some parameters where they are."""
    _update_properties(module, device=device)


def last_checkpoint_candidates(trainer: Any) -> set[str]:
    """The paths ``fit(ckpt_path="last")`` chooses from (the newest of those that exist), as Lightning's
    ``_CheckpointConnector._parse_ckpt_path`` collects them: every ModelCheckpoint's ``last*.ckpt`` in its
    directory (its private ``_find_last_checkpoints``) and OnExceptionCheckpoint's file."""
    candidates = {str(cb.ckpt_path) for cb in trainer.callbacks
                  if isinstance(cb, OnExceptionCheckpoint) and cb.ckpt_path}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            candidates |= callback._find_last_checkpoints(trainer)
    return candidates


def redirect_checkpoint_load(trainer: Any, path: Any, instead: Any) -> None:
    """Where the Trainer is loading ``path``, make it name ``instead`` (what the strategy loads in its place):
    ``trainer.ckpt_path`` and Lightning's "Restored all states from" line read the connector's private
    ``_ckpt_path``, set to the resolved path before ``strategy.load_checkpoint`` is called."""
    connector = trainer._checkpoint_connector
    if connector._ckpt_path is not None and str(connector._ckpt_path) == str(path):
        connector._ckpt_path = instead
