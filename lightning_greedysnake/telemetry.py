"""Per-step telemetry of the tensor manager: busy seconds per lane, bytes per kind, and the optimizer
time the training thread could not hide. Pure bookkeeping over the manager's counters."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from lightning_greedysnake.offload.stats import IOStats, RequestCounter
from lightning_greedysnake.planner.measure import is_backward_op


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
    tokens: int = 0
    """Tokens (elements of the model's integer inputs) the step's micro-batches fed the model."""
    host_registrations: int = 0
    """Page-lock registrations of host memory (``cudaHostRegister``) in this step: the staging pool's
    segments and the host tiers' regions, in the first steps; none in the steady state."""
    optimizer_cpu_s: float = 0.0
    """CPU seconds of the optimizer's jobs (their threads' own): ``optimizer_busy_s`` is wall time, waits
    included."""
    optimizer_read_wait_s: float = 0.0
    """Wall seconds an optimizer job on the lane waited for its reads (master weights, state) to land."""
    disk_busy_s: float = 0.0
    """Wall seconds in which the disk had at least one request in flight (reads or writes); the rest of
    ``wall_s`` it idled."""
    disk_read_busy_s: float = 0.0
    disk_write_busy_s: float = 0.0
    read_requests: int = 0
    write_requests: int = 0
    request_bytes_read: int = 0
    request_bytes_written: int = 0
    request_seconds: float = 0.0
    """The requests' durations added (reads and writes): over ``disk_busy_s``, the mean queue depth."""
    forward_s: float = 0.0
    """Wall seconds from the step's start to its first backward op (the compute lane's): the vertical
    schedule's forward phase, in which the previous step's deferred (alpha) parts are stepped; the rest of
    ``wall_s`` is the backward and the step's end. (The horizontal schedule's: its first micro-batch's
    forward.) ``wall_s`` where no backward op was timed."""
    forward_disk_busy_s: float = 0.0
    """Of ``disk_busy_s``, the seconds within the forward phase."""
    forward_io_wait_s: float = 0.0
    """Wall seconds the training thread waited on reads within the forward phase."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ssd_gb_per_s(self) -> float:
        moved = sum(self.bytes_read.values()) + sum(self.bytes_written.values())
        return moved / 1e9 / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def disk_busy_fraction(self) -> float:
        """The fraction of the step in which the disk had a request in flight."""
        return self.disk_busy_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def forward_disk_busy_fraction(self) -> float:
        """The fraction of the forward phase in which the disk had a request in flight."""
        return self.forward_disk_busy_s / self.forward_s if self.forward_s > 0 else 0.0

    @property
    def backward_disk_busy_fraction(self) -> float:
        """Likewise, of the rest of the step (the backward and the step's end)."""
        rest = self.wall_s - self.forward_s
        return (self.disk_busy_s - self.forward_disk_busy_s) / rest if rest > 0 else 0.0

    @property
    def read_gb_per_s_busy(self) -> float:
        """The read bandwidth achieved while reads were in flight (to set against the probe's)."""
        return self.request_bytes_read / 1e9 / self.disk_read_busy_s if self.disk_read_busy_s > 0 else 0.0

    @property
    def write_gb_per_s_busy(self) -> float:
        return self.request_bytes_written / 1e9 / self.disk_write_busy_s if self.disk_write_busy_s > 0 else 0.0

    @property
    def queue_depth(self) -> float:
        """Requests in flight on average while any was."""
        return self.request_seconds / self.disk_busy_s if self.disk_busy_s > 0 else 0.0

    @property
    def mean_request_bytes(self) -> float:
        n = self.read_requests + self.write_requests
        return (self.request_bytes_read + self.request_bytes_written) / n if n else 0.0

    def as_metrics(self) -> dict[str, float]:
        names = ("tokens_per_s", "ssd_gb_per_s", "wall_s", "compute_s", "ssd_read_busy_s", "ssd_write_busy_s",
                 "optimizer_busy_s", "io_wait_s", "optimizer_unhidden_s", "host_registrations", "optimizer_cpu_s",
                 "optimizer_read_wait_s", "disk_busy_s", "disk_busy_fraction", "read_gb_per_s_busy",
                 "write_gb_per_s_busy", "queue_depth", "mean_request_bytes", "forward_s", "forward_disk_busy_fraction",
                 "backward_disk_busy_fraction", "forward_io_wait_s")
        out: dict[str, float] = {name: float(getattr(self, name)) for name in names}
        out.update({f"read_bytes/{k}": float(v) for k, v in self.bytes_read.items()})
        out.update({f"written_bytes/{k}": float(v) for k, v in self.bytes_written.items()})
        return out


class Observed(Protocol):
    """What the recorder reads: the tensor manager's running counters."""

    @property
    def stats(self) -> IOStats: ...

    @property
    def optimizer_wait_seconds(self) -> float:
        """Seconds the training thread spent blocked on the optimizer lane, since construction."""

    @property
    def host_registrations(self) -> int:
        """Page-lock registrations of host memory since construction."""


class StepRecorder:
    """Turns the manager's running counters into :class:`StepTelemetry` at each optimizer step."""

    def __init__(self, manager: Observed, keep: int = 1000) -> None:
        self.manager = manager
        self.keep = keep
        self.history: list[StepTelemetry] = []
        self._t = time.perf_counter()
        self._counters = manager.stats.snapshot()
        self._lane_wait = manager.optimizer_wait_seconds
        self._registrations = manager.host_registrations
        self._requests = manager.stats.requests()
        self._job_cpu = manager.stats.job_cpu_seconds
        self._step = 0
        self.tokens = 0
        """Tokens fed to the model since the last step (the strategy adds them as it sees inputs)."""
        self.trace_steps = 0
        self.trace_path: Path | None = None
        self._trace_start: float | None = None

    def start_trace(self, steps: int, path: Path) -> None:
        """Keep every interval of the next ``steps`` steps and write them as a Chrome trace to ``path``."""
        self.trace_steps, self.trace_path = steps, path
        self._trace_start = time.perf_counter()
        self.manager.stats.lanes.keep_all = True

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
        unhidden = self.manager.optimizer_wait_seconds - self._lane_wait
        wall = now - self._t
        requests, job_cpu = stats.requests(), stats.job_cpu_seconds
        none = RequestCounter()

        def moved(op: str, attr: str) -> Any:
            return getattr(requests.get(op, none), attr) - getattr(self._requests.get(op, none), attr)
        self._step += 1
        backward_from = first_backward_op(lanes.spans(self._t, now).get("compute", []), self._t, now)
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
            tokens=self.tokens,
            host_registrations=self.manager.host_registrations - self._registrations,
            optimizer_cpu_s=job_cpu - self._job_cpu,
            optimizer_read_wait_s=lanes.busy("optimizer_wait", self._t, now),
            disk_busy_s=lanes.busy(("disk_read", "disk_write"), self._t, now),
            disk_read_busy_s=lanes.busy("disk_read", self._t, now),
            disk_write_busy_s=lanes.busy("disk_write", self._t, now),
            read_requests=moved("read", "count"),
            write_requests=moved("write", "count"),
            request_bytes_read=moved("read", "nbytes"),
            request_bytes_written=moved("write", "nbytes"),
            request_seconds=moved("read", "seconds") + moved("write", "seconds"),
            forward_s=backward_from - self._t,
            forward_disk_busy_s=lanes.busy(("disk_read", "disk_write"), self._t, backward_from),
            forward_io_wait_s=lanes.busy("wait", self._t, backward_from),
        )
        self._requests, self._job_cpu = requests, job_cpu
        self.tokens = 0
        self._t, self._counters, self._lane_wait = now, counters, self.manager.optimizer_wait_seconds
        self._registrations += entry.host_registrations
        self.history.append(entry)
        del self.history[: -self.keep]
        if self.trace_path is not None and self._trace_start is not None and self._step >= self.trace_steps:
            spans = self.manager.stats.lanes.spans(self._trace_start, now)
            write_chrome_trace(spans, self._trace_start, self.trace_path)
            self.manager.stats.lanes.keep_all = False
            self._trace_start = None
        return entry


def first_backward_op(compute: list[tuple[float, float, str]], since: float, until: float) -> float:
    """The start of the first backward op (:func:`~lightning_greedysnake.planner.measure.is_backward_op`) of
    the compute lane in ``[since, until]``; ``until`` where there is none."""
    return min((start for start, _, name in compute if start >= since and is_backward_op(name)), default=until)


LANE_ORDER = ("compute", "wait", "optimizer", "optimizer_wait", "ssd_read", "ssd_write", "disk_read", "disk_write")


def write_chrome_trace(spans: dict[str, list[tuple[float, float, str]]], origin: float, path: Path) -> None:
    """Write ``spans`` (per lane: start, end, name in ``perf_counter`` seconds) as a Chrome trace (the
    JSON event format Perfetto and chrome://tracing open): one track per lane, complete ("X") events in
    microseconds from ``origin``."""
    lanes = sorted(spans, key=lambda lane: (LANE_ORDER.index(lane) if lane in LANE_ORDER else 99, lane))
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "greedysnake"}}
    ]
    for tid, lane in enumerate(lanes, start=1):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}})
        for start, end, name in spans[lane]:
            events.append({
                "name": name or lane, "cat": lane, "ph": "X", "pid": 0, "tid": tid,
                "ts": round((start - origin) * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3),
            })
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
