"""A process killed with SIGKILL during the *first* save of ``last.ckpt`` leaves a checkpoint directory with
a payload and no ``CURRENT``. ``ckpt_path="last"`` then falls back to the newest complete checkpoint beside it
(saying so) or is refused naming the fixes; the next save removes such folders, and nothing else."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.checkpoint import CheckpointError, CheckpointReader, CheckpointWriter
from tests.helpers import TinyGPTModule, make_trainer, token_loader

REPO = Path(__file__).resolve().parents[2]
BATCHES = 4  # with K=2: two optimizer steps an epoch

CHILD = textwrap.dedent("""
    import os, sys, time
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_greedysnake import GreedySnakeStrategy
    from tests.helpers import TinyGPTModule, make_trainer, token_loader

    root, save_top_k = sys.argv[1], int(sys.argv[2])
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):  # the save's commit point: hold the first save of last.ckpt here
        if str(dst) == os.path.join(root, "last.ckpt", "CURRENT"):
            print("IN_SAVE", flush=True)  # payload, manifest and CURRENT.tmp written, CURRENT not: kill me
            time.sleep(600)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace
    L.seed_everything(0, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=root, save_last=True, save_top_k=save_top_k)
    trainer = make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=3, enable_checkpointing=True,
                           callbacks=[checkpoint])
    trainer.fit(TinyGPTModule(), token_loader(%d))
""" % BATCHES)


def _start(tmp_path: Path, save_top_k: int) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "ckpts"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, str(script), str(root), str(save_top_k)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=tmp_path)
    return proc, root


def _kill_in_save(proc: subprocess.Popen, root: Path) -> Path:
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if line.strip() == "IN_SAVE":
                break
            assert time.monotonic() < deadline, "the child never got there"
        else:
            pytest.fail("the child ended before its first save of last.ckpt")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    last = root / "last.ckpt"
    assert not (last / "CURRENT").exists() and [p for p in last.iterdir() if p.name.startswith("v-")], \
        "the killed save should have left a payload without CURRENT"
    return root


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real training processes, each SIGKILLed inside its first save of ``last.ckpt`` (after the payload,
    before ``CURRENT``; both started at once, to pay the imports once): ``"after_top_k"`` after a complete
    top-k save, ``"first"`` in its first save ever (``save_top_k=0``). Each test takes one."""
    started = {name: _start(tmp_path_factory.mktemp(name), top_k) for name, top_k in (("after_top_k", -1),
                                                                                      ("first", 0))}
    return {name: _kill_in_save(proc, root) for name, (proc, root) in started.items()}


def _resume(root: Path, ckpt_path: str | None, save_top_k: int, max_epochs: int = 2) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=max_epochs, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=root, save_last=True, save_top_k=save_top_k)])
    trainer.fit(TinyGPTModule(), token_loader(BATCHES), ckpt_path=ckpt_path)
    return trainer


def _all_complete(root: Path) -> list[str]:
    """Every entry of ``root`` is a complete checkpoint (every file's checksum right, no payload but the
    one ``CURRENT`` names); their names."""
    for entry in root.iterdir():
        reader = CheckpointReader(entry)
        reader.verify()
        assert sorted(p.name for p in entry.iterdir()) == ["CURRENT", reader.payload.name], entry
    return sorted(p.name for p in root.iterdir())


def test_last_falls_back_to_the_newest_complete_checkpoint_and_says_so(killed):
    """Killed in the save of last.ckpt right after the first top-k save (whose files it hard-linked): resuming
    with ckpt_path="last" warns naming both paths and resumes from the top-k one; its first save removes the
    incomplete folder and leaves the complete one whole."""
    root = killed["after_top_k"]
    last, complete = root / "last.ckpt", root / "epoch=0-step=2.ckpt"
    (partial,) = [p for p in last.iterdir() if p.name.startswith("v-")]
    unit = "model/unit_00000.safetensors"
    assert os.path.samefile(partial / unit, CheckpointReader(complete).payload / unit)  # shares its files
    with pytest.warns(UserWarning, match=rf"{re.escape(str(last))}, a checkpoint whose first save never finished.*"
                                         rf"Resuming from {re.escape(str(complete))} instead"):
        trainer = _resume(root, "last", save_top_k=-1)
    assert trainer.global_step == 4  # one more epoch on top of the complete checkpoint's two steps
    assert trainer.ckpt_path == str(complete)
    assert _all_complete(root) == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]
    assert CheckpointReader(last).read_object("trainer_state.pt")["global_step"] == 4  # this run's, not a leftover


def test_last_with_no_complete_checkpoint_is_refused_naming_the_fix_and_the_next_save_cleans_up(killed):
    """Killed in its first save ever: ckpt_path="last" is refused, naming the folder and how to start fresh (the
    folder is left for the user to see); a fresh run's first save removes the folder."""
    root = killed["first"]
    last = root / "last.ckpt"
    named = re.escape(str(last))
    with pytest.raises(CheckpointError, match=rf"resolved to {named}.*no complete checkpoint.*Fix: start fresh with "
                                              rf"ckpt_path=None.*delete the incomplete folder {named}"):
        _resume(root, "last", save_top_k=0)
    assert last.is_dir() and not (last / "CURRENT").exists()
    trainer = _resume(root, None, save_top_k=0, max_epochs=1)  # the fix: start fresh
    assert trainer.global_step == 2
    # Lightning named this run's save last-v1.ckpt (last.ckpt was there); that save removed the partial one
    assert _all_complete(root) == ["last-v1.ckpt"]


