"""The device tier's transfers: host <-> device copies on their own streams, each one a :class:`Copy`.

A :class:`Copy` is a ``concurrent.futures.Future`` that completes once the bytes landed (so a
:class:`~lightning_greedysnake.offload.staging.Staged` handle tracks it like any other transfer on its
buffer, and gives the buffer back only after it), plus what the compute stream needs to wait for it
without blocking the host (:meth:`DeviceCopies.wait`).

Two implementations behind the :class:`DeviceCopies` Protocol:

- :class:`CudaCopies`: one H2D and one D2H ``torch.cuda.Stream``; every copy is ordered after the
  compute stream's work enqueued so far (its source or its destination's memory may come from there)
  and recorded as a ``torch.cuda.Event``; a completion thread per stream turns the events into futures,
  in stream order, waiting on the oldest event in flight with a *blocking* synchronize (the events are
  ``blocking=True``: the thread sleeps in the driver instead of spinning a core per copy in flight).
  The steady state never calls ``torch.cuda.synchronize``.
- :class:`SimulatedCopies` (``GREEDYSNAKE_SIMULATE_DEVICE=1``, CPU): "device" memory is separate CPU
  memory, NaN-filled when allocated; every copy runs on a copy thread per direction after a random
  delay of a few milliseconds; a copy's destination is NaN until it lands. A missing wait then gives a
  wrong result instead of passing by luck. Where real CUDA is stricter, so is the simulator: a copy's
  host side must be memory the device tier registered (:meth:`~DeviceCopies.pin`, or
  :meth:`~DeviceCopies.empty_host`), else the copy is refused (:class:`UnregisteredHostMemoryError`);
  and work on another stream (a data-parallel collective, :meth:`SimulatedCopies.land_late`) lands
  late too, so a copy of its result that does not wait for it (``to_host(after=...)``) copies NaN.

Threads: the training thread issues copies and waits; the optimizer lane waits on D2H futures (through
the handles that track them); the completion/copy threads only complete futures (the simulated ones
also write the destinations, which they own until the future is done; the simulated side thread of
:meth:`SimulatedCopies.land_late` owns its result tensor until its future, the ``after`` a later copy
waits for, is done).
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any, Protocol

import torch
from torch import Tensor

SIMULATE_ENV = "GREEDYSNAKE_SIMULATE_DEVICE"


def simulate_device_enabled() -> bool:
    return os.environ.get(SIMULATE_ENV, "") not in ("", "0")


NAMED_SYNCS: collections.Counter[str] = collections.Counter()
"""How often each :func:`named_sync` ran, since the process started (training thread; read by tests)."""


@contextlib.contextmanager
def named_sync(name: str) -> Iterator[None]:
    """A host read of device values that the steady state makes on purpose, at most once per window
    (a window's loss check, its input check, the clipping norm, fp16's finite check). Counted in
    :data:`NAMED_SYNCS`; under ``torch.cuda.set_sync_debug_mode("error")`` (``tests/gpu``: every other
    sync in the steady state is an error) it is let through. Training thread only."""
    NAMED_SYNCS[name] += 1
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


class UnregisteredHostMemoryError(RuntimeError):
    """The simulated device: an asynchronous copy's host side is not memory the device tier registered
    (page-locked on CUDA), where a real copy would be synchronous (pageable memory) or wrong."""


class Copy(Future):  # type: ignore[type-arg]
    """One host <-> device copy: done once its bytes landed. ``event``: the CUDA event recorded after it
    on its copy stream (None on the simulated device, whose compute is the host)."""

    event: Any = None


class CopyCounts:
    """Copies and bytes each way, and page-lock registrations of host memory, since construction. Written
    under ``_lock`` by every thread that issues copies (the training thread; the optimizer lane, a step's
    new resident weights) or registers memory; read by anyone without it (each count is one int)."""

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
        """The compute stream's later work waits for ``copy``. On CUDA the host does not wait: the
        compute stream waits for the copy's event, so work the host enqueues after this call runs after
        the copy, and the host may already touch neither ``copy``'s host memory (its handle tracks that)
        nor read the destination's values itself (a host read needs ``copy.result()``). On the simulated
        device the compute stream is the host thread: this blocks until the copy landed (so code that
        relies on the host having waited passes there and not on CUDA: a host read of device memory
        must go through a copy and its future, never through ``wait``)."""

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
        """Idempotent."""
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
            # blocking: the completion thread's synchronize sleeps in the driver (a default event's spins)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        # ownership: the device-side tensor is the compute stream's; freeing it while the copy is still
        # on the side stream must not hand its memory out before the copy is done
        device_side.record_stream(stream)
        copy = Copy()
        copy.event = event

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
        self.counts.add_registration()

    def unpin(self, ptr: int) -> None:
        if ptr in self._pinned:
            self._pinned.discard(ptr)
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def close(self) -> None:
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
        self._side = _Completer("greedysnake-sim-side")
        """Work on another stream (:meth:`land_late`): a collective's result."""
        self.counts = CopyCounts()
        self._device_memory: weakref.WeakSet[Tensor] = weakref.WeakSet()
        """Every tensor :meth:`empty` handed out that is still alive."""
        self._registered: dict[int, int] = {}
        """Host memory a copy may use: start address -> end, from :meth:`pin` (until :meth:`unpin`) and
        :meth:`empty_host` (until the tensor is freed). Written by any thread under ``_lock``."""

    def _delay(self) -> float:
        with self._lock:
            return self._random.uniform(0.0, self.max_delay_s)

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        t = _poisoned(numel, dtype)
        self._device_memory.add(t)
        return t

    def empty_host(self, numel: int, dtype: torch.dtype) -> Tensor:
        t = _poisoned(numel, dtype)
        if t.numel():
            ptr = t.data_ptr()
            with self._lock:
                self._registered[ptr] = ptr + t.numel() * t.element_size()
            weakref.finalize(t, self._forget, ptr)  # (page-locked for its lifetime, as torch's pinned tensors)
        return t

    def _forget(self, ptr: int) -> None:
        with self._lock:
            self._registered.pop(ptr, None)

    def memory_allocated(self) -> int:
        """Bytes of simulated device memory still referenced (``torch.cuda.memory_allocated``'s analogue)."""
        return sum(t.numel() * t.element_size() for t in list(self._device_memory))

    def _check_registered(self, host: Tensor, direction: str) -> None:
        if not host.numel():
            return
        lo = host.data_ptr()
        hi = lo + host.numel() * host.element_size()  # (a contiguous view: every copy here is one)
        with self._lock:
            if any(start <= lo and hi <= end for start, end in self._registered.items()):
                return
        raise UnregisteredHostMemoryError(
            f"an asynchronous copy {direction} uses {hi - lo} bytes of host memory that the device tier did "
            "not register (page-lock): on CUDA such a copy is synchronous or reads memory that may move. "
            "Copy from or into a staging buffer of the pool, a pinned host region or DeviceCopies.empty_host "
            "memory; this is a bug in greedysnake, please report it.")

    def _copy(self, lane: _Completer, src: Tensor, dst: Tensor, after: Future | None = None) -> Copy:  # type: ignore[type-arg]
        assert src.numel() == dst.numel(), (src.shape, dst.shape)
        delay = self._delay()
        _poison(dst)  # undefined until the copy lands

        def job() -> None:
            if after is not None:
                after.result()  # (the stream that produced the source: a collective, on its own lane)
            time.sleep(delay)
            dst.copy_(src)  # the source as it is now: a change before this point is a missing wait

        return lane.submit(job, Copy())

    def to_device(self, src: Tensor, dst: Tensor) -> Copy:
        self._check_registered(src, "to the device")
        self.counts.add(to_device=dst.numel() * dst.element_size())
        return self._copy(self._h2d, src, dst)

    def to_host(self, src: Tensor, dst: Tensor, after: Any = None) -> Copy:
        """As the Protocol's; ``after``: a future of :meth:`land_late` (the simulated other stream), which
        the copy waits for before it reads ``src``."""
        self._check_registered(dst, "to the host")
        assert after is None or isinstance(after, Future), f"after={after!r}: the simulated device's streams are futures"
        self.counts.add(to_host=dst.numel() * dst.element_size())
        return self._copy(self._d2h, src, dst, after)

    def land_late(self, dst: Tensor, result: Tensor) -> Copy:
        """Work on another stream, simulated: ``dst`` (device memory) holds ``result`` only once the
        returned future is done, late by more than any copy's delay; NaN until then. A copy of ``dst``
        that does not wait for it (``to_host(after=...)``) copies NaN."""
        value = result.clone()
        dst.fill_(float("nan"))
        delay = self.max_delay_s + self._delay()

        def job() -> None:
            time.sleep(delay)
            dst.copy_(value)

        return self._side.submit(job, Copy())

    def wait(self, copy: Copy) -> None:
        copy.result()  # the simulated compute stream is the host thread (see the Protocol)

    def pin(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._registered[ptr] = ptr + nbytes
        self.counts.add_registration()

    def unpin(self, ptr: int) -> None:
        with self._lock:
            self._registered.pop(ptr, None)

    def close(self) -> None:
        self._side.close()
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


def _poison(t: Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.uint8:
        t.fill_(0xFF)  # raw bytes (a device-resident region's): all-ones is NaN in every float dtype


def _poisoned(numel: int, dtype: torch.dtype) -> Tensor:
    with torch.inference_mode(False):  # (the copy thread writes it, outside any inference_mode)
        t = torch.empty(numel, dtype=dtype)
        _poison(t)
    return t


def device_copies_for(device: torch.device) -> DeviceCopies | None:
    """The device tier for ``device``: CUDA copies on a GPU, the simulated device on the CPU when
    ``GREEDYSNAKE_SIMULATE_DEVICE=1``, else None (the CPU computes on the host tier's memory)."""
    if device.type == "cuda":
        return CudaCopies(device)
    if device.type == "cpu" and simulate_device_enabled():
        return SimulatedCopies()
    return None
