"""Lightning's checkpoint hooks when the tensor manager holds the model and optimizer state: state
dicts of placeholders that a save streams unit by unit from the tiers into a checkpoint directory,
and loads that stream the other way (after setup, when the tensor manager exists)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_greedysnake.checkpoint import is_checkpoint_dir
from lightning_greedysnake.checkpoint.streamed import (
    STREAMED_STATE,
    StreamedStateDict,
    StreamedTensor,
    load_model_into,
    load_optimizer_into,
    save_streamed,
)
from lightning_greedysnake.distributed import ShardedStateView, join_save
from lightning_greedysnake.tensor_manager import TieredTensorStore

MasterSource = Callable[[int], list[Tensor]]


class StreamedCheckpoints:
    def __init__(self) -> None:
        self.last_seconds: float | None = None
        """Wall time of the last save (streamed from the tiers)."""
        self._last_saved: Any = None
        self._loads = 0
        """Checkpoints loaded into the tensor manager: a save after one never links an earlier save's files."""

    @staticmethod
    def placeholders(state: dict[str, Any], manager: TieredTensorStore) -> dict[str, Any]:
        """Lightning's state dict with every unit parameter as a :class:`StreamedTensor` placeholder that
        :meth:`save` streams from the tiers (the whole model is never gathered)."""
        for u in range(manager.num_units):
            for i, slot in enumerate(manager.layouts[u].params):
                if slot.name in state:
                    state[slot.name] = StreamedTensor(u, i, slot.shape)
        return state

    @staticmethod
    def filled(state: dict[str, Any], manager: TieredTensorStore, master: MasterSource) -> dict[str, Any]:
        """Lightning's state dict with every unit parameter's current full-precision value (gathered)."""
        for u in range(manager.num_units):
            for slot, value in zip(manager.layouts[u].params, master(u), strict=True):
                if slot.name in state:
                    state[slot.name] = value
        return state

    @staticmethod
    def master_source(manager: TieredTensorStore, rank: int, world: int) -> MasterSource:
        """Full-precision weights of a unit: the manager's, or gathered from every rank's chunk with
        partitioned state (collective: every rank calls it)."""
        if manager.shard is None:
            return manager.unit_master_weights
        return ShardedStateView(manager, rank, world).unit_master_weights

    @staticmethod
    def optimizer_placeholder(optimizer: Any) -> dict[str, Any]:
        state = optimizer.state_dict()
        state["state"] = STREAMED_STATE  # streamed unit by unit by save
        return state

    def save(self, manager: TieredTensorStore, checkpoint: dict[str, Any], filepath: Any, storage_options: Any,
             *, rank: int, world: int, global_step: int, layered_prefix: str, precision: str) -> None:
        """Write ``checkpoint`` as a checkpoint directory (rank 0), streaming every unit; with partitioned
        state every rank contributes its chunks."""
        if storage_options is not None:
            raise TypeError(
                f"trainer.save_checkpoint(..., storage_options={storage_options!r}): greedysnake writes its "
                "checkpoint directory itself, without a CheckpointIO plugin. Fix: drop storage_options."
            )
        if "://" in str(filepath):
            raise ValueError(
                f"checkpoint path {filepath!r}: greedysnake saves to a local or mounted filesystem (it streams "
                "every unit and renames atomically). Fix: save locally and copy the directory afterwards."
            )
        with_optimizer = checkpoint.get("optimizer_states") is not None and manager.optimizer is not None
        if manager.shard is not None and rank != 0:
            join_save(ShardedStateView(manager, rank, world), with_optimizer)  # rank 0 writes
            return
        if rank != 0:
            return
        t0 = time.perf_counter()
        # the state changes only at optimizer steps: a second save at the same step (save_last after a
        # top-k save) links the first one's files
        version = (id(manager), global_step, self._loads)
        view = ShardedStateView(manager, rank, world) if manager.shard else manager
        self._last_saved = save_streamed(view, checkpoint, filepath, layered_prefix, precision, version=version,
                                         previous=None if manager.shard else self._last_saved)
        self.last_seconds = time.perf_counter() - t0

    @staticmethod
    def remove(filepath: Any) -> bool:
        """Remove a checkpoint directory (True), or leave a file to Lightning (False)."""
        if is_checkpoint_dir(filepath) and not Path(filepath).is_symlink():
            shutil.rmtree(filepath)
            return True
        return False

    @staticmethod
    def refuse_without_manager(state_dict: Mapping[str, Any]) -> None:
        if isinstance(state_dict, StreamedStateDict):
            raise ValueError(
                f"checkpoint {state_dict.reader.path} holds state streamed from SSD; loading it needs the "
                "tensor manager (an offload placement with something off the device). Fix: export it "
                "with `python -m lightning_greedysnake.export` to load it elsewhere."
            )

    def load_model(self, manager: TieredTensorStore, module: Any, state_dict: Mapping[str, Any],
                   strict: bool) -> None:
        self._loads += 1
        load_model_into(manager, module, state_dict, strict)

    @staticmethod
    def load_optimizer(manager: TieredTensorStore, optimizer: Any, checkpoint: Mapping[str, Any]) -> None:
        (opt_state,) = checkpoint["optimizer_states"]
        load_optimizer_into(manager, optimizer, opt_state)
