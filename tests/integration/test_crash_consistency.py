"""A process killed with SIGKILL, during training or in the middle of a checkpoint save, leaves the last
completed checkpoint loadable and complete; resuming from it lands where an uninterrupted run lands."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.checkpoint import CheckpointReader
from tests.helpers import TinyGPTModule, make_trainer, max_abs_diff, token_loader

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, time
    import lightning as L
    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.checkpoint import format as fmt
    from tests.helpers import TinyGPTModule, make_trainer, token_loader

    root, mode = sys.argv[1], sys.argv[2]
    saves = {"n": 0, "files": 0}
    original_write = fmt.CheckpointWriter.write_bytes
    original_tensors = fmt.CheckpointWriter.write_tensors
    original_publish = fmt.CheckpointWriter.publish

    def write_tensors(self, rel, tensors, metadata=None):
        original_tensors(self, rel, tensors, metadata)
        count(self)

    def write_bytes(self, rel, data):
        original_write(self, rel, data)
        count(self)

    def count(self):
        saves["files"] += 1
        if mode == "in_save" and saves["n"] == 1 and saves["files"] == 3:
            print("IN_SAVE", flush=True)  # the second save has written three files: kill me here
            time.sleep(600)

    def publish(self, index):
        original_publish(self, index)
        saves["n"] += 1
        saves["files"] = 0
        print(f"SAVED {saves['n']}", flush=True)
        if mode == "training" and saves["n"] == 1:
            print("TRAINING", flush=True)

    fmt.CheckpointWriter.write_bytes = write_bytes
    fmt.CheckpointWriter.write_tensors = write_tensors
    fmt.CheckpointWriter.publish = publish

    class Slow(L.Callback):  # long enough steps that the kill lands in the middle of training
        def on_train_batch_end(self, *args):
            time.sleep(0.05)

    class SaveEveryEpoch(L.Callback):
        def on_train_epoch_end(self, trainer, module):
            trainer.save_checkpoint(f"{root}/last.ckpt")

    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False), 3, max_epochs=50, default_root_dir=root,
                           callbacks=[SaveEveryEpoch(), Slow()])
    trainer.fit(TinyGPTModule(lr=3e-3), token_loader(10))
""")


def _run_and_kill(tmp_path: Path, mode: str, wait_for: str, delay: float) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(root), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == wait_for:
                break
            assert time.monotonic() < deadline, "the child never got there"
        else:
            pytest.fail(f"the child ended before printing {wait_for}")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return root


def _resume_from(last: Path, root: Path, epochs: int) -> tuple[dict, int]:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(lr=3e-3)
    trainer = make_trainer(GreedySnakeStrategy(auto=False), 3, max_epochs=epochs, default_root_dir=root)
    trainer.fit(module, token_loader(10), ckpt_path=str(last))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, trainer.global_step


def _uninterrupted(root: Path, epochs: int) -> dict:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(lr=3e-3)
    make_trainer(GreedySnakeStrategy(auto=False), 3, max_epochs=epochs, default_root_dir=root).fit(module, token_loader(10))
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path):
    root = _run_and_kill(tmp_path, "in_save", "IN_SAVE", 0.0)
    last = root / "last.ckpt"
    reader = CheckpointReader(last)
    reader.verify()  # every file there, every checksum right
    state = reader.read_object("trainer_state.pt")
    assert state["global_step"] == 4  # the first epoch's save; the second never committed
    half_written = [p for p in last.iterdir() if p.name.startswith("v-") and p != reader.payload]
    assert half_written, "the killed save's payload should still be lying there, uncommitted"
    # resuming from it (into the same directory, whose offload lock the dead process left) is exact
    resumed, step = _resume_from(last, root, epochs=3)
    assert step == 12
    assert max_abs_diff(resumed, _uninterrupted(tmp_path / "ref", epochs=3)) <= 1e-6


def test_sigkill_during_training_leaves_a_loadable_checkpoint(tmp_path):
    root = _run_and_kill(tmp_path, "training", "TRAINING", 0.3)
    last = root / "last.ckpt"
    reader = CheckpointReader(last)
    reader.verify()
    epoch = reader.read_object("trainer_state.pt")["epoch"]
    resumed, final = _resume_from(last, root, epochs=epoch + 2)
    assert final == 4 * (epoch + 2)
    assert max_abs_diff(resumed, _uninterrupted(tmp_path / "ref", epochs=epoch + 2)) <= 1e-6
