"""torchao's 8-bit and 4-bit AdamW stepped per unit over streamed quantized state: bit-identical to the
same optimizer under Lightning's default strategy (where every piece is whole blocks), a quarter or an
eighth of the state bytes through the I/O engine, checkpoints that resume bit for bit, and the
example's GPT training as well as with fp32 state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.models import GPT, GPTConfig
from lightning_greedysnake.optim.state_format import state_format_for
from lightning_greedysnake.optim.unit_optimizer import discover_slots
from tests.helpers import (
    TinyGPTModule,
    bf16_policy_run,
    example_val_loss,
    make_trainer,
    token_loader,
    warmup_scheduler,
)
from tests.integration.test_equivalence import GradRecorder

torchao_optim = pytest.importorskip("torchao.optim")
K = 2


class QuantizedGPT(TinyGPTModule):
    """The tiny GPT, wide enough that its matrices are quantized (torchao: 4096 elements and up), with
    torchao's optimizer and a warmup schedule (torchao keeps the LR as a tensor the scheduler fills)."""

    def __init__(self, optimizer: str, n_embd: int) -> None:
        super().__init__(n_layer=2)
        self.model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=n_embd, vocab_size=32, block_size=8))
        self.optimizer_cls = getattr(torchao_optim, optimizer)

    def configure_optimizers(self) -> Any:
        opt = self.optimizer_cls(self.parameters(), lr=3e-3, weight_decay=0.1)
        return {"optimizer": opt, "lr_scheduler": warmup_scheduler(opt, 2)}


class Seen(GradRecorder):
    """Also: the SSD traffic per kind, each unit's deferred range, the optimizer state as checkpoints see it."""

    def on_train_end(self, trainer: Any, module: Any) -> None:
        manager = getattr(trainer.strategy, "tensor_manager", None)
        if manager is None:
            return
        manager.drain()
        self.stats = manager.stats.copy()
        self.deferred = [opt.part_range(1) for opt in manager.stepper.unit_optimizers if opt is not None]
        self.probes = manager.state_format.codec.probes if manager.state_format.codec else 0
        self.optimizer_state = manager.values.optimizer_state()


def fit(strategy: Any, optimizer: str, n_embd: int, steps: int = 4) -> tuple[dict[str, torch.Tensor], Seen]:
    L.seed_everything(0, verbose=False)
    module = QuantizedGPT(optimizer, n_embd) if optimizer != "AdamW" else TinyGPTModule(n_layer=2, lr=3e-3)
    if optimizer == "AdamW":
        module.model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=n_embd, vocab_size=32, block_size=8))
    seen = Seen()
    trainer = make_trainer(strategy, K, callbacks=[seen], max_steps=steps)
    trainer.fit(module, token_loader(K * steps))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, seen


