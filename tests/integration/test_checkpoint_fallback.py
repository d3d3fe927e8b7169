"""Where ``ckpt_path="last"`` resolves to a checkpoint folder missing its ``CURRENT`` (its first save never
finished), the run falls back to the newest complete checkpoint beside it: the newest whose files all match
their checksums, never one that fails them (named as "newest complete", then failing to load, or loading
damaged values), and never the oldest by mistake. The checkpoints here are several, so that newest, next
newest and oldest differ."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.checkpoint import CheckpointError, CheckpointReader, CheckpointWriter
from lightning_greedysnake.strategy.checkpoints import newest_complete, resume_path
from tests.helpers import TinyGPTModule, make_trainer, token_loader

BATCHES, K = 4, 2  # two optimizer steps an epoch
UNIT = "model/unit_00000.safetensors"


def _damage(checkpoint: Path, how: str) -> None:
    """Damage a file of ``checkpoint``'s payload as bit rot or a crash would: one byte flipped (its size right,
    its checksum wrong) or cut short. A new file in its place: files shared with other checkpoints (a save at
    the same step links them) stay whole."""
    f = CheckpointReader(checkpoint).payload / UNIT
    data = bytearray(f.read_bytes())
    f.unlink()
    if how == "corrupted":
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    else:
        f.write_bytes(bytes(data[: len(data) // 2]))


class StepAtStart(L.Callback):
    """The step the run resumed at (the loaded checkpoint's)."""

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.step = trainer.global_step


def _fit(root: Path, max_epochs: int, ckpt_path: str | None = None) -> tuple[L.Trainer, StepAtStart]:
    L.seed_everything(0, verbose=False)
    start = StepAtStart()
    trainer = make_trainer(GreedySnakeStrategy(auto=False), K, max_epochs=max_epochs, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=-1), start])
    trainer.fit(TinyGPTModule(), token_loader(BATCHES), ckpt_path=ckpt_path)
    return trainer, start


@pytest.mark.parametrize("how", ["corrupted", "truncated"])
def test_last_without_current_resumes_from_the_newest_checkpoint_that_verifies(tmp_path, how):
    root = tmp_path / "ckpts"
    _fit(root, max_epochs=3)
    oldest, middle, newest, last = (root / n for n in ("epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt",
                                                       "epoch=2-step=6.ckpt", "last.ckpt"))
    times = [(c / "CURRENT").stat().st_mtime_ns for c in (oldest, middle, newest)]
    assert times == sorted(times) and len(set(times)) == 3, times  # saved in that order
    _damage(newest, how)
    (last / "CURRENT").unlink()  # a first save of last.ckpt that never finished

    with pytest.warns(UserWarning) as said:
        trainer, start = _fit(root, max_epochs=4, ckpt_path="last")
    (warning,) = [str(w.message) for w in said if "first save never finished" in str(w.message)]
    assert f"Resuming from {middle} instead, the newest complete checkpoint in {root} that verifies" in warning, warning
    assert re.search(rf"passed over, newer but damaged: {re.escape(str(newest))} \(.*"
                     + ("does not match its checksum" if how == "corrupted" else "truncated"), warning), warning
    assert trainer.ckpt_path == str(middle) and start.step == 4  # loaded the one named
    assert trainer.global_step == 8


def _complete(path: Path, mtime: int) -> Path:
    writer = CheckpointWriter(path)
    writer.write_bytes(UNIT, b"weights of " + path.name.encode() * 64)
    writer.publish({})
    os.utime(path / "CURRENT", ns=(mtime, mtime))
    return path


def test_newest_complete_takes_the_newest_that_verifies_and_names_it_in_the_fix(tmp_path):
    """Three complete checkpoints (and a Lightning file, older): the newest, and where it is damaged the next
    newest that verifies; the refusal of an explicitly named incomplete checkpoint names that one."""
    old_file = tmp_path / "plain.ckpt"
    old_file.write_bytes(b"a Lightning checkpoint file")
    os.utime(old_file, ns=(1, 1))
    oldest, middle, newest = (_complete(tmp_path / f"step={s}.ckpt", s * 10**9) for s in (1, 2, 3))
    partial = tmp_path / "step=4.ckpt"
    (partial / "v-0123456789ab").mkdir(parents=True)
    (partial / "v-0123456789ab" / "trainer_state.pt").write_bytes(b"\0" * 16)

    assert newest_complete(tmp_path, partial) == newest  # not the oldest
    _damage(newest, "corrupted")
    skipped: list[str] = []
    assert newest_complete(tmp_path, partial, skipped=skipped) == middle
    assert len(skipped) == 1 and skipped[0].startswith(f"{newest} (") and "checksum" in skipped[0], skipped
    with pytest.raises(CheckpointError, match=rf"Fix: pass ckpt_path='{re.escape(str(middle))}', the newest complete "
                                              rf"checkpoint beside it that verifies \(passed over, newer but damaged: "
                                              rf"{re.escape(str(newest))} "):
        resume_path(str(partial))
    _damage(middle, "truncated")
    assert newest_complete(tmp_path, partial) == oldest
    _damage(oldest, "corrupted")
    assert newest_complete(tmp_path, partial) == old_file  # (a file is not checked: Lightning loads it)
