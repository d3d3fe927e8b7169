"""What a run measures of its machine for its plans, each once: the optimizer's element rate and the
offload disks' bandwidth (:class:`Measurements`). Setup's unit-size plan and the warm-step plan read the
same figures, so the report says one disk speed and one optimizer rate a run. The arithmetic that uses them
is :mod:`lightning_greedysnake.planner`'s, which measures nothing and reads no settings."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.offload.preflight import disk_free_bytes
from lightning_greedysnake.planner.measure import (
    PROBE_SIZES,
    interpolate,
    optimizer_rate,
    probe_sizes,
    request_bandwidth,
)
from lightning_greedysnake.planner.unit_size import Bandwidth


def probe_directory(setting: str | None, default_root: Path) -> Path:
    """Where to measure the disk of an offload path before it exists: its nearest existing ancestor
    (a directory about to be created lives on that one's filesystem)."""
    path = Path(setting.format(rank=0, local_rank=0)) if setting else default_root / "greedysnake_offload"
    for candidate in (path, *path.parents):
        if candidate.is_dir():
            return candidate
    return Path.cwd()


def probe_cap_bytes(directory: Path) -> int:
    """The largest probe request (and scratch file) in ``directory``: the largest of :data:`PROBE_SIZES`,
    or a quarter of the free space where that is less (the probe must not fill a disk the run is using),
    in 64 KiB steps."""
    step = 64 << 10
    return max(step, min(PROBE_SIZES[-1], disk_free_bytes(directory) // 4 // step * step))


@dataclass
class Measurements:
    """The run's measurements of its machine, each taken the first time a plan asks for it and kept:
    :attr:`rates` (the user's optimizer, stepped as the lane steps it) and :meth:`disk` (the offload
    paths together, at the first plan's request sizes). Owned by the training thread; the plans that
    read it run on rank 0, whose decisions every rank takes."""

    optimizer: Any
    """The user's optimizer: its class and first param group's settings are measured (an instance, or a
    factory of it over a list of parameters: :func:`~lightning_greedysnake.optim.unit_optimizer.construct_like`)."""
    numel: int
    """Elements of the rate probe (:func:`~lightning_greedysnake.planner.measure.probe_numel`)."""
    shape: tuple[int, ...] | None
    """The probe parameter's proportions (:attr:`~lightning_greedysnake.optim.contract.OptimizerContract.probe_shape`)."""
    threads: int
    """The lane's intra-op threads."""
    shared: bool
    """The model computes on the host: the lane shares its cores, and a synchronous step (lag 0) runs on
    the training thread, whose rate is measured too."""
    dirs: list[Path]
    """The offload paths' filesystems (:func:`probe_directory`)."""
    io: OffloadConfig
    """The I/O settings the disks are measured at (threads, chunk size, O_DIRECT), as the tensor manager's."""
    _disk: dict[int, tuple[float, float]] | None = field(default=None, init=False)

    @property
    def where(self) -> str:
        return ", ".join(map(str, self.dirs))

    @property
    def disk_measured(self) -> bool:
        return self._disk is not None

    @functools.cached_property
    def rates(self) -> tuple[float, float | None]:
        """Elements per second of the optimizer on the lane's threads, and on the training thread's where
        the lane shares its cores (else None)."""
        lane = optimizer_rate(numel=self.numel, optimizer=self.optimizer, threads=self.threads, shape=self.shape)
        return lane, optimizer_rate(numel=self.numel, optimizer=self.optimizer, shape=self.shape) if self.shared else None

    def disk(self, requests: Sequence[int]) -> Bandwidth:
        """The offload paths' (read, write) bytes/s by request size: measured at the probe sizes that
        bracket ``requests`` (:func:`~lightning_greedysnake.planner.measure.probe_sizes`, capped by
        :func:`probe_cap_bytes`) the first time, the same points afterwards (interpolated). Paths are
        striped round robin, so the slowest binds, once per path. Raises ``OSError`` where a disk cannot
        be measured."""
        if self._disk is None:
            cap = min(probe_cap_bytes(d) for d in self.dirs)
            sizes = [s for s in probe_sizes(requests) if s <= cap] or [cap]
            per_path = [request_bandwidth(d, sizes, self.io.io_threads, self.io.io_chunk_bytes, self.io.direct_io,
                                          min(8 << 20, cap)) for d in self.dirs]
            n = len(self.dirs)
            self._disk = {s: (n * min(p[s][0] for p in per_path), n * min(p[s][1] for p in per_path)) for s in sizes}
        return interpolate(self._disk)

