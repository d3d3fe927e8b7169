"""Lightning checkpoints of the (in-memory) state resume exactly."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_greedysnake import GreedySnakeStrategy
from tests.helpers import TinyGPTModule, make_trainer, max_abs_diff, token_loader


def _fit(max_epochs: int, root, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(lr=3e-3)
    trainer = make_trainer(
        GreedySnakeStrategy(), 3, max_epochs=max_epochs, enable_checkpointing=True, default_root_dir=root,
        callbacks=[ModelCheckpoint(dirpath=root, save_last=True)],
    )
    trainer.fit(module, token_loader(10), ckpt_path=ckpt_path)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, trainer


def test_resume_at_epoch_boundary_equals_uninterrupted(tmp_path):
    uninterrupted, _ = _fit(3, tmp_path / "a")
    _fit(1, tmp_path / "b")
    resumed, trainer = _fit(3, tmp_path / "b", ckpt_path=str(tmp_path / "b" / "last.ckpt"))
    assert trainer.global_step == 12
    assert max_abs_diff(uninterrupted, resumed) <= 1e-6
