"""Greedysnake checkpoint directories for other strategies, through Lightning's own seam (``CheckpointIO``).

A greedysnake checkpoint is a directory (``last.ckpt/``, streamed unit by unit), where every other
strategy's ``CheckpointIO`` reads a file and fails with a bare ``IsADirectoryError``. With this plugin
any strategy resumes from one::

    trainer = L.Trainer(strategy="auto", plugins=[GreedySnakeCheckpointIO()])
    trainer.fit(module, datamodule, ckpt_path="checkpoints/last.ckpt")   # a greedysnake directory

The directory is read as ``export --lightning`` reads it (:func:`~lightning_greedysnake.checkpoint.plain.
plain_checkpoint`: the whole state gathered in memory, checksums verified, nothing unpickled but
containers, numbers, strings and tensors); a file goes to Lightning's ``TorchCheckpointIO`` unchanged, and
so does every save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_greedysnake.strategy.checkpoints import LIGHTNING, resume_path


class GreedySnakeCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that also reads greedysnake checkpoint directories (see the module docstring)."""

    @override
    def load_checkpoint(self, path: Any, map_location: Callable | None = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        path = resume_path(path)  # a directory whose first save was killed: refused naming the fixes
        return LIGHTNING.load(path, lambda: super(GreedySnakeCheckpointIO, self).load_checkpoint(
            path, map_location=map_location, weights_only=weights_only))
