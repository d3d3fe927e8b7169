"""Lightning's checkpoint hooks, answered through one seam chosen once per run: :class:`CheckpointSeam`.

With the tensor manager (:class:`StreamedCheckpoints`, built complete with it by ``open_run``), the state
dicts are placeholders that a save streams unit by unit from the tiers into a checkpoint directory, and a
load streams the other way (after setup: the tensor manager must exist first). Without one (everything
on the device, or before setup: :data:`LIGHTNING`), Lightning's own path, except that a checkpoint
directory (an offloaded run's) loads gathered in memory, as ``export --lightning`` gathers it.

The strategy's hooks call the seam with Lightning's own implementation (``lightning``, the strategy's
``super()`` method) for the seam to use or not: no hook asks which kind of run it is.

Threads: the training thread (Lightning's checkpoint hooks).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_greedysnake.checkpoint import CheckpointError, CheckpointReader, is_checkpoint_dir
from lightning_greedysnake.checkpoint.directory import CURRENT, is_incomplete_checkpoint_dir
from lightning_greedysnake.checkpoint.plain import plain_checkpoint
from lightning_greedysnake.checkpoint.streamed import (
    OPTIMIZER_LEVEL_STATE,
    STREAMED_STATE,
    SavedState,
    StreamedTensor,
    load_model_into,
    load_optimizer_into,
    load_streamed,
    save_streamed,
    shapes_check,
)
from lightning_greedysnake.distributed import ShardedStateView, join_save
from lightning_greedysnake.strategy.lightning_api import last_checkpoint_candidates, redirect_checkpoint_load
from lightning_greedysnake.unit_state import UnitValues


class CheckpointSeam:
    """What Lightning's checkpoint hooks ask of a run; ``lightning`` is Lightning's own answer. This base is
    the seam without a tensor manager (:data:`LIGHTNING`): Lightning's path, except that a checkpoint
    directory loads gathered in memory."""

    def module_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Lightning's module state dict (``state``) as a checkpoint saves it."""
        return state

    def full_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with every parameter's current full-precision value (collective with partitioned
        state: every rank calls it)."""
        return state

    def optimizer_state(self, optimizer: Any, lightning: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        return lightning(optimizer)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any,
             lightning: Callable[[dict[str, Any], Any, Any], None]) -> None:
        lightning(checkpoint, filepath, storage_options)

    def load(self, path: Any, lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return load_path(path, plain_checkpoint, lightning)

    def load_model(self, module: Any, checkpoint: Mapping[str, Any], strict: bool,
                   lightning: Callable[[Mapping[str, Any], bool], None]) -> None:
        def shapes(state: Mapping[str, Any]) -> dict[str, Any]:
            return {n: v.shape for n, v in state.items() if isinstance(v, Tensor)}

        shapes_check(_source(module), shapes(module.state_dict()), shapes(checkpoint["state_dict"]))
        lightning(checkpoint, strict)

    def load_optimizer(self, optimizer: Any, checkpoint: Mapping[str, Any],
                       lightning: Callable[[Mapping[str, Any]], None]) -> None:
        lightning(checkpoint)


def load_path(path: Any, read_directory: Callable[[Any], dict[str, Any]],
              lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The one way a checkpoint path (after :func:`resume_path`) is loaded, by the strategy and by
    :class:`~lightning_greedysnake.strategy.checkpoint_io.GreedySnakeCheckpointIO`: a greedysnake directory
    by ``read_directory`` (streamed into a run's tensor manager, or gathered in memory), any other directory
    refused naming the fix (where ``torch.load`` would say a bare ``IsADirectoryError``), a file by
    Lightning (``lightning``)."""
    if is_checkpoint_dir(path):
        return read_directory(path)
    if "://" not in str(path) and Path(path).is_dir():
        raise CheckpointError(
            f"ckpt_path={str(path)!r} is a directory but not a greedysnake checkpoint (no CURRENT file). "
            "Fix: pass a checkpoint file, or the NAME.ckpt directory a greedysnake run's ModelCheckpoint wrote.")
    return lightning()


def _source(module: Any) -> Any:
    """The checkpoint a load into ``module`` reads, as messages name it (Lightning's ``trainer.ckpt_path``)."""
    trainer = _trainer_of(module)
    path = trainer.ckpt_path if trainer is not None else None
    return path if path is not None else "state_dict"


def remove(filepath: Any, lightning: Callable[[Any], None]) -> None:
    """Remove a checkpoint directory, or leave a file to Lightning (rank 0 only; either kind of run)."""
    if is_checkpoint_dir(filepath) and not Path(filepath).is_symlink():
        shutil.rmtree(filepath)
    else:
        lightning(filepath)


