"""The ordering rule of the device tier's copies, written once for both devices of
:mod:`~lightning_greedysnake.offload.device` (CUDA and the simulated one), so the simulator's two-engine
timeline checks the very rule a GPU runs: a copy waits for the events it is given and nothing else, never
for everything queued on the compute stream (the rule per kind of copy: that module's docstring). Plus
what both devices build on: the :class:`Copy` future, the byte counters, a completion thread.

Threads: whoever issues a copy (the training thread, the optimizer lane, an I/O thread) calls
:class:`OrderedCopies`' methods; a :class:`Completer`'s thread only completes futures.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
from torch import Tensor


class Copy(Future):  # type: ignore[type-arg]
    """One host <-> device copy: done once its bytes landed. ``event``: the event recorded after it on its
    copy stream, which the compute stream (``DeviceCopies.wait``) or another copy (``after=``) waits for
    (a ``torch.cuda.Event``; on the simulated device a :class:`~lightning_greedysnake.offload.device.
    SimEvent`)."""

    event: Any = None


FRESH: tuple[()] = ()
"""``to_device(..., after=FRESH)``: the destination is memory from ``empty_for_h2d`` that nothing used
yet, so the copy waits for no event."""


class CopyCounts:
    """Copies and bytes each way, and page-lock registrations of host memory, since construction. Written
    under ``_lock`` by every thread that issues copies (the training thread; the optimizer lane, a step's
    new resident weights; an I/O thread, a read-ahead saved activation's load) or registers memory; read by
    anyone without it (each count is one int)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_to_device = 0
        self.bytes_to_host = 0
        self.copies = 0
        self.registrations = 0
        """Host memory registrations (``cudaHostRegister``; :meth:`DeviceCopies.pin`): slow, and they
        serialize with the driver; none in the steady state."""

    def add_registration(self) -> None:
        with self._lock:
            self.registrations += 1

    def add(self, *, to_device: int = 0, to_host: int = 0) -> None:
        with self._lock:
            self.bytes_to_device += to_device
            self.bytes_to_host += to_host
            self.copies += 1


class Completer:
    """A thread that runs ``jobs`` in submission order (one stream's completions, or one simulated
    direction's copies) and completes each job's future. Stopped by :meth:`close`."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Copy] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], copy: Copy) -> Copy:
        self._jobs.put((job, copy))
        return copy

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, copy = item
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the copy
                copy.set_exception(exc)
            else:
                copy.set_result(None)

    def close(self) -> None:
        """Idempotent."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


def events_of(after: Any) -> list[Any]:
    """``after`` (an event, a :class:`Copy`, :data:`FRESH`, or a sequence of them): the events to wait for."""
    items = list(after) if isinstance(after, (list, tuple)) else [after]
    return [item.event if isinstance(item, Copy) else item for item in items]


class OrderedCopies:
    """The ordering rule of every copy (see the module's docstring), written once over a device's
    primitives, so the simulated device's timeline checks the very rule a GPU runs. A device gives
    ``compute``, ``h2d`` and ``d2h`` (its streams), :meth:`compute_event`, :meth:`empty_for_h2d` and
    :meth:`_enqueue` (a copy on a stream after the given events, its event recorded after it); the
    methods' contracts are :class:`~lightning_greedysnake.offload.device.DeviceCopies`'."""

    counts: CopyCounts
    compute: Any
    h2d: Any
    d2h: Any

    def compute_event(self) -> Any:
        raise NotImplementedError

    def empty_for_h2d(self, numel: int, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def _enqueue(self, stream: Any, src: Tensor, dst: Tensor, device_side: Tensor, waits: list[Any]) -> Copy:
        raise NotImplementedError

    def to_new_device(self, src: Tensor, after: Any = FRESH) -> tuple[Tensor, Copy]:
        dst = self.empty_for_h2d(src.numel(), src.dtype)
        # ordering: the memory is the H2D stream's (nothing on compute to wait for); only a D2H copy that
        # fills ``src`` (``after``) comes first
        return dst, self._issue_h2d(src, dst, events_of(after))

    def to_device(self, src: Tensor, dst: Tensor, after: Any = None) -> Copy:
        # ordering: the copy follows the event that freed ``dst`` (compute's last use of it), not the
        # compute stream's later work; None: the compute stream's point now (every op queued so far)
        return self._issue_h2d(src, dst, [self.compute_event()] if after is None else events_of(after))

    def _issue_h2d(self, src: Tensor, dst: Tensor, waits: list[Any]) -> Copy:
        self.counts.add(to_device=dst.numel() * dst.element_size())
        return self._enqueue(self.h2d, src, dst, dst, waits)

    def to_host(self, src: Tensor, dst: Tensor, after: Any = None) -> Copy:
        # ordering: the copy follows the op that produced ``src`` (its event, or the compute stream's point
        # now, right after it), not the compute stream's later work
        waits = [self.compute_event()] if after is None else events_of(after)
        self.counts.add(to_host=dst.numel() * dst.element_size())
        return self._enqueue(self.d2h, src, dst, src, waits)
