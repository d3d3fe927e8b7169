"""The RNG policy of :mod:`lightning_greedysnake.rng` as a callback, for any strategy: the reference
greedysnake's dropout is compared with (Lightning's own strategy with this callback draws the same masks)."""

from __future__ import annotations

import contextlib
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from typing_extensions import override

from lightning_greedysnake.models.discovery import find_layered_model
from lightning_greedysnake.rng import MicrobatchStreams, draw_base_seed


class MicrobatchRNG(Callback):
    """The policy of :mod:`lightning_greedysnake.rng` under any strategy: ``Trainer(strategy="auto",
    callbacks=[MicrobatchRNG()])`` draws the masks that greedysnake draws, so results compare exactly.

    The model whose forward draws from the micro-batch's stream is the one greedysnake runs unit by unit,
    found the same way: ``layered_module`` is the strategy's setting of that name (a dotted submodule path;
    None: the outermost layered model)."""

    def __init__(self, layered_module: str | None = None) -> None:
        self.layered_module = layered_module
        self._base: int | None = None
        self._streams: MicrobatchStreams | None = None
        self._microbatch = 0
        self._hooks: list[Any] = []
        self._entered: contextlib.ExitStack | None = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._base = draw_base_seed()
        model = find_layered_model(pl_module, self.layered_module)[1]
        self._hooks = [model.register_forward_pre_hook(self._enter),
                       model.register_forward_hook(self._exit, always_call=True)]

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        assert self._base is not None
        self._microbatch = batch_idx % trainer.accumulate_grad_batches
        self._streams = MicrobatchStreams(self._base, trainer.global_step, pl_module.device)

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._streams = None

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _enter(self, module: nn.Module, args: Any) -> None:
        if self._streams is not None and module.training:
            self._entered = contextlib.ExitStack()
            self._entered.enter_context(self._streams.forward_of(self._microbatch))

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        entered, self._entered = self._entered, None
        if entered is not None:
            entered.close()
