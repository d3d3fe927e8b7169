"""A layered model whose parameters are not all float32 (PEFT's usual LoRA setup: a frozen bf16 base, fp32
adapters) is never trained silently wrong: the tensor manager lays every parameter out as compute weights
(with fp32 masters for the trainable ones), so a parameter whose dtype that would change is refused before any
work, naming it (issue 69: PEFT on a bf16 base ended 9.1e-3 from Lightning without a word; keeping each
parameter in its own dtype is issue 70's)."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from tests.helpers import make_trainer, max_abs_diff, regression_loader


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
}


@pytest.mark.parametrize("path", list(STRATEGIES))
@pytest.mark.parametrize("base_dtype, trainable_base, precision", [
    (torch.bfloat16, False, "32-true"),  # PEFT's usual setup
    (torch.float16, False, "32-true"),
    (torch.bfloat16, True, "bf16-mixed"),  # Lightning would step it in bf16, greedysnake on an fp32 master
])
def test_a_parameter_the_layout_would_change_is_refused_before_any_work(tmp_path, path, base_dtype, trainable_base,
                                                                         precision):
    L.seed_everything(0, verbose=False)
    module = LoRAModule(base_dtype, trainable_base)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = make_trainer(STRATEGIES[path](), 3, default_root_dir=tmp_path, precision=precision)
    name = str(base_dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"parameter 'net\.1\.base\.weight' is {name} "
                                         rf"\({'trainable' if trainable_base else 'frozen'}\).*Fix:.*model\.float\(\)"):
        trainer.fit(module, regression_loader(6))
    assert trainer.global_step == 0
    assert max_abs_diff({n: p.detach() for n, p in module.named_parameters()}, before) == 0


def test_a_frozen_base_in_float32_trains_as_lightning_does():
    """The same model in float32 (the fix the refusal names) is exact against strategy='auto'."""
    def run(strategy: Any) -> dict[str, torch.Tensor]:
        L.seed_everything(0, verbose=False)
        module = LoRAModule(torch.float32)
        make_trainer(strategy, 3).fit(module, regression_loader(6))
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    ref = run("auto")
    got = run(STRATEGIES["vertical-ssd"]())
    assert max_abs_diff(got, ref) <= 1e-5


def test_a_frozen_bf16_base_under_bf16_mixed_is_its_compute_dtype_already():
    """Under bf16-mixed the compute weights are bf16: a frozen bf16 base is laid out as it is (accepted)."""
    L.seed_everything(0, verbose=False)
    module = LoRAModule(torch.bfloat16)
    trainer = make_trainer(STRATEGIES["vertical-ssd"](), 3, precision="bf16-mixed")
    trainer.fit(module, regression_loader(6))
    assert trainer.global_step == 4
    assert module.net[1].base.weight.dtype == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in module.parameters())
