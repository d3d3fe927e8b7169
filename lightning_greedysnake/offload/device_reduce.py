"""Data parallel on the device tier: a unit's fp32 gradient is averaged over the ranks where it was
accumulated, on the device, before its one copy to the host.

With partitioned state (each rank steps its chunk of every unit) a reduce-scatter leaves each rank the
average of its own chunk only, and only that chunk crosses to the host; with replicated state an
all-reduce averages the whole gradient. The optimizer lane then steps the gradient as it comes (its
host-side all-reduce is skipped for it).

Ordering: called by the training thread at the unit's gradient-ready op, which every rank reaches in the
same unit order, on the default process group (which only the training thread uses). On CUDA the
collective runs on a communication stream that first waits for the compute stream (the gradient's last
add), so the rest of backward overlaps it; the D2H copy of the result waits for the event recorded on that
stream right after the collective (:meth:`DeviceGradientReducer.after`), not for the compute stream's
later work, and every tensor used there is recorded on it. (On the simulated device the gloo collective
is synchronous, and its result is then made to land late, :meth:`SimulatedCopies.land_late`, so a copy
that does not wait for it copies NaN.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_greedysnake.offload.device import DeviceCopies, SimulatedCopies


def _reduce_scatter(out: Tensor, inp: Tensor, group: Any) -> None:
    single = getattr(dist, "reduce_scatter_single", None)  # (torch >= 2.13's name for it)
    if single is not None:
        single(out, inp, group=group)
    else:
        dist.reduce_scatter_tensor(out, inp, group=group)


class DeviceGradientReducer:
    def __init__(self, copies: DeviceCopies, rank: int, world: int, partitioned: bool, group: Any = None) -> None:
        self.copies = copies
        self.rank, self.world = rank, world
        self.partitioned = partitioned
        self.group = group
        self.stream: Any = torch.cuda.Stream(copies.device) if copies.device.type == "cuda" else None
        """CUDA: the communication stream (None on the simulated device)."""
        self._landing: Any = None
        """The simulated device: the last :meth:`reduce`'s result landing late (training thread)."""
        self._done: Any = None
        """CUDA: the event on the communication stream after the last collective (training thread)."""
        self.collective_bytes = 0
        """Payload bytes this rank put into the gradient collectives so far (training thread)."""

    @contextlib.contextmanager
    def _on_stream(self, *tensors: Tensor) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.copies.device)
        self.stream.wait_stream(compute)  # after the gradient's last add
        with torch.cuda.stream(self.stream):
            yield
        # hand-over: the collective's result -> the D2H copy of it (``after``), which waits for this only
        self._done = self.stream.record_event()
        for t in tensors:
            t.record_stream(self.stream)  # freed by the compute stream's allocator only after the collective

    def reduce(self, flat: Tensor, bounds: list[tuple[int, int]]) -> tuple[Tensor, int]:
        """``flat`` (one unit's device gradient) averaged over the ranks: ``(values, first element)``, the
        whole unit, or with partitioned state this rank's chunk ``bounds[rank]`` only."""
        if not self.partitioned:
            self._all_reduce(flat)
            self._land_late(flat)
            return flat, 0
        chunk = max(b - a for a, b in bounds)
        padded = self.copies.empty(self.world * chunk, flat.dtype)
        mine = self.copies.empty(chunk, flat.dtype)
        with self._on_stream(flat, padded, mine):
            padded.zero_()  # (every chunk as long as the longest: the collective needs equal parts)
            for r, (a, b) in enumerate(bounds):
                padded[r * chunk : r * chunk + (b - a)].copy_(flat[a:b])
            _reduce_scatter(mine, padded, self.group)
            mine.div_(self.world)
        self._land_late(mine)
        self.collective_bytes += padded.numel() * padded.element_size()
        lo, hi = bounds[self.rank]
        return mine[: hi - lo], lo

    def average(self, flat: Tensor) -> None:
        """``flat`` averaged over the ranks in place, for the compute stream's next use (its norm)."""
        self._all_reduce(flat)
        if self.stream is not None:
            torch.cuda.current_stream(self.copies.device).wait_stream(self.stream)

    def _all_reduce(self, flat: Tensor) -> None:
        with self._on_stream(flat):
            dist.all_reduce(flat, group=self.group)
            flat.div_(self.world)
        self.collective_bytes += flat.numel() * flat.element_size()

    def _land_late(self, result: Tensor) -> None:
        """The simulated device: ``result`` lands late, as it would on the communication stream."""
        if self.stream is None and isinstance(self.copies, SimulatedCopies):
            self._landing = self.copies.land_late(result, result)

    def after(self) -> Any:
        """What a copy of :meth:`reduce`'s result must wait for: the event after the collective on the
        communication stream on CUDA, the late landing on the simulated device (None when synchronous:
        the compute stream's work so far)."""
        return self._done if self.stream is not None else self._landing
