"""A layered model whose parameters are not all float32 trains as Lightning does or is refused before any
work, naming the parameter (issue 70). PEFT's usual LoRA setup, a frozen bf16 base beside fp32 adapters under
``32-true``, keeps the base read-only in its own dtype and is exact (it ended 9.1e-3 from Lightning without a
word before issue 69 refused it); a trainable bf16 parameter (which Lightning steps in bf16), a frozen one
wider than the compute dtype, and a quantized tensor subclass are refused."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from tests.helpers import Grads, make_trainer, max_abs_diff, regression_loader


class Adapted(nn.Module):
    """A LoRA-style block: a frozen base in ``base_dtype`` (its input cast to it, as PEFT's layers do) beside a
    trainable fp32 low-rank adapter."""

    def __init__(self, width: int, base_dtype: torch.dtype) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).to(base_dtype).requires_grad_(False)
        self.down, self.up = nn.Linear(width, 2, bias=False), nn.Linear(2, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x.to(self.base.weight.dtype)).to(x.dtype) + self.up(self.down(x)))


class LoRAModule(L.LightningModule):
    def __init__(self, base_dtype: torch.dtype, trainable_base: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), Adapted(16, base_dtype), Adapted(16, base_dtype), nn.Linear(16, 3))
        if trainable_base:
            self.net[1].base.requires_grad_(True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


STRATEGIES = {
    "vertical-ssd": lambda: GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd")),
    "planned": lambda: GreedySnakeStrategy(),
    "horizontal": lambda: GreedySnakeStrategy(auto=False, schedule="horizontal"),
    "alpha-half": lambda: GreedySnakeStrategy(auto=False, alpha=0.5, lag=1, offload=OffloadConfig.everywhere("ssd")),
}


def fit(strategy: Any, base_dtype: torch.dtype, precision: str) -> tuple[dict[str, torch.Tensor], Grads]:
    L.seed_everything(0, verbose=False)
    module, grads = LoRAModule(base_dtype), Grads()
    make_trainer(strategy, 3, precision=precision, callbacks=[grads]).fit(module, regression_loader(6))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, grads


@functools.cache
def reference(base_dtype: torch.dtype, precision: str) -> Any:
    """``strategy="auto"``'s run, once per setup (every path compares with the same one)."""
    return fit("auto", base_dtype, precision)


@pytest.mark.parametrize("path", list(STRATEGIES))
@pytest.mark.parametrize("base_dtype, precision", [
    (torch.bfloat16, "32-true"),  # PEFT's usual setup
    (torch.float16, "32-true"),
    (torch.float32, "32-true"),
    (torch.bfloat16, "bf16-mixed"),  # (the compute dtype already)
])
def test_a_frozen_base_in_its_own_dtype_trains_as_lightning_does(path, base_dtype, precision):
    """The adapters and every window's gradients to 1e-5, the base bit-identical and still in its dtype."""
    ref, ref_grads = reference(base_dtype, precision)
    got, got_grads = fit(STRATEGIES[path](), base_dtype, precision)
    trainable = {n for n in ref if ".base." not in n}
    assert got["net.1.base.weight"].dtype == base_dtype
    assert len(got_grads.grads) == len(ref_grads.grads) == 4
    for g, r in zip(got_grads.grads, ref_grads.grads, strict=True):
        assert max_abs_diff({n: g[n] for n in trainable}, {n: r[n] for n in trainable}) <= 1e-5
    assert max_abs_diff({n: got[n] for n in trainable}, {n: ref[n] for n in trainable}) <= 1e-5
    assert all(torch.equal(got[n], ref[n]) for n in ref if ".base." in n)


@pytest.mark.parametrize("path", ["vertical-ssd", "planned"])
@pytest.mark.parametrize("case, match", [
    ("trainable-bf16", r"parameter 'net\.1\.base\.weight' is bfloat16 \(trainable\).*Fix:.*float32"),
    ("frozen-float64", r"parameter 'net\.1\.base\.weight' is float64 \(frozen\).*Fix: cast it"),
    ("int8-weight-only", r"parameter 'net\.1\.base\.weight' is a Int8Tensor \(a tensor subclass.*Fix: dequantize"),
])
def test_a_parameter_it_would_train_otherwise_is_refused_before_any_work(tmp_path, path, case, match):
    L.seed_everything(0, verbose=False)
    precision = "32-true"
    if case == "trainable-bf16":
        module, precision = LoRAModule(torch.bfloat16, trainable_base=True), "bf16-mixed"
    elif case == "frozen-float64":
        module = LoRAModule(torch.float64)
    else:
        pytest.importorskip("torchao")
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        module = LoRAModule(torch.float32)
        quantize_(module.net[1].base, Int8WeightOnlyConfig())
        module.net[1].base.weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = make_trainer(STRATEGIES[path](), 3, default_root_dir=tmp_path, precision=precision)
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, regression_loader(6))
    assert trainer.global_step == 0
    if case != "int8-weight-only":
        assert max_abs_diff({n: p.detach() for n, p in module.named_parameters()}, before) == 0
