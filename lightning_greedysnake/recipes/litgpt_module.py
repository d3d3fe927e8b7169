"""A LightningModule around a LitGPT model (``pip install "lightning-greedysnake[litgpt]"``), and the export
of its trained weights back to a LitGPT checkpoint directory.

    module = LitGPTModule("Llama-3.2-1B", checkpoint_dir="checkpoints/meta-llama/Llama-3.2-1B")

The model is LitGPT's ``GPT`` from ``Config.from_name(name, **overrides)``, or from the ``model_config.yaml``
of ``checkpoint_dir`` (a directory ``litgpt download`` wrote), whose ``lit_model.pth`` it starts from. Built
inside ``trainer.init_module(empty_init=True)``, its parameters stay on the meta device (its rope cache is
real) and greedysnake materializes them unit by unit, reading each unit's tensors from the memory-mapped
``lit_model.pth``; built eagerly (any other strategy), the weights are loaded right away. Optimizer and
schedule: :class:`~lightning_greedysnake.recipes.gpt_module.GPTLightningModule`'s. Nothing here is
greedysnake-specific.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lightning_greedysnake.export import model_tensors
from lightning_greedysnake.models.litgpt import (
    attach_lit_checkpoint,
    load_lit_weights,
    read_lit_state,
    require_litgpt,
)
from lightning_greedysnake.recipes.gpt_module import GPTLightningModule
from lightning_greedysnake.recipes.meta_init import building_on_meta, parameters_on_meta


def litgpt_config(name: str | None, checkpoint_dir: str | os.PathLike[str] | None = None,
                  overrides: dict[str, Any] | None = None) -> Any:
    """LitGPT's ``Config``: ``checkpoint_dir``'s ``model_config.yaml`` when given, else ``Config.from_name``;
    ``overrides`` replace fields of either (e.g. a tiny ``n_layer`` for a smoke run)."""
    require_litgpt()
    from litgpt.config import Config, name_to_config

    overrides = dict(overrides or {})
    if checkpoint_dir is not None:
        path = Path(checkpoint_dir) / "model_config.yaml"
        if not path.is_file():
            raise FileNotFoundError(f"model.checkpoint_dir={str(checkpoint_dir)!r} has no model_config.yaml. Fix: "
                                    "point it at a directory `litgpt download` wrote, or leave it null.")
        return Config.from_file(path, **overrides)
    if not name:
        raise ValueError("model.name is empty. Fix: a LitGPT config name, e.g. model.name=Llama-3.2-1B.")
    try:
        return Config.from_name(name, **overrides)
    except ValueError:
        close = sorted(n for n in name_to_config if name.lower().split("-")[0] in n.lower())[:8]
        raise ValueError(f"model.name={name!r} is not a LitGPT config name. Fix: one of litgpt.config.name_to_config"
                         f"{', e.g. ' + ', '.join(close) if close else ''}.") from None


class LitGPTModule(GPTLightningModule):
    def __init__(self, name: str | None = None, checkpoint_dir: str | None = None,
                 overrides: dict[str, Any] | None = None, block_size: int | None = None, **module: Any) -> None:
        """``block_size``: the longest sequence trained (the model's ``max_seq_length``, which sizes its rope
        cache; None: the config's ``block_size``). ``module``: :class:`GPTLightningModule`'s optimizer
        settings (``lr``, ``weight_decay``, ``betas``, ``warmup_steps``, ...)."""
        require_litgpt()
        from litgpt.model import GPT

        config = litgpt_config(name, checkpoint_dir, overrides)
        on_meta = building_on_meta()
        with parameters_on_meta() if on_meta else contextlib.nullcontext():
            model = GPT(config)
            if block_size is not None:
                model.max_seq_length = block_size
        if checkpoint_dir is not None:
            if on_meta:
                attach_lit_checkpoint(model, checkpoint_dir)  # the strategy streams it in, unit by unit
            else:
                load_lit_weights(model, [model], read_lit_state(checkpoint_dir))
        super().__init__(model, **module)
        self.save_hyperparameters({"litgpt_config": asdict(config), "name": config.name,
                                   "checkpoint_dir": checkpoint_dir, "block_size": block_size, **module})


def export_litgpt(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], config: Any = None,
                  dtype: str = "float32", copy_from: str | os.PathLike[str] | None = None) -> Path:
    """Write a LitGPT checkpoint directory ``out`` (``lit_model.pth`` and ``model_config.yaml``) from a
    greedysnake checkpoint of a :class:`LitGPTModule` (or any module whose layered model is the LitGPT
    ``GPT``: names are taken relative to it). The weights are read and written one unit at a time with
    LitGPT's own incremental writer, so ``GPT.load_state_dict(torch.load(...))`` and ``litgpt generate``
    load them. ``config``: the model's LitGPT ``Config`` (or its dict), by default the one saved in the
    checkpoint's hyperparameters. ``copy_from``: a LitGPT checkpoint directory whose tokenizer and config
    files are copied beside (what ``litgpt generate`` needs besides the weights)."""
    require_litgpt()
    from litgpt.config import Config
    from litgpt.utils import copy_config_files, incremental_save, save_config

    if config is None:
        config = _saved_config(checkpoint)
    if isinstance(config, dict):
        config = Config(**config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if copy_from is not None:
        copy_config_files(Path(copy_from), out)
    save_config(config, out)  # the trained model's own, over a copied one
    specs, tensors = model_tensors(checkpoint, dtype)
    target, tmp = out / "lit_model.pth", out / ".lit_model.pth.tmp"
    state: dict[str, Any] = {}
    with incremental_save(tmp) as saver:
        for (name, to, _), (same, tensor) in zip(specs, tensors, strict=True):
            assert name == same, (name, same)
            tensor = tensor.detach().to(to).contiguous()
            if tensor.untyped_storage().nbytes() != tensor.nbytes:
                tensor = tensor.clone()  # a view: store its own bytes, not its base's
            state[name] = saver.store_early(tensor)  # written now, one tensor at a time
        saver.save(state)
    os.replace(tmp, target)
    return target


def _saved_config(checkpoint: str | os.PathLike[str]) -> dict[str, Any]:
    from lightning_greedysnake.checkpoint.format import TRAINER_STATE, CheckpointReader, is_checkpoint_dir

    if is_checkpoint_dir(checkpoint):
        hparams = CheckpointReader(checkpoint).read_object(TRAINER_STATE).get("hyper_parameters", {})
    else:
        hparams = torch.load(checkpoint, map_location="cpu", weights_only=False).get("hyper_parameters", {})
    if "litgpt_config" not in hparams:
        raise ValueError(f"checkpoint {checkpoint} has no litgpt_config hyperparameter (not a LitGPTModule's). "
                         "Fix: pass config= (the model's litgpt Config).")
    return hparams["litgpt_config"]
