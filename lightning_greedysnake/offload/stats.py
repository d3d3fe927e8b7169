"""I/O counters per kind of tensor and tier: bytes and busy seconds, readable by the strategy each step."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass


@dataclass
class IOCounter:
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    reads: int = 0
    writes: int = 0
    wait_seconds: float = 0.0
    """Time the training thread spent blocked on this kind's reads (what prefetch did not hide)."""


class IOStats:
    """Thread-safe: I/O threads record completions while the training thread reads snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, str], IOCounter] = defaultdict(IOCounter)

    def record(self, kind: str, tier: str, op: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            c = self._counters[(kind, tier)]
            if op == "read":
                c.bytes_read += nbytes
                c.read_seconds += seconds
                c.reads += 1
            else:
                c.bytes_written += nbytes
                c.write_seconds += seconds
                c.writes += 1

    def copy(self) -> IOStats:
        """A frozen copy (later I/O does not change it)."""
        out = IOStats()
        out._counters.update(self.snapshot())
        return out

    def record_wait(self, kind: str, tier: str, seconds: float) -> None:
        with self._lock:
            self._counters[(kind, tier)].wait_seconds += seconds

    def snapshot(self) -> dict[tuple[str, str], IOCounter]:
        with self._lock:
            return {k: IOCounter(**vars(v)) for k, v in self._counters.items()}

    def bytes_read(self, kind: str, tier: str = "ssd") -> int:
        with self._lock:
            c = self._counters.get((kind, tier))
            return c.bytes_read if c else 0

    def bytes_written(self, kind: str, tier: str = "ssd") -> int:
        with self._lock:
            c = self._counters.get((kind, tier))
            return c.bytes_written if c else 0

    def flat(self) -> dict[str, float]:
        """``{"ssd/weights/bytes_read": ..., ...}``: for loggers."""
        out: dict[str, float] = {}
        for (kind, tier), c in sorted(self.snapshot().items()):
            for name, value in vars(c).items():
                out[f"{tier}/{kind}/{name}"] = value
        return out
