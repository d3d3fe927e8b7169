"""Checkpoints of SSD-resident state: crash-consistent directories, streamed unit by unit."""

from lightning_greedysnake.checkpoint.format import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    is_checkpoint_dir,
)

__all__ = ["CheckpointError", "CheckpointReader", "CheckpointWriter", "is_checkpoint_dir"]
