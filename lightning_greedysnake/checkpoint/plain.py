"""A checkpoint directory as a plain Lightning checkpoint dict, the whole state gathered in memory."""

from __future__ import annotations

import json
import os

from torch import Tensor

from lightning_greedysnake.checkpoint.format import TRAINER_STATE, CheckpointReader
from lightning_greedysnake.checkpoint.streamed import EXTRA_FILE


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
        state_dict.update(reader.read_tensors(f"model/unit_{unit:05d}.safetensors"))
        rel = f"optimizer/unit_{unit:05d}.safetensors"
        if rel in reader.files:
            tensors, meta = reader.read_tensors_and_metadata(rel)
            for key, value in tensors.items():
                name, _, slot = key.partition("::")
                per_param.setdefault(name, {})[slot] = value
            for name, scalars in json.loads(meta.get("scalars", "{}")).items():
                per_param.setdefault(name, {}).update(scalars)
    state["state_dict"] = state_dict
    if reader.manifest.get("optimizer"):
        order = reader.manifest["optimizer_params"]
        for opt in state.get("optimizer_states", []):
            opt["state"] = {i: per_param[n] for i, n in enumerate(order) if n is not None and n in per_param}
    return state
