"""Every file of a greedysnake checkpoint is checksummed on load, not only the model's: one flipped byte
in any file the manifest lists (model units, optimizer units, the extra tensors, the trainer state) is
refused, naming that file, before training resumes from it."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.checkpoint import CheckpointError, CheckpointReader
from tests.helpers import TinyGPTModule, make_trainer, token_loader

BATCHES = 6
K = 3


def _fit(root: Path, ckpt_path: str | None = None) -> None:
    """One epoch saving ``last.ckpt`` under ``root``; or, with ``ckpt_path``, a resume from it (saving
    nothing: it is expected to be refused)."""
    L.seed_everything(0, verbose=False)
    saving = ckpt_path is None
    trainer = make_trainer(GreedySnakeStrategy(auto=False), K, max_epochs=1 if saving else 2,
                           enable_checkpointing=saving, default_root_dir=root,
                           callbacks=[ModelCheckpoint(dirpath=root, save_last=True)] if saving else [])
    trainer.fit(TinyGPTModule(lr=3e-3), token_loader(BATCHES), ckpt_path=ckpt_path)


def _flip_one_byte(path: Path) -> None:
    """One byte near the end of the file: the same size and, for a safetensors file, a valid one whose
    last tensor holds a wrong value (only the checksum can tell)."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_any_listed_file_is_refused_naming_it(tmp_path):
    """For each file of the manifest in turn, a copy of the checkpoint with that one file damaged: resuming
    from it raises a CheckpointError that says the file does not match its checksum and names it. (The
    optimizer's files matter as much as the model's: a damaged moment would resume silently wrong.)"""
    _fit(tmp_path / "run")
    saved = tmp_path / "run" / "last.ckpt"
    reader = CheckpointReader(saved)
    reader.verify()
    files = sorted(reader.files)
    assert any(f.startswith("model/") for f in files), files
    assert any(f.startswith("optimizer/") for f in files), files
    assert "trainer_state.pt" in files
    for i, rel in enumerate(files):
        damaged = tmp_path / f"damaged_{i}" / "last.ckpt"
        shutil.copytree(saved, damaged)
        _flip_one_byte(CheckpointReader(damaged).payload / rel)
        try:
            _fit(tmp_path / f"resume_{i}", ckpt_path=str(damaged))
        except CheckpointError as e:
            message = str(e)
        else:
            pytest.fail(f"a flipped byte in {rel} went unnoticed: training resumed from the damaged copy")
        assert rel in message and "checksum" in message, (rel, message)
        assert "Fix" in message, message
