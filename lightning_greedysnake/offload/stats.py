"""I/O counters per kind of tensor and tier: bytes and busy seconds, readable by the strategy each step."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class IOCounter:
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    wait_seconds: float = 0.0
    """Time the training thread spent blocked on this kind's reads (what prefetch did not hide)."""


@dataclass
class ReadOnlyCounter:
    """The bytes of a kind's transfers that fell in its regions' read-only part (issue 70: the frozen
    parameters past each unit's trained prefix of its weights), measured per transfer."""

    read_bytes: int = 0
    written_bytes: int = 0
    """Written by training (a step, a write-back): 0 unless a frozen byte was written."""
    placed_bytes: int = 0
    """Written by placing whole units' values (the initial placement, a checkpoint's load)."""


@dataclass
class RequestCounter:
    """The requests the disk was asked for (one ``preadv``/``pwritev`` each), in one direction."""

    count: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    """Their durations added: over the time any was in flight, the mean queue depth."""


class LaneClock:
    """Busy intervals per lane, to report how long each lane was busy in a span of wall time (overlapping
    intervals count once). Lanes: ``ssd_read``/``ssd_write`` (transfers, submission to completion),
    ``disk_read``/``disk_write`` (the requests in flight at the disk), ``optimizer`` (the lane's jobs),
    ``optimizer_wait`` (a job waiting on its reads), ``wait`` (the training thread waiting on reads),
    ``compute``."""

    def __init__(self, keep_seconds: float = 600.0) -> None:
        self._lock = threading.Lock()
        self._intervals: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
        self._keep = keep_seconds
        self.keep_all = False
        """Keep every interval (while a trace is being recorded) instead of the last ``keep_seconds``."""

    def add(self, lane: str, start: float, end: float, name: str = "") -> None:
        with self._lock:
            spans = self._intervals[lane]
            spans.append((start, end, name))
            if not self.keep_all and len(spans) > 4096 and spans[0][1] < end - self._keep:
                self._intervals[lane] = [s for s in spans if s[1] >= end - self._keep]

    def spans(self, since: float, until: float) -> dict[str, list[tuple[float, float, str]]]:
        """Every recorded interval overlapping ``[since, until]``, per lane."""
        with self._lock:
            return {lane: [s for s in spans if s[1] > since and s[0] < until]
                    for lane, spans in self._intervals.items()}

    def busy(self, lane: str | tuple[str, ...], since: float, until: float) -> float:
        """Seconds of ``[since, until]`` in which ``lane`` (any of several lanes) had an interval."""
        lanes = (lane,) if isinstance(lane, str) else lane
        with self._lock:
            spans = sorted((max(a, since), min(b, until)) for name in lanes
                           for a, b, _ in self._intervals.get(name, []) if b > since and a < until)
        total, covered = 0.0, since  # (spans by start: each adds what it covers past those before it)
        for a, b in spans:
            if b > covered:
                total += b - max(a, covered)
                covered = b
        return total


