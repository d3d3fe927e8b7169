"""The roofline's traffic model against the tensor manager's own byte counters, term by term."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.planner import traffic
from lightning_greedysnake.strategy.planning.placement import unit_costs
from tests.helpers import TinyGPTModule, make_trainer, token_loader

STEPS = 3


class Counters(L.Callback):
    def on_train_end(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        manager.drain()
        self.units = unit_costs(manager)
        self.stats = manager.stats.copy()


FROZEN = {"frozen": True}
"""Not an offload setting: the model's MLPs and token embedding frozen (every kind on SSD)."""

SPLIT = {kind: {"host": share, "ssd": 1 - share} for kind, share in
         (("weights", 0.4), ("master_weights", 0.5), ("optimizer_states", 0.4), ("gradients", 0.5))}


@pytest.mark.parametrize("schedule,k,alpha,precision,clip,offload", [
    ("vertical", 1, 0.0, "32-true", False, None),
    ("vertical", 3, 0.0, "32-true", False, None),
    ("vertical", 3, 0.5, "32-true", False, None),
    ("vertical", 3, 0.5, "bf16-mixed", False, None),
    ("vertical", 3, 0.25, "32-true", True, None),
    ("horizontal", 1, 0.0, "32-true", False, None),
    ("horizontal", 3, 0.5, "32-true", False, None),
    ("horizontal", 3, 0.5, "bf16-mixed", False, None),
    ("vertical", 3, 0.25, "bf16-mixed", False, SPLIT),  # some units of every kind in RAM
    ("horizontal", 3, 0.5, "32-true", False, SPLIT),
    ("vertical", 3, 0.25, "bf16-mixed", False, {"optimizer_state_dtype": "bfloat16"}),
    # frozen MLPs (issue 70): a step writes each unit's trained prefix of its weights, reads the whole region
    ("vertical", 3, 0.5, "32-true", False, FROZEN),
    ("vertical", 3, 0.5, "bf16-mixed", False, FROZEN),
    ("vertical", 3, 0.25, "32-true", True, FROZEN),
    ("horizontal", 3, 0.5, "bf16-mixed", False, FROZEN),
])
def test_predicted_bytes_equal_the_counters(schedule, k, alpha, precision, clip, offload):
    counters = Counters()
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=3, lr=1e-3)
    if offload is FROZEN:
        offload = None
        for name, p in module.named_parameters():
            p.requires_grad_(".mlp." not in name and "wte" not in name)
        frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
        assert frozen * 2 > sum(p.numel() for p in module.parameters())
    trainer = make_trainer(GreedySnakeStrategy(auto=False, schedule=schedule, alpha=alpha, offload=offload), k, max_epochs=1,
                           precision=precision, callbacks=[counters],
                           **({"gradient_clip_val": 0.05} if clip else {}))
    trainer.fit(module, token_loader(STEPS * k))
    assert trainer.global_step == STEPS
    units = counters.units
    sizes = {"weights": "weight_bytes", "master_weights": "master_bytes", "optimizer_states": "state_bytes",
             "gradients": "grad_bytes"}
    if offload is SPLIT:  # every kind that has bytes really split: some units in RAM, some on SSD
        for kind in SPLIT:
            tiers = {kind in u.on_ssd for u in units if getattr(u, sizes[kind])}
            assert tiers in (set(), {True, False}), kind
    if module.model.wte.weight.requires_grad is False:  # (FROZEN) the frozen bytes are most of the weights
        assert 0 < sum(u.written_weight_bytes for u in units) < 0.6 * sum(u.weight_bytes for u in units)
    model = traffic(units, schedule, k, clip_norm=clip)

    def on_ssd(kind: str, size: str) -> int:
        return sum(getattr(u, size) for u in units if kind in u.on_ssd)

    initial = {"write/weights": on_ssd("weights", "weight_bytes"),
               "write/master_weights": on_ssd("master_weights", "master_bytes")}
    first_step_unread = {"read/optimizer_states": on_ssd("optimizer_states", "state_bytes")}
    if not clip and "weights" in units[0].on_ssd:  # no step before the first forward kept unit 0's weights
        first_step_unread["read/weights"] = -units[0].weight_bytes
    names = set(model.terms) | {f"{op}/{kind}" for kind, _ in counters.stats.snapshot() for op in ("read", "write")}
    for name in sorted(names):
        op, kind = name.split("/")
        measured = counters.stats.bytes_read(kind) if op == "read" else counters.stats.bytes_written(kind)
        expected = STEPS * model.terms.get(name, 0) + initial.get(name, 0) - first_step_unread.get(name, 0)
        assert measured == expected, (name, measured, expected)