CASES = {
    # a unit of 0.45M elements: alpha defers its tail (the split on a 256K-element boundary, whole blocks)
    "8bit-ssd-alpha": ("AdamW8bit", 192, {"alpha": 0.5, "lag": 1}),
    "4bit-split-host-ssd": ("AdamW4bit", 64, {"alpha": 0.0, "lag": 0,
                                              "offload": {"optimizer_states": {"host": 0.5, "ssd": 0.5}}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_the_same_optimizer_under_lightning(case):
    optimizer, n_embd, settings = CASES[case]
    ref_params, ref = fit("auto", optimizer, n_embd)
    params, seen = fit(GreedySnakeStrategy(auto=False, **settings), optimizer, n_embd)
    if settings["alpha"]:
        assert any(lo < hi for lo, hi in seen.deferred)  # the forward part really exists
    assert seen.stats.bytes_read(TensorKind.OPTIMIZER_STATES.value) > 0  # the state really streams
    assert seen.probes == 0  # each piece's format came from its own first step (no transient copies)
    assert len(seen.grads) == len(ref.grads) == 4
    for step, (g, r) in enumerate(zip(seen.grads, ref.grads, strict=True)):
        for name, grad in r.items():
            assert torch.equal(g[name], grad), (step, name)
    for name, value in ref_params.items():
        assert torch.equal(params[name], value), name
    assert seen.lrs == ref.lrs


def test_bf16_mixed_matches_the_mixed_precision_policy_with_the_same_optimizer():
    """Under bf16-mixed: bit-identical to the plain-PyTorch loop of the same policy (bf16 copies of the
    fp32 master weights compute under autocast, each micro-batch's gradient accumulates in fp32) with
    the same torchao optimizer stepping the master weights."""
    L.seed_everything(0, verbose=False)
    module = QuantizedGPT("AdamW8bit", 64)
    ref_grads = bf16_policy_run(module, list(token_loader(K * 4)), K)
    L.seed_everything(0, verbose=False)
    got, seen = QuantizedGPT("AdamW8bit", 64), Seen()
    trainer = make_trainer(GreedySnakeStrategy(auto=False, alpha=0.0, lag=2), K, callbacks=[seen], max_steps=4,
                           precision="bf16-mixed")
    trainer.fit(got, token_loader(K * 4))
    for step, (g, r) in enumerate(zip(seen.grads, ref_grads, strict=True)):
        for name, grad in r.items():
            assert torch.equal(g[name], grad), (step, name)
    for name, value in module.named_parameters():
        assert torch.equal(dict(got.named_parameters())[name], value), name


def test_state_bytes_shrink_to_the_quantized_size():
    """Per step the optimizer state moves a quarter (8-bit codes plus a scale per 256) or an eighth
    (4-bit plus a scale per 128) of fp32 state's bytes, as the counters show; the weights move as before."""
    steps = {}
    for optimizer in ("AdamW", "AdamW8bit", "AdamW4bit"):
        _, seen = fit(GreedySnakeStrategy(auto=False, alpha=0.0, lag=1), optimizer, 192, steps=2)
        steps[optimizer] = seen.stats
    fp32 = steps["AdamW"].bytes_read("optimizer_states")
    for optimizer, ratio in (("AdamW8bit", (1 + 4 / 256) / 4), ("AdamW4bit", (0.5 + 4 / 128) / 4)):
        for direction in ("read", "written"):
            got = getattr(steps[optimizer], f"bytes_{direction}")("optimizer_states")
            want = getattr(steps["AdamW"], f"bytes_{direction}")("optimizer_states") * ratio
            assert got == pytest.approx(want, rel=0.06), (optimizer, direction)  # (4 KiB-aligned runs)
            # (parameters start on whole blocks: a little more padding in every region)
            assert getattr(steps[optimizer], f"bytes_{direction}")("weights") == \
                pytest.approx(getattr(steps["AdamW"], f"bytes_{direction}")("weights"), rel=0.01)
    assert fp32 > 0


def test_a_resumed_run_continues_bit_for_bit(tmp_path: Path):
    """Checkpoints hold the state dequantized to fp32 (loadable anywhere); loading quantizes it again
    into the same codes and scales, so the resumed run continues exactly."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(root: Path, epochs: int, ckpt: str | None = None) -> tuple[dict[str, torch.Tensor], Seen]:
        L.seed_everything(0, verbose=False)
        module, seen = QuantizedGPT("AdamW8bit", 64), Seen()
        trainer = make_trainer(GreedySnakeStrategy(auto=False, alpha=0.0, lag=1), K, max_epochs=epochs,
                               enable_checkpointing=True, default_root_dir=root,
                               callbacks=[seen, ModelCheckpoint(dirpath=root, save_last=True)])
        trainer.fit(module, token_loader(2 * K), ckpt_path=ckpt)
        return {n: p.detach().clone() for n, p in module.named_parameters()}, seen

    uninterrupted, seen = run(tmp_path / "a", 3)
    run(tmp_path / "b", 1)
    resumed, _ = run(tmp_path / "b", 3, ckpt=str(tmp_path / "b" / "last.ckpt"))
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name
    entry = next(e for e in seen.optimizer_state.values() if e["exp_avg"].numel() >= 4096)
    assert entry["exp_avg"].dtype == torch.float32 and type(entry["exp_avg"]) is torch.Tensor
    assert entry["exp_avg"].unique().numel() < 2 * entry["exp_avg"].numel() // 256 * 256  # quantized values


def test_settings_that_cannot_stream_quantized_state_are_refused_before_training():
    module = QuantizedGPT("AdamW8bit", 64)
    opt = module.configure_optimizers()["optimizer"]
    slots = discover_slots(opt)
    assert slots == ("exp_avg", "exp_avg_sq")
    with pytest.raises(ValueError, match="optimizer_state_dtype='bfloat16'.*Fix: leave"):
        state_format_for(opt, slots, "bfloat16")
    with pytest.raises(ValueError, match="shard_state=True.*Fix: set shard_state=False"):
        state_format_for(opt, slots, "float32", shard=(0, 2))
    trainer = make_trainer(GreedySnakeStrategy(auto=False, offload={"optimizer_state_dtype": "bfloat16"}), K,
                           max_steps=1)
    with pytest.raises(ValueError, match="optimizer_state_dtype"):
        trainer.fit(module, token_loader(K))
    assert trainer.global_step == 0


def test_the_example_gpt_trains_as_well_with_8bit_state():
    """The example's GPT and data (a small config): validation loss within 2% of fp32 state."""
    fp32 = example_val_loss()
    q8 = example_val_loss(optimizer="adamw8bit")
    assert fp32 < 2.5  # it learned something (the byte-level entropy of random text is 5.5)
    assert q8 == pytest.approx(fp32, rel=0.02)
    assert q8 != fp32  # (the quantization really happened)
