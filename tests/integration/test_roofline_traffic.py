"""The roofline's traffic model against the tensor manager's own byte counters, term by term."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.planner import traffic
from lightning_greedysnake.planner.measure import unit_costs
from tests.helpers import TinyGPTModule, make_trainer, token_loader

STEPS = 3


class Counters(L.Callback):
    def on_train_end(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        manager.drain()
        self.units = unit_costs(manager)
        self.stats = manager.stats.copy()


@pytest.mark.parametrize("schedule,k,alpha,precision,clip", [
    ("vertical", 1, 0.0, "32-true", False),
    ("vertical", 3, 0.0, "32-true", False),
    ("vertical", 3, 0.5, "32-true", False),
    ("vertical", 3, 0.5, "bf16-mixed", False),
    ("vertical", 3, 0.25, "32-true", True),
    ("horizontal", 1, 0.0, "32-true", False),
    ("horizontal", 3, 0.5, "32-true", False),
    ("horizontal", 3, 0.5, "bf16-mixed", False),
])
def test_predicted_bytes_equal_the_counters(schedule, k, alpha, precision, clip):
    counters = Counters()
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(schedule=schedule, alpha=alpha), k, max_epochs=1,
                           precision=precision, callbacks=[counters],
                           **({"gradient_clip_val": 0.05} if clip else {}))
    trainer.fit(TinyGPTModule(n_layer=3, lr=1e-3), token_loader(STEPS * k))
    assert trainer.global_step == STEPS
    model = traffic(counters.units, schedule, k, clip_norm=clip)
    initial = {"write/weights": sum(u.weight_bytes for u in counters.units),
               "write/master_weights": sum(u.master_bytes for u in counters.units)}
    first_step_unread = {"read/optimizer_states": sum(u.state_bytes for u in counters.units)}
    if not clip:  # no step before the first forward left unit 0's weights in memory
        first_step_unread["read/weights"] = -counters.units[0].weight_bytes
    names = set(model.terms) | {f"{op}/{kind}" for kind, _ in counters.stats.snapshot() for op in ("read", "write")}
    for name in sorted(names):
        op, kind = name.split("/")
        measured = counters.stats.bytes_read(kind) if op == "read" else counters.stats.bytes_written(kind)
        expected = STEPS * model.terms.get(name, 0) + initial.get(name, 0) - first_step_unread.get(name, 0)
        assert measured == expected, (name, measured, expected)