def _same(a: Any, b: Any) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _trainer_of(module: Any) -> Any:
    try:
        return module.trainer if module is not None else None
    except RuntimeError:  # not attached to a Trainer (a direct strategy.load_checkpoint call)
        return None


def newest_complete(directory: Path, exclude: Path, suffix: str = ".ckpt",
                    skipped: list[str] | None = None) -> Path | None:
    """The newest complete checkpoint in ``directory`` named ``*suffix`` other than ``exclude``: a greedysnake
    checkpoint directory whose ``CURRENT`` names a payload with every file there at its size and checksum (its
    time: ``CURRENT``'s), or a checkpoint file (its time); None where there is none. Newest first: one that
    does not verify is passed over for the next newest (never named nor loaded: its load would fail, or load
    damaged values), and said in ``skipped`` (its path and why). Verifying reads every file of the one named,
    once: this runs only where a resume falls back from a checkpoint whose save never finished."""
    found: list[tuple[float, str, Path]] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return None
    for entry in entries:
        if entry.name.startswith(".") or entry.suffix != suffix or _same(entry, exclude):
            continue
        try:
            if entry.is_dir() and (entry / CURRENT).is_file():
                found.append(((entry / CURRENT).stat().st_mtime, entry.name, entry))
            elif entry.is_file():
                found.append((entry.stat().st_mtime, entry.name, entry))
        except OSError:
            continue
    for _, _, entry in sorted(found, reverse=True):  # newest first
        if entry.is_file():
            return entry
        try:
            CheckpointReader(entry).verify()  # the manifest, and every file there at its size and checksum
        except (OSError, CheckpointError) as e:
            if skipped is not None:
                skipped.append(f"{entry} ({str(e).partition(' Fix:')[0]})")
            continue
        return entry
    return None


def resume_path(path: Any, module: Any = None) -> Any:
    """The checkpoint to load for ``ckpt_path`` (resolved by Lightning): ``path`` itself, unless it is a
    greedysnake checkpoint directory whose first save never finished (a payload and no ``CURRENT``: the
    process was killed while saving it; :func:`~lightning_greedysnake.checkpoint.directory.
    is_incomplete_checkpoint_dir`). Then, where it is what ``ckpt_path="last"`` resolves to, the newest
    complete checkpoint beside it, said in a warning naming both; with none complete, or where ``path`` was
    named some other way, a :class:`CheckpointError` naming the path and the fixes. ``module``: the
    LightningModule, to find its Trainer's checkpoint callbacks (None: ``path`` was named explicitly)."""
    if path is None or "://" in str(path) or not is_incomplete_checkpoint_dir(path):
        return path
    p = Path(path)
    trainer = _trainer_of(module)
    suffix = next((cb.FILE_EXTENSION for cb in getattr(trainer, "checkpoint_callbacks", [])
                   if isinstance(cb, ModelCheckpoint)), ModelCheckpoint.FILE_EXTENSION)
    skipped: list[str] = []
    fallback = newest_complete(p.parent, p, suffix, skipped)
    passed_over = (f" (passed over, newer but damaged: {'; '.join(skipped)})" if skipped else "")
    unfinished = (f"a checkpoint whose first save never finished: it has a payload and no {CURRENT} file (the "
                  "process was killed while saving it, or a save is writing it now)")
    # ``p`` is one of the checkpoints ``ckpt_path="last"`` chooses from; an explicitly named path among them
    # counts as the same
    if trainer is not None and any(_same(candidate, p) for candidate in last_checkpoint_candidates(trainer)):
        if fallback is not None:
            rank_zero_warn(
                f"ckpt_path resolved to {p}, {unfinished}. Resuming from {fallback} instead, the newest complete "
                f"checkpoint in {p.parent} that verifies{passed_over}; the next save there removes the incomplete "
                "folder.")
            redirect_checkpoint_load(trainer, path, str(fallback))  # trainer.ckpt_path names what is loaded
            return str(fallback)
        raise CheckpointError(
            f"ckpt_path=\"last\" resolved to {p}, {unfinished}, and {p.parent} holds no complete checkpoint to "
            f"resume from instead{passed_over}. Fix: start fresh with ckpt_path=None (the next save there removes "
            f"the incomplete folder), or delete the incomplete folder {p} (then ckpt_path=\"last\" finds nothing and starts fresh).")
    instead = (f"pass ckpt_path={str(fallback)!r}, the newest complete checkpoint beside it that verifies"
               f"{passed_over}, or ckpt_path=None to start fresh" if fallback is not None else
               f"pass another checkpoint, or ckpt_path=None to start fresh, or delete the incomplete folder {p}")
    raise CheckpointError(f"ckpt_path={str(p)!r} is {unfinished}. Fix: {instead} (a save into {p.parent} "
                          "removes the incomplete folder).")


