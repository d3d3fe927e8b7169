"""A checkpoint directory as a plain Lightning checkpoint dict, the whole state gathered in memory."""

from __future__ import annotations

import os

from torch import Tensor

from lightning_greedysnake.checkpoint.format import TRAINER_STATE, CheckpointReader
from lightning_greedysnake.checkpoint.streamed import (
    EXTRA_FILE,
    OPTIMIZER_LEVEL_STATE,
    model_file,
    optimizer_entries,
    optimizer_file,
)


def plain_checkpoint(checkpoint: str | os.PathLike[str]) -> dict[str, object]:
    """A greedysnake checkpoint directory as the dict a plain Lightning checkpoint file holds
    (full-precision weights, optimizer state, loops, schedulers), gathered in memory: what
    ``export --lightning`` writes and a run with every kind on the device resumes from."""
    reader = CheckpointReader(checkpoint)
    state = reader.read_object(TRAINER_STATE)
    params = reader.manifest["params"]
    state_dict: dict[str, Tensor] = dict(reader.read_tensors(EXTRA_FILE)) if EXTRA_FILE in reader.files else {}
    units = sorted({info["unit"] for info in params.values()})
    per_param: dict[str, dict[str, object]] = {}
    for unit in units:
        state_dict.update(reader.read_tensors(model_file(unit)))
        if optimizer_file(unit) in reader.files:
            per_param.update(optimizer_entries(*reader.read_tensors_and_metadata(optimizer_file(unit))))
    for alias, name in reader.manifest.get("aliases", {}).items():  # (a tied head: the one tensor, as torch.save)
        state_dict[alias] = state_dict[name]
    state["state_dict"] = state_dict
    if reader.manifest.get("optimizer"):
        order = reader.manifest["optimizer_params"]
        for opt in state.get("optimizer_states", []):
            opt["state"] = {i: per_param[n] for i, n in enumerate(order) if n is not None and n in per_param}
            # state under keys that are no parameter (MADGRAD's step count) goes where torch.optim keeps it
            opt["state"].update(opt.pop(OPTIMIZER_LEVEL_STATE, {}))
    return state
