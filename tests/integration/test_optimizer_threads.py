"""The optimizer lane's intra-op threads, planned from the machine: one on a CPU run (the model's
kernels use every core there), with a GPU (here the simulated device, which stands for one) the cores the
training thread and the I/O threads do not need; ``offload.optimizer_threads`` overrides it. The plans
measure the optimizer's rate at the count the lane really gets."""

from __future__ import annotations

import threading
from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.offload.device import SIMULATE_ENV
from lightning_greedysnake.optim.lane import StepLane
from lightning_greedysnake.planner import measure
from lightning_greedysnake.planner.threads import optimizer_threads
from lightning_greedysnake.strategy import setup_context
from lightning_greedysnake.strategy.planning import measurements
from tests.integration.test_equivalence import run

CORES = 16
"""The machine the tests pretend to be (the CI machine has 2 cores: 1 either way)."""


def test_the_planned_count_follows_the_machine():
    assert optimizer_threads(16, device_tier=False) == 1  # compute shares the cores
    assert optimizer_threads(16, device_tier=True) == 14  # less the training thread's and the I/O's
    assert optimizer_threads(16, device_tier=True, local_processes=4) == 2  # a quarter of the node each
    assert optimizer_threads(2, device_tier=True) == 1  # never less than one
    assert optimizer_threads(16, device_tier=True, given=3) == optimizer_threads(16, device_tier=False, given=3) == 3


def test_the_lane_runs_its_jobs_with_its_threads():
    seen: list[int] = []
    lane = StepLane(lag=1, threads=3)
    try:
        lane.submit(lambda: seen.append(torch.get_num_threads()), heavy=True)
        lane.drain()
    finally:
        lane.close()
    assert seen == [3]


def test_the_rate_is_measured_at_the_threads_given_on_a_thread_of_its_own():
    seen: list[tuple[int, str]] = []

    class Recording(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:
            seen.append((torch.get_num_threads(), threading.current_thread().name))
            return super().step(closure)

    user = Recording([torch.nn.Parameter(torch.zeros(4))], lr=1e-3)
    assert measure.optimizer_rate(1 << 10, repeats=1, optimizer=user, threads=2) > 0
    assert seen and all(s[0] == 2 and s[1].startswith("greedysnake-optimizer-rate") for s in seen)


class LaneThreads(L.Callback):
    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.threads = trainer.strategy.tensor_manager.optimizer_threads


@pytest.fixture
def sixteen_cores(monkeypatch):
    monkeypatch.setattr(setup_context, "available_cores", lambda: CORES)
    rates: list[int | None] = []
    real = measure.optimizer_rate

    def recording(*args: Any, threads: int | None = None, **kwargs: Any) -> float:
        rates.append(threads)
        return real(*args, threads=threads, **kwargs)

    monkeypatch.setattr(measurements, "optimizer_rate", recording)  # (every rate a run measures goes through it)
    return rates


@pytest.mark.parametrize(("simulated", "given", "expected"), [(False, None, 1), (True, None, CORES - 2), (True, 3, 3)],
                         ids=["cpu", "simulated_device", "given"])
def test_the_lane_gets_the_planned_threads_and_the_plans_measure_at_them(monkeypatch, sixteen_cores, simulated,
                                                                            given, expected):
    if simulated:
        monkeypatch.setenv(SIMULATE_ENV, "1")
    else:
        monkeypatch.delenv(SIMULATE_ENV, raising=False)
    seen = LaneThreads()
    # auto=True: the unit size is planned at setup and alpha/lag after the warm step, both on the optimizer's
    # rate, measured once (at setup) for the two
    run(GreedySnakeStrategy(offload={"optimizer_threads": given}), "gpt", 3, callbacks=(seen,))
    assert seen.threads == expected
    # the lane's rate; on a CPU run (the lane shares the training's cores) also a synchronous step's, on the
    # training thread with its own threads (None)
    lane_rates = [threads for threads in sixteen_cores if threads is not None]
    assert lane_rates == [expected]
    assert sixteen_cores.count(None) == (0 if simulated else 1)
