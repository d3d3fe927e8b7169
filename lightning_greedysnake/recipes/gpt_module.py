"""A plain LightningModule around the package GPT (or any ``idx -> logits`` language model given as a module):
nothing in it is specific to greedysnake."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.text import Perplexity

from lightning_greedysnake.models import GPT, GPTConfig
from lightning_greedysnake.recipes.meta_init import building_on_meta

OPTIMIZERS = {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "adamw4bit": "AdamW4bit"}
"""``module.optimizer`` -> the class (torch.optim's AdamW, or torchao.optim's low-bit AdamW)."""


class GPTLightningModule(L.LightningModule):
    def __init__(
        self,
        model: GPTConfig | dict[str, Any] | nn.Module | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        fused: bool | None = None,
        optimizer: str = "adamw",
    ) -> None:
        """``model``: the package GPT's config, or a built model that maps token ids ``(B, T)`` to logits
        ``(B, T, V)``. ``optimizer``: ``adamw`` (torch's), or torchao's ``adamw8bit`` / ``adamw4bit`` (quantized
        state: a quarter or an eighth of the state bytes; needs ``pip install torchao``)."""
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"module.optimizer={optimizer!r} is not one of {sorted(OPTIMIZERS)}. Fix: use 'adamw', "
                             "or torchao's 'adamw8bit' / 'adamw4bit'.")
        self.optimizer_name = optimizer
        if lr <= 0:
            raise ValueError(f"lr={lr} must be positive.")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0.")
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.min_lr_ratio, self.fused = warmup_steps, min_lr_ratio, fused
        if isinstance(model, nn.Module):
            self.model, self.config = model, getattr(model, "config", None)
        else:
            self.config = model if isinstance(model, GPTConfig) else GPTConfig(**(model or {}))
            self.model = GPT(self.config)
        with torch.device("cpu") if building_on_meta() else contextlib.nullcontext():
            self.val_perplexity = Perplexity()  # its state real also inside init_module(empty_init=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.val_perplexity(logits.float(), y)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_ppl", self.val_perplexity, prog_bar=True)

    def configure_optimizers(self) -> Any:
        # no weight decay on biases, LayerNorm weights and position/token embeddings' 1-d parameters
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        # fused AdamW is several times faster than foreach on CPU as well
        if self.optimizer_name == "adamw":
            fused = self.fused if self.fused is not None else True
            optimizer: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, fused=fused)
        else:
            try:
                import torchao.optim
            except ImportError as e:
                raise ImportError(f"module.optimizer={self.optimizer_name!r} needs torchao. Fix: pip install torchao, "
                                  "or use module.optimizer=adamw.") from e
            cls = getattr(torchao.optim, OPTIMIZERS[self.optimizer_name])
            optimizer = cls(groups, lr=self.lr, betas=self.betas)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup, floor = self.warmup_steps, self.min_lr_ratio

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
