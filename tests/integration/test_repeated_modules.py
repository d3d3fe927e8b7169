"""One module at several positions of the layered model (issue 69): ``nn.Sequential(Linear, *[block] * 4,
Linear)``, one ``Linear`` at two positions, a ``LayeredModel`` whose blocks repeat a module. Every position
runs, always: exact where all the positions of a shared module fall in one unit (against Lightning's own
strategy with the same optimizer and ``accumulate_grad_batches``: weights and every window's gradients to
1e-5), refused before any work, naming the module, its positions and the fix, where they do not. Never a
silently shorter network (``children()`` skips a module's repeats).

Paths: the vertical order with every kind on SSD, the horizontal order, the planned defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.models import LayerChain, sequential_chain
from tests.helpers import make_trainer, max_abs_diff, regression_loader
from tests.integration.test_equivalence import GradRecorder

K = 3
NUM_BATCHES = 8  # windows of 3, 3, 2 per epoch, two epochs: six steps


def repeated_block() -> nn.Module:
    """Weight-shared depth as people write it: one block object at positions 1 to 4."""
    block = nn.Sequential(nn.Linear(12, 12), nn.Tanh())
    return nn.Sequential(nn.Linear(6, 12), *[block] * 4, nn.Linear(12, 3))


def shared_linear() -> nn.Module:
    """One ``Linear`` at positions 1 and 3."""
    linear = nn.Linear(12, 12)
    return nn.Sequential(nn.Linear(6, 12), linear, nn.Tanh(), linear, nn.Linear(12, 3))


class SharedInChain(nn.Module):
    """A hand-written :class:`~lightning_greedysnake.LayeredModel` whose blocks hold one ``Linear`` at
    blocks 1 and 3."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.linear, self.out = nn.Linear(6, 12), nn.Linear(12, 12), nn.Linear(12, 3)
        self.blocks = nn.ModuleList([nn.Tanh(), self.linear, nn.Tanh(), self.linear, nn.Tanh()])

    def layer_chain(self) -> LayerChain:
        return LayerChain((self.inp,), tuple(self.blocks), (self.out,), lambda x: (self.inp(x), None),
                          lambda block, hidden, ctx: block(hidden), lambda hidden, ctx: self.out(hidden))

    def forward(self, x: Tensor) -> Tensor:
        return self.layer_chain().forward(x)


MODELS: dict[str, tuple[Callable[[], nn.Module], str, int]] = {
    # the model, its refusal's words at one block a unit, the smallest layers_per_unit that trains it
    "repeated-block": (repeated_block, "at block 1, block 2, block 3 and block 4 of Net.net, which are one "
                                       "Sequential object ('net.1')", 5),
    "shared-linear": (shared_linear, "at block 1 and block 3 of Net.net, which are one Linear object "
                                     "('net.1')", 4),
    "layered-model": (SharedInChain, "at block 1 and block 3 of Net.net, which are one Linear object "
                                     "('net.linear')", 4),
}


class Net(L.LightningModule):
    def __init__(self, make: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.net = make()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


PATHS: dict[str, Callable[..., Any]] = {
    "vertical-ssd": lambda **kw: GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd"),
                                                     **kw),
    "horizontal": lambda **kw: GreedySnakeStrategy(auto=False, schedule="horizontal", **kw),
    "planned": lambda **kw: GreedySnakeStrategy(**kw),
}


def start(model: str) -> Net:
    L.seed_everything(0, verbose=False)
    return Net(MODELS[model][0])


def weights(module: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def fit(strategy: Any, model: str, root: Any) -> dict[str, Any]:
    module, grads = start(model), GradRecorder()
    trainer = make_trainer(strategy, K, callbacks=[grads], default_root_dir=root)
    trainer.fit(module, regression_loader(NUM_BATCHES))
    return {"params": weights(module), "grads": grads.grads, "steps": trainer.global_step}


@pytest.mark.parametrize("model", list(MODELS))
def test_every_position_of_a_sequential_is_a_block(model):
    """The chain runs what the model's own forward runs: each position, a repeated module at each."""
    net = MODELS[model][0]()
    if isinstance(net, nn.Sequential):
        assert len(sequential_chain(net).blocks) == len(net) > len(list(net.children()))
    chain = net.layer_chain() if isinstance(net, SharedInChain) else sequential_chain(net)
    x = torch.randn(4, 6)
    assert torch.equal(chain.forward(x), net(x))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("model", list(MODELS))
def test_positions_in_several_units_are_refused_before_any_work(tmp_path, model, path):
    module = start(model)
    before = weights(module)
    trainer = make_trainer(PATHS[path](), K, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="tied weights across units") as info:
        trainer.fit(module, regression_loader(NUM_BATCHES))
    message = str(info.value)
    _, where, size = MODELS[model]
    assert where in message, message
    assert "Fix:" in message and "copy.deepcopy" in message and f"layers_per_unit={size} " in message, message
    assert trainer.global_step == 0
    assert max_abs_diff(weights(module), before) == 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return {model: fit("auto", model, tmp_path_factory.mktemp(model)) for model in MODELS}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("model", list(MODELS))
def test_positions_in_one_unit_are_exact(tmp_path, reference, model, path):
    """The refusal's ``layers_per_unit`` trains it: the shared module's gradient sums over its positions."""
    ref = reference[model]
    got = fit(PATHS[path](layers_per_unit=MODELS[model][2]), model, tmp_path)
    assert got["steps"] == ref["steps"] == 6
    assert max_abs_diff(ref["params"], weights(start(model))) > 1e-3, "the weights must move to mean anything"
    assert max_abs_diff(got["params"], ref["params"]) <= 1e-5
    assert len(got["grads"]) == len(ref["grads"]) == 6
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        assert g.keys() == r.keys(), step
        assert max_abs_diff(g, r) <= 1e-5, step


class Evaluated(Net):
    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("val_loss", loss)
        return loss


@pytest.mark.parametrize("path", list(PATHS))
def test_an_evaluation_refuses_positions_in_several_units_too(tmp_path, path):
    """``validate`` alone (no fit) checks the same: the tensor manager computed NaN losses with a parameter
    laid out in two units (and the shorter network before every position was a block)."""
    L.seed_everything(0, verbose=False)
    module = Evaluated(repeated_block)
    trainer = make_trainer(PATHS[path](), K, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"units\): at block 1, block 2, block 3 and block 4 of Evaluated.net"):
        trainer.validate(module, regression_loader(2), verbose=False)

    def validate(strategy: Any) -> float:
        trainer = make_trainer(strategy, K, default_root_dir=tmp_path)
        return trainer.validate(module, regression_loader(2), verbose=False)[0]["val_loss"]

    assert abs(validate(PATHS[path](layers_per_unit=5)) - validate("auto")) <= 1e-6
