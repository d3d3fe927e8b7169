"""The compute spans the warm-step plan takes its unit times from come from the device timer interface
(:class:`~lightning_greedysnake.engine.timing.ComputeTimer`): CUDA timing events on a GPU (a host clock
around a launch measures the launch), host clocks on the CPU and the simulated device."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.engine.timing import CudaTimer, HostTimer, compute_timer_for
from lightning_greedysnake.offload.device import SIMULATE_ENV
from lightning_greedysnake.strategy import run as run_module
from tests.integration.test_equivalence import run

SPAN_S = 0.125
"""What the stand-in device timer says every op took (no host clock gives exactly that)."""


class DeviceTimer:
    """A device timer as the plan sees it: spans handed over only at :meth:`collect`, each ``SPAN_S``."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.pending: list[tuple[str, float]] = []
        self.collected_with_wait: list[bool] = []

    def start(self) -> float:
        import time

        return time.perf_counter()

    def stop(self, mark: float, name: str) -> None:
        self.pending.append((name, mark))

    def collect(self, wait: bool = False) -> None:
        self.collected_with_wait.append(wait)
        for name, mark in self.pending:
            self.sink(name, mark, mark + SPAN_S)
        self.pending.clear()


class Seen(L.Callback):
    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.planner = trainer.strategy._run.planner


def test_the_plan_reads_its_compute_from_the_device_timer(monkeypatch):
    monkeypatch.setenv(SIMULATE_ENV, "1")
    timers: list[DeviceTimer] = []

    def device_timer(device: torch.device, sink: Any) -> DeviceTimer:
        timers.append(DeviceTimer(sink))
        return timers[-1]

    monkeypatch.setattr(run_module, "compute_timer_for", device_timer)
    seen = Seen()
    run(GreedySnakeStrategy(layers_per_unit=1), "gpt", 3, callbacks=(seen,))  # auto=True: alpha and lag planned
    assert len(timers) == 1
    fwd, bwd = seen.planner.unit_seconds
    assert fwd == pytest.approx([SPAN_S] * len(fwd)) and bwd == pytest.approx([SPAN_S] * len(bwd))
    assert True in timers[0].collected_with_wait  # (every span read for the plan: its one wait)
    assert timers[0].collected_with_wait.count(False) >= 1  # (the other windows: no wait)


def test_the_timer_follows_the_device():
    assert isinstance(compute_timer_for(torch.device("cpu"), lambda *a: None), HostTimer)
    assert isinstance(compute_timer_for(torch.device("cuda"), lambda *a: None), CudaTimer)


class _Event:
    clock = 0.0
    synchronized = 0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None
        self.done = True

    def record(self, stream: Any = None) -> None:
        _Event.clock += 1.0
        self.at = _Event.clock

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        _Event.synchronized += 1

    def elapsed_time(self, end: _Event) -> float:
        assert self.done and end.done, "elapsed_time of an event the device has not passed: CUDA raises"
        return (end.at - self.at) * 1000.0  # ms


def test_cuda_spans_are_read_from_events_once_the_device_passed_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    spans: list[tuple[str, float]] = []
    timer = CudaTimer(lambda name, a, b: spans.append((name, round(b - a, 6))))
    first = timer.start()
    timer.stop(first, "F0.0")  # 1 "second" of device time between the two events
    second = timer.start()
    timer.stop(second, "F0.1")
    timer._pending[-1][3].done = False  # the device has not reached the second span's end yet
    timer.collect()
    assert spans == [("F0.0", 1.0)] and _Event.synchronized == 0  # no wait: the rest at the next window
    timer._pending[-1][3].done = True
    timer.collect(wait=True)
    assert spans == [("F0.0", 1.0), ("F0.1", 1.0)] and _Event.synchronized == 1
