"""The schedule is planned at setup where the user leaves it unset (``schedule=None``, ``auto=True``): on a
CPU run whose placement keeps every kind in host memory nothing moves per micro-batch, so the run takes the
horizontal order (one micro-batch's activations alive at a time, as in Lightning) instead of the vertical
one (K micro-batches' graphs or checkpoints); wherever state streams from SSD, or with ``auto=False``, or
where the user chose, the order is the one given or the vertical default. Every planned order trains as
Lightning does."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import GreedySnakeConfig, OffloadConfig
from lightning_greedysnake.schedule import ScheduleKind
from tests.integration.test_equivalence import assert_matches, reference, run

ROOMY = 1 << 30
"""A host budget that holds the tiny model's whole state: the planner keeps every kind in RAM."""


class Order(L.Callback):
    """The order the engine ran the windows in (and the strategy reports)."""

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.schedule = trainer.strategy.engine.config.schedule
        self.lag = trainer.strategy.tensor_manager.stepper.lane.lag
        assert trainer.strategy.config.schedule is self.schedule


@pytest.mark.parametrize(("k", "lag"), [(1, None), (3, None), (3, 0), (3, 2)])
def test_defaults_with_state_in_ram_run_horizontally_and_match_lightning(k, lag, caplog):
    """Unset lag: the warm-step plan's (on this CPU, where the lane shares the training's cores and there
    is no I/O to hide, the synchronous step); given: the step in line (0) or two units behind (2)."""
    order = Order()
    with caplog.at_level("INFO"):
        got = run(GreedySnakeStrategy(auto_host_budget_bytes=ROOMY, lag=lag), "gpt", k, callbacks=(order,))
    assert order.schedule is ScheduleKind.HORIZONTAL
    assert lag is None or order.lag == lag
    assert "greedysnake schedule: horizontal" in caplog.text
    assert_matches(got, reference("gpt", k))  # weights, losses and every window's gradients


@pytest.mark.parametrize("settings", [
    {"offload": {"optimizer_states": "ssd"}},  # state streams: the vertical order reads it once a window
    {"auto": False, "offload": OffloadConfig.everywhere("host")},  # nothing planned: the fixed default
    {"schedule": "vertical"},  # the user's choice stands
], ids=["state-on-ssd", "auto-false", "given"])
def test_the_vertical_order_where_state_streams_or_is_chosen(settings, caplog):
    order = Order()
    with caplog.at_level("INFO"):
        got = run(GreedySnakeStrategy(auto_host_budget_bytes=ROOMY, **settings), "gpt", 3, callbacks=(order,))
    assert order.schedule is ScheduleKind.VERTICAL
    assert "greedysnake schedule: horizontal" not in caplog.text
    assert_matches(got, reference("gpt", 3))


def test_an_unset_schedule_resolves_to_vertical_unplanned():
    assert GreedySnakeConfig().schedule is None and "schedule" in GreedySnakeConfig().unset()
    assert GreedySnakeConfig().resolved().schedule is ScheduleKind.VERTICAL
    assert GreedySnakeConfig(schedule="horizontal").resolved().schedule is ScheduleKind.HORIZONTAL
