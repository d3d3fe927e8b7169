"""A stock ``nn.TransformerEncoder`` is a layered model as it is (its ``layers`` the blocks, its ``norm`` the
post): found inside the user's LightningModule and trained as Lightning trains it, with a causal mask, in
every order and placement (issue 70: users wrote their own ``layer_chain()`` for it)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from tests.helpers import Grads, make_trainer, max_abs_diff

K = 2
SEQ, WIDTH = 6, 16


class EncoderModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(WIDTH), enable_nested_tensor=False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
        return F.mse_loss(self.encoder(x, mask=mask, is_causal=True), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def loader() -> Any:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, SEQ, WIDTH, generator=g), torch.randn(12, SEQ, WIDTH, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=2)


class Units(Grads):
    """Also: how many units the run cut the model into (0: no tensor manager)."""

    units = 0

    def on_train_start(self, trainer: Any, module: Any) -> None:
        super().on_train_start(trainer, module)
        manager = getattr(trainer.strategy, "tensor_manager", None)
        self.units = manager.num_units if manager is not None else 0


def fit(strategy: Any) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]], int]:
    L.seed_everything(0, verbose=False)
    module, grads = EncoderModule(), Units()
    trainer = make_trainer(strategy, K, callbacks=[grads])
    trainer.fit(module, loader())
    return {n: p.detach().clone() for n, p in module.named_parameters()}, grads.grads, grads.units


@pytest.mark.parametrize("strategy", [
    lambda: GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd")),
    lambda: GreedySnakeStrategy(auto=False, schedule="horizontal"),
    lambda: GreedySnakeStrategy(),
], ids=["vertical-ssd", "horizontal", "planned"])
def test_a_stock_transformer_encoder_trains_as_lightning_does(strategy):
    ref, ref_grads, _ = fit("auto")
    got, got_grads, units = fit(strategy())
    assert units >= 1  # (its layers, cut into units)
    assert len(got_grads) == len(ref_grads) == 6
    for g, r in zip(got_grads, ref_grads, strict=True):
        assert max_abs_diff(g, {n: v for n, v in r.items() if n in g}) <= 1e-5
    assert max_abs_diff(got, ref) <= 1e-5
