"""Saved activations placed on SSD need room the start-of-run preflight cannot count (their size is known at
their first save): a disk with room for the weights, the optimizer's state and the gradients but not for the
saved activations is refused at the first window, before any of it is written or stepped, naming the
directory, the bytes and the fix (it was an ``ENOSPC`` from the middle of the window)."""

from __future__ import annotations

import logging
import re

import lightning as L
import pytest

from lightning_greedysnake import GPT, GPTConfig, GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from tests.helpers import TinyGPTModule, make_trainer, mounted, token_loader

K, BATCH, SEQ = 4, 8, 128
"""A micro-batch's unit input is 8 x 128 x 16 fp32 = 64 KiB; a window saves K x 2 of them (3 units: the input of
every unit but the first): 512 KiB, where the run's state needs 188 KiB."""


def test_a_disk_with_no_room_for_the_saved_activations_is_refused_before_any_step(tmp_path, caplog):
    with mounted(tmp_path / "tiny", size="520k") as mount:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule()
        module.model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=32, block_size=SEQ))
        offload_dir = mount / "offload"
        trainer = make_trainer(GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere(
            "ssd", path=str(offload_dir))), K, max_epochs=1)
        with caplog.at_level(logging.INFO), pytest.raises(ValueError) as refused:
            trainer.fit(module, token_loader(2 * K, batch_size=BATCH, seq=SEQ))
        said = str(refused.value)
        assert re.search(rf"offload_dir='{re.escape(str(offload_dir))}' has \d+\.\d KiB free but this run's saved "
                         r"activations \(8 of 64\.0 KiB a window in this directory, 512\.0 KiB: .*\) need 508\.0 KiB more there\. "
                         r"Fix: .*offload\.activations=host.*accumulate_grad_batches", said), said
        assert trainer.global_step == 0  # refused before any step
        # the setup report said that the saved activations go there and are checked at the first window
        assert re.search(r"activations +sized at the first window", caplog.text), caplog.text
        assert not offload_dir.exists()  # the run's files removed