class IOStats:
    """Thread-safe: I/O threads record completions while the training thread reads snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], IOCounter] = defaultdict(IOCounter)
        self._by_directory: dict[str, IOCounter] = defaultdict(IOCounter)
        self._directories: dict[tuple[str, str], set[str]] = defaultdict(set)
        """Per (kind, tier), the offload directories its transfers went to (the end-of-fit summary's "where")."""
        self.lanes = LaneClock()
        self._requests: dict[str, RequestCounter] = defaultdict(RequestCounter)
        self._job_cpu_seconds = 0.0
        self._read_only: dict[tuple[str, str], ReadOnlyCounter] = {}
        """Per (kind, tier) whose regions have a read-only part (:meth:`track_read_only`)."""

    def track_read_only(self, kind: str, tier: str) -> None:
        """``kind``'s regions on ``tier`` have a read-only part: count what their transfers move of it (its
        counters exist from now on, zero until something moves)."""
        with self._lock:
            self._read_only.setdefault((kind, tier), ReadOnlyCounter())

    def record_read_only(self, kind: str, tier: str, op: str, nbytes: int, placing: bool = False) -> None:
        """``nbytes`` of one completed transfer fell in the read-only part of ``kind``'s region;
        ``placing``: a write that placed a whole unit's values (not training's)."""
        with self._lock:
            c = self._read_only.setdefault((kind, tier), ReadOnlyCounter())
            if op == "read":
                c.read_bytes += nbytes
            elif placing:
                c.placed_bytes += nbytes
            else:
                c.written_bytes += nbytes

    def read_only(self) -> dict[tuple[str, str], ReadOnlyCounter]:
        """Per (kind, tier) with a read-only part: what its transfers moved of it so far."""
        with self._lock:
            return {k: ReadOnlyCounter(**vars(c)) for k, c in self._read_only.items()}

    def record_request(self, op: str, start: float, end: float, nbytes: int) -> None:
        """One request the disk completed (the I/O engine's ``on_request``, on an I/O thread)."""
        self.lanes.add(f"disk_{op}", start, end)
        with self._lock:
            r = self._requests[op]
            r.count += 1
            r.nbytes += nbytes
            r.seconds += end - start

    def record_job(self, start: float, end: float, cpu_seconds: float) -> None:
        """One optimizer job (the lane's ``on_busy``): its wall interval and its thread's CPU seconds."""
        self.lanes.add("optimizer", start, end)
        with self._lock:
            self._job_cpu_seconds += cpu_seconds

    def requests(self) -> dict[str, RequestCounter]:
        """Per direction (``read``, ``write``), the disk's requests so far."""
        with self._lock:
            return {op: RequestCounter(**vars(r)) for op, r in self._requests.items()}

    @property
    def job_cpu_seconds(self) -> float:
        """The optimizer jobs' CPU seconds so far (their threads' own)."""
        with self._lock:
            return self._job_cpu_seconds

    def record(self, kind: str, tier: str, op: str, nbytes: int, seconds: float, start: float,
               directory: str) -> None:
        """One completed transfer; ``directory``: the offload directory it went to (counted per SSD too)."""
        self.lanes.add("ssd_read" if op == "read" else "ssd_write", start, start + seconds, f"{op} {kind}")
        with self._lock:
            self._directories[(kind, tier)].add(directory)
            for c in (self._counters[(kind, tier)], self._by_directory[directory]):
                if op == "read":
                    c.bytes_read += nbytes
                    c.reads += 1
                else:
                    c.bytes_written += nbytes
                    c.writes += 1

    def copy(self) -> IOStats:
        """A frozen copy (later I/O does not change it)."""
        out = IOStats()
        out._counters.update(self.snapshot())
        with self._lock:
            out._by_directory.update({d: IOCounter(**vars(c)) for d, c in self._by_directory.items()})
            out._directories.update({k: set(v) for k, v in self._directories.items()})
            out._requests.update({op: RequestCounter(**vars(r)) for op, r in self._requests.items()})
            out._job_cpu_seconds = self._job_cpu_seconds
            out._read_only.update({k: ReadOnlyCounter(**vars(c)) for k, c in self._read_only.items()})
        out.lanes = self.lanes
        return out

    def record_wait(self, kind: str, tier: str, seconds: float) -> None:
        with self._lock:
            self._counters[(kind, tier)].wait_seconds += seconds
        now = time.perf_counter()
        self.lanes.add("wait", now - seconds, now, f"wait {kind}")

    def snapshot(self) -> dict[tuple[str, str], IOCounter]:
        with self._lock:
            return {k: IOCounter(**vars(v)) for k, v in self._counters.items()}

    def by_directory(self) -> dict[str, tuple[int, int]]:
        """Per offload directory: (bytes read, bytes written) so far."""
        with self._lock:
            return {d: (c.bytes_read, c.bytes_written) for d, c in self._by_directory.items()}

    def directories(self, kind: str, tier: str = "ssd") -> list[str]:
        """The offload directories ``kind``'s transfers on ``tier`` went to so far, sorted."""
        with self._lock:
            return sorted(self._directories.get((kind, tier), ()))

    def bytes_read(self, kind: str, tier: str = "ssd") -> int:
        with self._lock:
            return self._counters[(kind, tier)].bytes_read if (kind, tier) in self._counters else 0

    def bytes_written(self, kind: str, tier: str = "ssd") -> int:
        with self._lock:
            return self._counters[(kind, tier)].bytes_written if (kind, tier) in self._counters else 0

    def flat(self) -> dict[str, float]:
        """``{"ssd/weights/bytes_read": ..., ...}``: for loggers."""
        out: dict[str, float] = {}
        for (kind, tier), c in sorted(self.snapshot().items()):
            for name, value in vars(c).items():
                out[f"{tier}/{kind}/{name}"] = value
        # frozen weights: read, never written (``read_only_read_bytes``...: not summed with the ``bytes_read``s)
        for (kind, tier), r in sorted(self.read_only().items()):
            for name, value in vars(r).items():
                out[f"{tier}/{kind}/read_only_{name}"] = value
        directories = self.by_directory()
        if len(directories) > 1:  # several offload paths: each one's traffic
            for directory, (read, written) in sorted(directories.items()):
                out[f"ssd_path/{directory}/bytes_read"] = read
                out[f"ssd_path/{directory}/bytes_written"] = written
        return out