LIGHTNING = CheckpointSeam()
"""The seam of a run without a tensor manager, and before setup."""


class StreamedCheckpoints(CheckpointSeam):
    """The seam of a run with the tensor manager: checkpoints stream to and from its tiers, never
    gathered (rank 0 writes the directory; with partitioned state every rank contributes its chunks)."""

    def __init__(self, values: UnitValues, *, rank: int, world: int, layered_prefix: str,
                 precision: str, aliases: Mapping[str, str] | None = None) -> None:
        self.values = values
        """The tensor manager's whole units, which checkpoints stream from and into."""
        self.aliases = dict(aliases or {})
        """State-dict names of a unit parameter besides its own, each with its own (:func:`~lightning_greedysnake.
        checkpoint.streamed.parameter_aliases`: GPT-2's frozen head, the embedding's weight)."""
        self.rank, self.world = rank, world
        self.layered_prefix = layered_prefix
        """The layered model's path in the LightningModule with its dot ("" at the top)."""
        self.precision = precision
        self._last_saved: SavedState | None = None
        self._loads = 0
        """Checkpoints loaded into the tensor manager: a save after one never links an earlier save's files."""

    def _view(self) -> Any:
        return ShardedStateView(self.values, self.rank, self.world) if self.values.shard else self.values

    def module_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Every unit parameter as a :class:`StreamedTensor` placeholder that :meth:`save` streams."""
        for u in range(self.values.num_units):
            for i, slot in enumerate(self.values.layouts[u].params):
                if slot.name in state:
                    state[slot.name] = StreamedTensor(u, i, slot.shape)
        return self._with_aliases(state)

    def _with_aliases(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with each alias of a unit parameter what its own name holds (not the placeholder's NaN)."""
        for alias, name in self.aliases.items():
            if alias in state and name in state:
                state[alias] = state[name]
        return state

    def full_state(self, state: dict[str, Any]) -> dict[str, Any]:
        master: Callable[[int], list[Tensor]] = self._view().unit_master_weights
        for u in range(self.values.num_units):
            for slot, value in zip(self.values.layouts[u].params, master(u), strict=True):
                if slot.name in state:
                    state[slot.name] = value
        return self._with_aliases(state)

    def optimizer_state(self, optimizer: Any, lightning: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        if self.values.optimizer is None:
            return lightning(optimizer)
        self.values.publish_calls()  # (the per-call state outside state[p], as the units' steps left it)
        state = optimizer.state_dict()
        # state under keys that are no parameter (MADGRAD's step count) is kept as it is; the rest is streamed
        # unit by unit by save
        state[OPTIMIZER_LEVEL_STATE] = {k: v for k, v in state["state"].items() if not isinstance(k, int)}
        state["state"] = STREAMED_STATE
        return state

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any,
             lightning: Callable[[dict[str, Any], Any, Any], None]) -> None:
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
        values = self.values
        with_optimizer = checkpoint.get("optimizer_states") is not None and values.optimizer is not None
        if values.shard is not None and self.rank != 0:
            join_save(self._view(), with_optimizer)  # rank 0 writes
            return
        if self.rank != 0:
            return
        # the state changes only at optimizer steps: a second save at the same step (save_last after a
        # top-k save) links the first one's files
        step = checkpoint.get("global_step")
        version = None if step is None else (step, self._loads)
        self._last_saved = save_streamed(self._view(), checkpoint, filepath, self.layered_prefix, self.precision,
                                         version=version, previous=None if values.shard else self._last_saved)

    def load(self, path: Any, lightning: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return load_path(path, load_streamed, lightning)

    def load_model(self, module: Any, checkpoint: Mapping[str, Any], strict: bool,
                   lightning: Callable[[Mapping[str, Any], bool], None]) -> None:
        self._loads += 1
        load_model_into(self.values, module, checkpoint["state_dict"], strict, source=_source(module))

    def load_optimizer(self, optimizer: Any, checkpoint: Mapping[str, Any],
                       lightning: Callable[[Mapping[str, Any]], None]) -> None:
        if self.values.optimizer is None:
            return lightning(checkpoint)
        (opt_state,) = checkpoint["optimizer_states"]
        load_optimizer_into(self.values, optimizer, opt_state)
