"""Recomputation is exact: with dropout, a unit recomputed in backward draws the masks of its forward."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig

# recompute=False keeps every unit's autograd graph from its forward to its backward
KEEP_GRAPHS = {"recompute": False, "offload": OffloadConfig.everywhere("device")}
from tests.helpers import TinyGPTModule, make_trainer, max_abs_diff, token_loader


def train(strategy: Any, dropout: float, k: int = 3) -> dict:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=4, dropout=dropout, lr=3e-3)
    make_trainer(strategy, k, max_epochs=1).fit(module, token_loader(7))
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("layers_per_unit", [1, 2])
def test_recomputed_dropout_masks_equal_the_forward(schedule, layers_per_unit):
    settings = {"schedule": schedule, "layers_per_unit": layers_per_unit}
    kept = train(GreedySnakeStrategy(auto=False, **KEEP_GRAPHS, **settings), dropout=0.3)
    recomputed = train(GreedySnakeStrategy(auto=False, recompute=True, **settings), dropout=0.3)  # offloaded to SSD
    assert max_abs_diff(kept, recomputed) <= 1e-6
    # and dropout really was on: without it training lands elsewhere
    assert max_abs_diff(recomputed, train(GreedySnakeStrategy(auto=False, **settings), dropout=0.0)) > 1e-3


def test_recompute_does_not_disturb_later_random_draws():
    """Replaying a unit's RNG state must leave the global generator where the forward left it: the
    vertical order with recompute consumes exactly the draws of the stored-graph run."""
    import torch

    states = []
    for settings in (KEEP_GRAPHS, {"recompute": True}):
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(n_layer=3, dropout=0.3)
        make_trainer(GreedySnakeStrategy(auto=False, **settings), 2, max_epochs=1).fit(module, token_loader(4))
        states.append(torch.get_rng_state())
    assert torch.equal(states[0], states[1])


@pytest.mark.parametrize(
    "settings",
    [{}, {"schedule": "horizontal"}, {"layers_per_unit": 2}, {"alpha": 0.5, "lag": 0}],
    ids=["vertical", "horizontal", "two_blocks_per_unit", "alpha_sync"],
)
def test_kept_graphs_with_weights_on_ssd_equal_resident(settings):
    """recompute=False with the weights offloaded: autograd saves views of the weights (``weight.t()``
    for a matmul), whose buffers the tensor manager hands to other units between a unit's forward and
    its backward. They are kept as references and rebuilt from the re-acquired weights; without that,
    the backward silently reads other units' weights (about 1e-2 off here)."""
    resident = train(GreedySnakeStrategy(auto=False, **KEEP_GRAPHS, **settings), dropout=0.2)
    on_ssd = train(GreedySnakeStrategy(auto=False, recompute=False, **settings), dropout=0.2)
    assert max_abs_diff(resident, on_ssd) == 0.0
    # and equal to recomputing from checkpoints, the same masks drawn once
    assert max_abs_diff(on_ssd, train(GreedySnakeStrategy(auto=False, recompute=True, **settings), dropout=0.2)) <= 1e-6


@pytest.mark.parametrize(
    "settings",
    [{}, {"schedule": "horizontal"}, {"layers_per_unit": 2}, {"alpha": 0.5, "lag": 0}],
    ids=["vertical", "horizontal", "two_blocks_per_unit", "alpha_sync"],
)
def test_kept_graphs_on_ssd_equal_kept_in_memory(settings, tmp_path):
    """recompute=False with saved activations on SSD: each kept graph's saved tensors (all but the weights'
    views) are written as one blob in the forward and read back for the backward, in their own layout: the
    same bytes computed on, so the run equals the graphs held in memory bit for bit, and the bytes went to SSD
    (more than the units' inputs alone, which is what recomputing writes)."""
    def run(activations: str) -> tuple[dict, dict]:
        strategy = GreedySnakeStrategy(auto=False, recompute=False, offload_dir=tmp_path / activations,
                                       offload=OffloadConfig.everywhere("ssd", activations=activations),
                                       **settings)
        return train(strategy, dropout=0.2), strategy.io_stats()

    held, _ = run("host")
    on_ssd, stats = run("ssd")
    assert max_abs_diff(held, on_ssd) == 0.0
    written = stats["ssd/activations/bytes_written"]
    # TinyGPT: 4 blocks of width 16, micro-batches of 2 x 8 tokens, K=3, 7 batches (two windows and a short one)
    inputs = 7 * (4 - 1) * 2 * 8 * 16 * 4
    assert written > 3 * inputs, (written, inputs)
    assert stats["ssd/activations/bytes_read"] >= written