def _partial(path: Path, payload: str = "v-0123456789ab") -> Path:
    """What a save killed before its commit leaves (the files of an unpublished payload, no CURRENT)."""
    (path / payload / "model").mkdir(parents=True)
    (path / payload / "model" / "unit_00000.safetensors").write_bytes(b"\0" * 64)
    (path / payload / "trainer_state.pt").write_bytes(b"\0" * 16)
    (path / "CURRENT.tmp").write_text(f"{payload}\n")
    return path


def _complete(path: Path) -> CheckpointWriter:
    writer = CheckpointWriter(path)
    writer.write_bytes("trainer_state.pt", b"state of " + path.name.encode())
    writer.publish({})
    return writer


def test_a_save_removes_partial_checkpoints_and_nothing_a_complete_checkpoint_or_a_save_needs(tmp_path):
    """Beside a published save: directories a killed first save left, and payloads a killed later save left
    in a complete checkpoint, go; a complete checkpoint, saves still being written (their payload locked),
    a folder with anything else in it and plain files stay."""
    done = _complete(tmp_path / "done.ckpt").path
    killed_second = _partial(tmp_path / "done.ckpt", "v-aaaaaaaaaaaa") / "v-aaaaaaaaaaaa"  # in a complete one
    killed_first = _partial(tmp_path / "killed.ckpt")
    hidden = _partial(tmp_path / ".last.ckpt.gs-tmp")  # a killed save that was to replace a save_last link
    writing = CheckpointWriter(tmp_path / "writing.ckpt")  # a first save in progress (another process's, say)
    writing.write_bytes("trainer_state.pt", b"not yet published")
    writing_into_done = CheckpointWriter(done)  # and a second save of done.ckpt in progress
    not_ours = _partial(tmp_path / "notes")
    (not_ours / "README").write_text("someone's folder that happens to look like a payload")
    plain = tmp_path / "plain.ckpt"
    plain.write_bytes(b"a Lightning checkpoint file")

    _complete(tmp_path / "next.ckpt")  # the next save

    assert not killed_first.exists() and not hidden.exists() and not killed_second.exists()
    CheckpointReader(done).verify()  # the complete checkpoint whole
    assert writing.payload.is_dir() and writing_into_done.payload.is_dir()  # saves in progress untouched
    assert (not_ours / "v-0123456789ab" / "trainer_state.pt").exists() and plain.exists()
    writing.publish({})
    writing_into_done.publish({})
    for name in ("writing.ckpt", "done.ckpt", "next.ckpt"):
        CheckpointReader(tmp_path / name).verify()


def test_an_explicitly_named_incomplete_checkpoint_is_refused_naming_the_newest_complete_one(tmp_path):
    """A path named explicitly (not what ckpt_path="last" resolved to) is not replaced behind the user's back:
    refused, naming the newest complete checkpoint beside it as the fix."""
    _complete(tmp_path / "epoch=0-step=2.ckpt")
    partial = _partial(tmp_path / "epoch=1-step=4.ckpt")
    with pytest.raises(CheckpointError, match=rf"first save never finished: it has a payload and no CURRENT.*"
                                              rf"Fix: pass ckpt_path='{re.escape(str(tmp_path))}/epoch=0-step=2\.ckpt'"
                                              r".*ckpt_path=None"):
        _resume(tmp_path / "run", str(partial), save_top_k=0)


UNREADABLE_CURRENT = {
    "not_utf8": b"\xff\xfe\x00garbage\x80",  # fails to decode
    "empty": b"",
    "zero_filled": b"\0" * 64,  # what a crash can leave of a file whose data never reached the disk
    "truncated": b"v-0",  # the start of a payload's name
    "names_no_payload": b"v-ffffffffffff\n",  # well formed, but no such payload is there
    "no_read_permission": None,  # mode 000 (root reads it all the same: then the test sees a readable CURRENT)
}


@pytest.mark.parametrize("damage", list(UNREADABLE_CURRENT))
def test_a_save_keeps_every_payload_of_a_checkpoint_whose_current_cannot_be_read(tmp_path, damage):
    """Beside a published save, a checkpoint whose ``CURRENT`` cannot be read (or names nothing there) may be
    pointing at any of its payloads: the cleanup of partial saves keeps them all, and ``CURRENT`` as it is; with
    ``CURRENT`` repaired, the checkpoint verifies whole."""
    damaged = _complete(tmp_path / "damaged.ckpt")
    published = damaged.payload.name
    current = damaged.path / "CURRENT"
    good = current.read_bytes()
    other = _partial(tmp_path / "damaged.ckpt", "v-aaaaaaaaaaaa") / "v-aaaaaaaaaaaa"  # a killed later save's, maybe
    garbage = UNREADABLE_CURRENT[damage]
    if garbage is None:
        current.chmod(0)
        if os.access(current, os.R_OK):
            current.chmod(0o644)
            pytest.skip("this process reads a file of mode 000 (root)")
    else:
        current.write_bytes(garbage)
    try:
        _complete(tmp_path / "next.ckpt")  # the next save: it cleans up beside it
        assert sorted(p.name for p in damaged.path.iterdir()) == sorted(["CURRENT", "CURRENT.tmp", published,
                                                                         other.name]), damage
        if garbage is not None:
            assert current.read_bytes() == garbage
    finally:
        current.chmod(0o644)
    current.write_bytes(good)
    CheckpointReader(damaged.path).verify()
    CheckpointReader(tmp_path / "next.ckpt").verify()
