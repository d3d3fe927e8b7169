"""The Lightning internals the strategy cannot do without, in one place.

Lightning offers no public route for these. Nothing else in this package touches them, and
``tests/unit/test_lightning_api.py`` exercises each against the installed Lightning, so an upgrade that
moves or changes one fails there, by name, instead of in the middle of someone's run. (The protected
``Strategy`` members a subclass is meant to set, ``_launcher`` in ``_configure_launcher`` and
``_precision_plugin``, are set by the strategy itself, as Lightning's own strategies do.)
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher


def init_process_group(cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta) -> None:
    """``torch.distributed.init_process_group`` from Lightning's cluster environment (as DDP does)."""
    _init_dist_connection(cluster_environment, backend, timeout=timeout)


def sync_reduce(tensor: torch.Tensor, group: Any, reduce_op: Any) -> torch.Tensor:
    """Lightning's reduction for ``self.log(..., sync_dist=True)`` and ``strategy.reduce`` (as DDP does)."""
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def subprocess_launcher(cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int) -> Any:
    """Lightning's launcher that re-runs the script once per extra local process (as DDP's default)."""
    return _SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes)


def before_batch_transfer(module: LightningModule, batch: Any) -> Any:
    """The ``on_before_batch_transfer`` hook of whichever defines it (the datamodule's, else the
    module's), as Lightning's training loop runs it before ``batch_to_device``. Which of the two applies
    is decided by the Trainer's private data-hook selector, hence the private call."""
    return module._on_before_batch_transfer(batch, dataloader_idx=0)


def record_module_device(module: torch.nn.Module, device: torch.device) -> None:
    """Set what ``LightningModule.device`` answers (for this module and its Lightning submodules), as
    ``module.to(device)`` would, for a move that leaves some parameters where they are."""
    _update_properties(module, device=device)
