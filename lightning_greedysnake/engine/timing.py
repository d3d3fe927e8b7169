"""Compute spans timed where the compute runs: the spans the warm-step plan takes each unit's forward and
backward seconds from (:func:`~lightning_greedysnake.planner.measure.unit_times`) and the trace shows.

On CUDA a host clock around an op measures its kernel launches, not its kernels: :class:`CudaTimer`
records a pair of timing events on the compute stream around each op and reads their ``elapsed_time``
once per window (:meth:`ComputeTimer.collect`), only for the spans whose end event the device has passed
(``query``, no sync); the rest wait for the next window. On the CPU (and the simulated device, whose
compute is the host) :class:`HostTimer` keeps ``perf_counter``.

Threads: the training thread only (it runs the ops and ends the windows).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lightning_greedysnake.offload.device import named_sync

Sink = Callable[[str, float, float], None]
"""Where finished spans go: ``(op name, start, end)`` in ``time.perf_counter`` seconds (the compute lane)."""


class ComputeTimer(Protocol):
    """Times spans of the compute stream's work (the narrow interface the plan reads compute through)."""

    def start(self) -> Any:
        """A mark at the compute stream's current point."""

    def stop(self, mark: Any, name: str) -> None:
        """The span from ``mark`` to the compute stream's current point is op ``name``."""

    def collect(self, wait: bool = False) -> None:
        """Hand the finished spans to the sink, in order (once per window). ``wait``: every span, waiting
        for the device (once, for the warm-step plan)."""


class HostTimer:
    """Host clocks: right where the host runs the compute (the CPU, the simulated device)."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, mark: float, name: str) -> None:
        self._sink(name, mark, time.perf_counter())

    def collect(self, wait: bool = False) -> None:
        pass  # (every span went to the sink as it ended)


class CudaTimer:
    """CUDA timing events on the compute stream (see the module's docstring). A span is placed on the
    host timeline at its launch, with the device's duration."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._pending: deque[tuple[str, float, Any, Any]] = deque()
        """(name, host launch time, start event, end event) of the spans not read yet, in stream order."""

    def start(self) -> tuple[float, Any]:
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # (the current stream: the training thread's compute stream)
        return time.perf_counter(), event

    def stop(self, mark: tuple[float, Any], name: str) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((name, mark[0], mark[1], end))

    def collect(self, wait: bool = False) -> None:
        if wait and self._pending:
            with named_sync("compute timings for the plan"):
                self._pending[-1][3].synchronize()  # (the last span's end: every earlier one is done too)
        while self._pending:
            name, launched, begin, end = self._pending[0]
            if not end.query():
                break  # (the device has not passed it: nor any later one; read at the next window)
            self._pending.popleft()
            self._sink(name, launched, launched + begin.elapsed_time(end) / 1e3)


def compute_timer_for(device: torch.device, sink: Sink) -> ComputeTimer:
    """CUDA events on a GPU, host clocks elsewhere."""
    return CudaTimer(sink) if device.type == "cuda" else HostTimer(sink)
