"""Per-step telemetry of the tensor manager: busy seconds per lane, bytes per kind, and the optimizer
time the training thread could not hide. Pure bookkeeping over the manager's counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepTelemetry:
    """One optimizer step, from the previous step's end to this one's (the background optimizer of the
    previous step overlaps this interval, as it overlaps this step's forward)."""

    step: int
    wall_s: float
    compute_s: float
    """Wall time the training thread was not blocked on SSD reads or on the optimizer."""
    ssd_read_busy_s: float
    ssd_write_busy_s: float
    optimizer_busy_s: float
    io_wait_s: float
    """Training thread blocked on SSD reads (what prefetch did not hide)."""
    optimizer_unhidden_s: float
    """Training thread blocked on the optimizer (a unit's update not finished when its forward came,
    a full queue, a drain): the optimizer time not hidden behind compute."""
    bytes_read: dict[str, int] = field(default_factory=dict)
    bytes_written: dict[str, int] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {
            "wall_s": self.wall_s,
            "compute_s": self.compute_s,
            "ssd_read_busy_s": self.ssd_read_busy_s,
            "ssd_write_busy_s": self.ssd_write_busy_s,
            "optimizer_busy_s": self.optimizer_busy_s,
            "io_wait_s": self.io_wait_s,
            "optimizer_unhidden_s": self.optimizer_unhidden_s,
        }
        out.update({f"read_bytes/{k}": float(v) for k, v in self.bytes_read.items()})
        out.update({f"written_bytes/{k}": float(v) for k, v in self.bytes_written.items()})
        return out


class StepRecorder:
    """Turns the manager's running counters into :class:`StepTelemetry` at each optimizer step."""

    def __init__(self, manager: Any, keep: int = 1000) -> None:
        self.manager = manager
        self.keep = keep
        self.history: list[StepTelemetry] = []
        self._t = time.perf_counter()
        self._counters = manager.stats.snapshot()
        self._lane_wait = manager.lane.wait_seconds
        self._step = 0

    def record(self) -> StepTelemetry:
        now = time.perf_counter()
        stats = self.manager.stats
        counters = stats.snapshot()
        lanes = stats.lanes

        def delta(attr: str) -> dict[str, int]:
            out = {}
            for (kind, tier), c in counters.items():
                before = self._counters.get((kind, tier))
                value = getattr(c, attr) - (getattr(before, attr) if before else 0)
                if value:
                    out[kind] = out.get(kind, 0) + value
            return out

        io_wait = sum(c.wait_seconds for c in counters.values()) - sum(c.wait_seconds for c in self._counters.values())
        unhidden = self.manager.lane.wait_seconds - self._lane_wait
        wall = now - self._t
        self._step += 1
        entry = StepTelemetry(
            step=self._step,
            wall_s=wall,
            compute_s=max(0.0, wall - io_wait - unhidden),
            ssd_read_busy_s=lanes.busy("ssd_read", self._t, now),
            ssd_write_busy_s=lanes.busy("ssd_write", self._t, now),
            optimizer_busy_s=lanes.busy("optimizer", self._t, now),
            io_wait_s=io_wait,
            optimizer_unhidden_s=unhidden,
            bytes_read=delta("bytes_read"),
            bytes_written=delta("bytes_written"),
        )
        self._t, self._counters, self._lane_wait = now, counters, self.manager.lane.wait_seconds
        self.history.append(entry)
        del self.history[: -self.keep]
        return entry
