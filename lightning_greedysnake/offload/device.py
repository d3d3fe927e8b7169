"""The device tier's transfers: host <-> device copies on their own streams, each one a :class:`Copy`.

A :class:`Copy` is a ``concurrent.futures.Future`` that completes once the bytes landed (so a
:class:`~lightning_greedysnake.offload.staging.Staged` handle tracks it like any other transfer on its
buffer, and gives the buffer back only after it), plus what the compute stream needs to wait for it
without blocking the host (:meth:`DeviceCopies.wait`).

Two implementations behind the :class:`DeviceCopies` Protocol:

- :class:`CudaCopies`: one H2D and one D2H ``torch.cuda.Stream``; every copy is ordered after the
  compute stream's work enqueued so far (its source or its destination's memory may come from there)
  and recorded as a ``torch.cuda.Event``; a completion thread per stream turns the events into futures,
  in stream order. The steady state never calls ``torch.cuda.synchronize``.
- :class:`SimulatedCopies` (``GREEDYSNAKE_SIMULATE_DEVICE=1``, CPU): "device" memory is separate CPU
  memory, NaN-filled when allocated; every copy runs on a copy thread per direction after a random
  delay of a few milliseconds; a copy's destination is NaN until it lands. A missing wait then gives a
  wrong result instead of passing by luck.

Threads: the training thread issues copies and waits; the optimizer lane waits on D2H futures (through
the handles that track them); the completion/copy threads only complete futures.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch
from torch import Tensor

SIMULATE_ENV = "GREEDYSNAKE_SIMULATE_DEVICE"


def simulate_device_enabled() -> bool:
    return os.environ.get(SIMULATE_ENV, "") not in ("", "0")


class Copy(Future):  # type: ignore[type-arg]
    """One host <-> device copy: done once its bytes landed. ``event``: the CUDA event recorded after it
    on its copy stream (None on the simulated device, whose compute is the host)."""

    event: Any = None


class CopyCounts:
    """Copies and bytes each way since construction. Written by every thread that issues copies (the
    training thread; the optimizer lane, a step's new resident weights) under ``_lock``; read by anyone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._to_device = 0
        self._to_host = 0
        self._copies = 0

    def add(self, *, to_device: int = 0, to_host: int = 0) -> None:
        with self._lock:
            self._to_device += to_device
            self._to_host += to_host
            self._copies += 1

    @property
    def bytes_to_device(self) -> int:
        with self._lock:
            return self._to_device

    @property
    def bytes_to_host(self) -> int:
        with self._lock:
            return self._to_host

    @property
    def copies(self) -> int:
        with self._lock:
            return self._copies


class DeviceCopies(Protocol):
    """The device tier's memory and transfers (see the module's docstring)."""

    device: torch.device
    counts: CopyCounts
    """Copies and bytes copied host -> device and device -> host, since construction."""

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Device memory for the compute stream (its contents undefined)."""

    def empty_host(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Host memory a copy can use asynchronously (page-locked on CUDA)."""

    def to_device(self, src: Tensor, dst: Tensor) -> Copy:
        """Copy host ``src`` into device ``dst``. The owner of ``src`` keeps it unchanged until the copy
        is done; the compute stream reads ``dst`` only after :meth:`wait`."""

    def to_host(self, src: Tensor, dst: Tensor, after: Any = None) -> Copy:
        """Copy device ``src`` (as the compute stream left it so far, and ``after``, another stream that
        produced it, if given) into host ``dst``; ``dst`` is readable once the copy is done
        (``Copy.result()``)."""

    def wait(self, copy: Copy) -> None:
        """The compute stream's later work waits for ``copy`` (the host does not, on CUDA)."""

    def pin(self, ptr: int, nbytes: int) -> None:
        """Page-lock host memory for asynchronous copies (a no-op where not needed)."""

    def unpin(self, ptr: int) -> None: ...

    def close(self) -> None:
        """Wait for every copy in flight and stop the threads. Idempotent."""


class _Completer:
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
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


class CudaCopies:
    """Copies on a CUDA device (see the module's docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        """The compute stream: the training thread's current stream at construction (streams are per
        thread, and the optimizer lane also issues copies: a step's new resident weights)."""
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self._h2d_done = _Completer("greedysnake-h2d-events")
        self._d2h_done = _Completer("greedysnake-d2h-events")
        self._pinned: set[int] = set()
        self.counts = CopyCounts()
        self._closed = False

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        # allocated on the compute stream: freed by it, reused by it; copies on side streams record it.
        # Never an inference tensor (evaluation runs under inference_mode; the memory outlives it)
        with torch.inference_mode(False):
            return torch.empty(numel, dtype=dtype, device=self.device)

    def empty_host(self, numel: int, dtype: torch.dtype) -> Tensor:
        with torch.inference_mode(False):
            return torch.empty(numel, dtype=dtype, pin_memory=True)

    def _copy(self, stream: torch.cuda.Stream, done: _Completer, src: Tensor, dst: Tensor, device_side: Tensor,
              after: Any = None) -> Copy:
        compute = self.compute
        # ordering: the copy follows everything the compute stream was given so far (it produced the
        # source, or last used the destination's memory before the allocator handed it out again), and
        # the stream that produced the source when that is another one (a gradient's collective)
        stream.wait_stream(compute)
        if after is not None:
            stream.wait_stream(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        # ownership: the device-side tensor is the compute stream's; freeing it while the copy is still
        # on the side stream must not hand its memory out before the copy is done
        device_side.record_stream(stream)
        copy = Copy()
        copy.event = event
        # src and dst stay referenced by the job until the event completed (host memory must outlive it)

        def complete(_keep: tuple[Tensor, Tensor] = (src, dst)) -> None:
            # on the completion thread: src and dst (host memory) stay referenced until the copy is done
            event.synchronize()

        return done.submit(complete, copy)

    def to_device(self, src: Tensor, dst: Tensor) -> Copy:
        self.counts.add(to_device=dst.numel() * dst.element_size())
        return self._copy(self.h2d, self._h2d_done, src, dst, dst)

    def to_host(self, src: Tensor, dst: Tensor, after: Any = None) -> Copy:
        self.counts.add(to_host=dst.numel() * dst.element_size())
        return self._copy(self.d2h, self._d2h_done, src, dst, src, after)

    def wait(self, copy: Copy) -> None:
        self.compute.wait_event(copy.event)

    def pin(self, ptr: int, nbytes: int) -> None:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")
        self._pinned.add(ptr)

    def unpin(self, ptr: int) -> None:
        if ptr in self._pinned:
            self._pinned.discard(ptr)
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._h2d_done.close()
        self._d2h_done.close()


class SimulatedCopies:
    """An asynchronous device simulated on the CPU (see the module's docstring)."""

    def __init__(self, max_delay_s: float = 0.002, seed: int | None = None) -> None:
        self.device = torch.device("cpu")
        self.max_delay_s = max_delay_s
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._h2d = _Completer("greedysnake-sim-h2d")
        self._d2h = _Completer("greedysnake-sim-d2h")
        self.counts = CopyCounts()
        self._device_memory: weakref.WeakSet[Tensor] = weakref.WeakSet()
        """Every tensor :meth:`empty` handed out that is still alive."""
        self._closed = False

    def _delay(self) -> float:
        with self._lock:
            return self._random.uniform(0.0, self.max_delay_s)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        t = _poisoned(numel, dtype)
        self._device_memory.add(t)
        return t

    def empty_host(self, numel: int, dtype: torch.dtype) -> Tensor:
        return _poisoned(numel, dtype)

    def memory_allocated(self) -> int:
        """Bytes of simulated device memory still referenced (``torch.cuda.memory_allocated``'s analogue)."""
        return sum(t.numel() * t.element_size() for t in list(self._device_memory))

    def _copy(self, lane: _Completer, src: Tensor, dst: Tensor) -> Copy:
        assert src.numel() == dst.numel(), (src.shape, dst.shape)
        delay = self._delay()
        if dst.is_floating_point():
            dst.fill_(float("nan"))  # undefined until the copy lands
        elif dst.dtype == torch.uint8:
            dst.fill_(0xFF)  # raw bytes (a device-resident region's): all-ones is NaN in every float dtype

        def job() -> None:
            time.sleep(delay)
            dst.copy_(src)  # the source as it is now: a change before this point is a missing wait

        return lane.submit(job, Copy())

    def to_device(self, src: Tensor, dst: Tensor) -> Copy:
        self.counts.add(to_device=dst.numel() * dst.element_size())
        return self._copy(self._h2d, src, dst)

    def to_host(self, src: Tensor, dst: Tensor, after: Any = None) -> Copy:
        self.counts.add(to_host=dst.numel() * dst.element_size())
        return self._copy(self._d2h, src, dst)  # (the simulated device's collectives are synchronous)

    def wait(self, copy: Copy) -> None:
        copy.result()  # the simulated compute stream is the host thread

    def pin(self, ptr: int, nbytes: int) -> None:
        pass

    def unpin(self, ptr: int) -> None:
        pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._h2d.close()
        self._d2h.close()


def then(first: Future, submit: Callable[[], Future]) -> Future:  # type: ignore[type-arg]
    """A future for ``submit()``'s transfer, submitted once ``first`` completed (on the thread that
    completes it); fails with ``first``'s error without submitting if ``first`` failed."""
    result: Future = Future()  # type: ignore[type-arg]

    def chain(_: Future) -> None:  # type: ignore[type-arg]
        exc = first.exception()
        if exc is not None:
            result.set_exception(exc)
            return
        try:
            second = submit()
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the transfer
            result.set_exception(err)
            return
        second.add_done_callback(
            lambda f: result.set_exception(e) if (e := f.exception()) is not None else result.set_result(None))

    first.add_done_callback(chain)
    return result


def _poisoned(numel: int, dtype: torch.dtype) -> Tensor:
    with torch.inference_mode(False):  # (the copy thread writes it, outside any inference_mode)
        t = torch.empty(numel, dtype=dtype)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif dtype == torch.uint8:
            t.fill_(0xFF)  # (raw bytes: NaN in every float dtype they are viewed as)
    return t


def device_copies_for(device: torch.device) -> DeviceCopies | None:
    """The device tier for ``device``: CUDA copies on a GPU, the simulated device on the CPU when
    ``GREEDYSNAKE_SIMULATE_DEVICE=1``, else None (the CPU computes on the host tier's memory)."""
    if device.type == "cuda":
        return CudaCopies(device)
    if device.type == "cpu" and simulate_device_enabled():
        return SimulatedCopies()
    return None
