"""A LightningModule around a Hugging Face causal LM built from a config (``pip install
lightning-greedysnake[hf]``).

    module = HFCausalLMModule({"model_type": "llama", "hidden_size": 256, ...}, pretrained="path/to/dir")

Built inside ``trainer.init_module(empty_init=True)``, the model's parameters stay on the meta device
(buffers are real) and greedysnake materializes them unit by unit, from ``pretrained`` when given: a
``save_pretrained`` directory with safetensors, read one unit's tensors at a time. Built eagerly (any
other strategy), the pretrained weights are loaded right away. Nothing here is greedysnake-specific.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

from lightning_greedysnake.models.hf import attach_pretrained, load_module_weights, safetensors_index
from lightning_greedysnake.recipes.meta_init import building_on_meta, parameters_on_meta


def _config(config: Any) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, (str, Path)):
        return AutoConfig.from_pretrained(str(config))
    if isinstance(config, dict):
        if "model_type" not in config:
            raise ValueError(f"config={config!r} needs a model_type (llama, qwen2, mistral, gpt2, ...).")
        rest = {k: v for k, v in config.items() if k != "model_type"}
        return AutoConfig.for_model(config["model_type"], **rest)
    raise TypeError(f"config must be a transformers config, a dict or a path; got {type(config).__name__}")


class HFCausalLMModule(L.LightningModule):
    def __init__(self, config: Any, pretrained: str | None = None, lr: float = 1e-3, weight_decay: float = 0.0,
                 warmup_steps: int = 0) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        hf_config = _config(config)
        if getattr(hf_config, "tie_word_embeddings", False):
            # greedysnake steps each unit on its own; a head tied to the embedding would live in two
            warnings.warn(
                f"{hf_config.model_type}: tie_word_embeddings=True is trained untied (the head starts as a copy "
                "of the embedding); the export says so in its config.", stacklevel=2)
            hf_config.tie_word_embeddings = False
        self.hf_config = hf_config
        self.save_hyperparameters({"hf_config": json.loads(hf_config.to_json_string()), "lr": lr,
                                   "weight_decay": weight_decay, "warmup_steps": warmup_steps,
                                   "pretrained": pretrained})
        self.lr, self.weight_decay, self.warmup_steps = lr, weight_decay, warmup_steps
        on_meta = building_on_meta()
        with parameters_on_meta() if on_meta else contextlib.nullcontext():
            self.model = AutoModelForCausalLM.from_config(hf_config)
        if pretrained is not None:
            if on_meta:
                attach_pretrained(self.model, pretrained)  # the strategy streams it in, unit by unit
            else:
                load_module_weights(self.model, [self.model], safetensors_index(Path(pretrained)))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch  # y is x shifted by one token (the data module's convention)
        logits = self.model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        if not self.warmup_steps:
            return optimizer
        warmup = self.warmup_steps

        def factor(step: int) -> float:
            return min(1.0, (step + 1) / warmup) if warmup else 1.0

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def export_hf(checkpoint: str | Path, out: str | Path, config: Any = None, dtype: str = "float32") -> Path:
    """Write a ``from_pretrained``-loadable directory (``config.json`` + ``model.safetensors``) from a
    greedysnake checkpoint of an :class:`HFCausalLMModule` (or any module whose layered model is the
    Hugging Face model: names are taken relative to it). ``config``: the model's config, by default the
    one saved in the checkpoint's hyperparameters."""
    from lightning_greedysnake.checkpoint.format import TRAINER_STATE, CheckpointReader
    from lightning_greedysnake.export import export_checkpoint

    if config is None:
        hparams = CheckpointReader(checkpoint).read_object(TRAINER_STATE).get("hyper_parameters", {})
        if "hf_config" not in hparams:
            raise ValueError(f"checkpoint {checkpoint} has no hf_config hyperparameter. Fix: pass config=.")
        config = hparams["hf_config"]
    hf_config = _config(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if dtype != "float32":
        hf_config.torch_dtype = dtype
    hf_config.save_pretrained(out)
    export_checkpoint(checkpoint, out / "model.safetensors", dtype=dtype)
    return out

