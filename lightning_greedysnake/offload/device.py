"""The device tier's transfers: host <-> device copies on their own streams, each one a :class:`Copy`.

A :class:`Copy` is a ``concurrent.futures.Future`` that completes once the bytes landed (so a
:class:`~lightning_greedysnake.offload.staging.Staged` handle tracks it like any other transfer on its
buffer, and gives the buffer back only after it), plus the event the compute stream waits for to use it
without blocking the host (:meth:`DeviceCopies.wait`).

The ordering rule (one implementation, :class:`~lightning_greedysnake.offload.device_order.
OrderedCopies`, shared by both devices below): a copy waits for the events it is given and nothing else,
never for everything queued on the compute stream, so a copy issued while N ops are queued runs beside
them:

- H2D into new memory (:meth:`~DeviceCopies.to_new_device`: a weights prefetch, a saved
  activation's load, a spilled gradient): the memory is allocated for the H2D stream
  (:meth:`~DeviceCopies.empty_for_h2d`), so its previous user was that stream or a compute use the
  allocator waited for; the copy waits for nothing (but, where its host source is itself filled by a
  D2H copy, that copy's event); the compute stream waits for the copy's event before its first use.
- H2D into memory the compute stream used (a device-resident weights region): the copy waits for the
  event recorded after compute's last use of those bytes (``after``), which the memory's owner keeps.
- D2H: the copy waits for the event recorded right after the op that produced its source: the compute
  stream's point when the copy is issued (its callers issue it right after the producing op), a
  collective's stream's event, or the H2D copy that wrote a resident region.

Two implementations behind the :class:`DeviceCopies` Protocol:

- :class:`CudaCopies`: one H2D and one D2H ``torch.cuda.Stream``, ordered as above with
  ``torch.cuda.Event``; a completion thread per stream turns the events into futures, in stream order,
  waiting on the oldest event in flight with a *blocking* synchronize (the events are ``blocking=True``:
  the thread sleeps in the driver instead of spinning a core per copy in flight). The steady state never
  calls ``torch.cuda.synchronize``.
- :class:`SimulatedCopies` (``GREEDYSNAKE_SIMULATE_DEVICE=1``, CPU): "device" memory is separate CPU
  memory, NaN-filled when allocated; every copy runs on a copy thread per direction after a random
  delay of a few milliseconds; a copy's destination is NaN until it lands. A missing wait then gives a
  wrong result instead of passing by luck. Beside that, a deterministic two-engine time model: a compute
  queue and the copy queues (H2D, D2H, and a collective's stream), each op with a duration in simulated
  seconds, placed at the later of its queue's end and the events it waits for (:attr:`SimulatedCopies.
  timeline`); tests queue compute ops (:meth:`SimulatedCopies.queue_compute`) and read when each copy ran, so
  a copy that waits for more than its events (lost overlap) fails a test. Where real CUDA is stricter,
  so is the simulator: a copy's host side must be memory the device tier registered
  (:meth:`~DeviceCopies.pin`, or :meth:`~DeviceCopies.empty_host`), else the copy is refused
  (:class:`UnregisteredHostMemoryError`); an H2D copy that waits for nothing must write memory from
  :meth:`~DeviceCopies.empty_for_h2d` (:class:`UnorderedDeviceWriteError`); and work on another stream
  (a data-parallel collective, :meth:`SimulatedCopies.land_late`) lands late too, so a copy of its
  result that does not wait for it (``to_host(after=...)``) copies NaN.

Threads: the training thread issues copies and waits; the optimizer lane issues a step's writes of
resident weights and waits on D2H futures (through the handles that track them); an I/O completion
thread issues a read-ahead saved activation's H2D copy once its read landed; the completion/copy threads only
complete futures (the simulated ones also write the destinations, which they own until the future is
done; the simulated side thread of :meth:`SimulatedCopies.land_late` owns its result tensor until its
future, the ``after`` a later copy waits for, is done).
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_greedysnake.offload.device_order import FRESH, Completer, Copy, CopyCounts, OrderedCopies

__all__ = ["FRESH", "NAMED_SYNCS", "SIMULATE_ENV", "Copy", "CopyCounts", "CudaCopies", "DeviceCopies",
           "SimEvent", "SimulatedCopies", "Span", "UnorderedDeviceWriteError", "UnregisteredHostMemoryError",
           "device_copies_for", "named_sync", "simulate_device_enabled", "then"]

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


class UnorderedDeviceWriteError(RuntimeError):
    """The simulated device: an H2D copy that waits for no event writes memory the compute stream may
    still be using (not memory from :meth:`DeviceCopies.empty_for_h2d`, or memory a copy filled before)."""


class DeviceCopies(Protocol):
    """The device tier's memory and transfers (see the module's docstring for the ordering rule)."""

    device: torch.device
    counts: CopyCounts
    """Copies and bytes copied host -> device and device -> host, since construction."""

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Device memory for the compute stream (its contents undefined): what compute writes itself."""

    def empty_for_h2d(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Device memory an H2D copy fills before the compute stream uses it: allocated for the H2D
        stream, so the copy into it (``after=FRESH``) waits for no compute (the compute stream's uses of
        it are recorded: its memory is handed out again only after them)."""

    def empty_host(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Host memory a copy can use asynchronously (page-locked on CUDA)."""

    def compute_event(self) -> Any:
        """An event on the compute stream after the work enqueued on it so far: recorded by the owner of
        device memory right after its last use (the hand-over an H2D write into it waits for), or right
        after the op producing a copy's source."""

    def to_new_device(self, src: Tensor, after: Any = FRESH) -> tuple[Tensor, Copy]:
        """Host ``src`` copied into new device memory (:meth:`empty_for_h2d`), waiting for nothing on the
        compute stream; ``after``: where ``src`` is filled by a D2H copy, that copy. The owner of ``src``
        keeps it unchanged until the copy is done; the compute stream reads the memory after :meth:`wait`."""

    def to_device(self, src: Tensor, dst: Tensor, after: Any = None) -> Copy:
        """Copy host ``src`` into device ``dst``, after ``after``: the event recorded after compute's last
        use of ``dst`` (:meth:`compute_event`, kept by the memory's owner), :data:`FRESH` (memory from
        :meth:`empty_for_h2d`, unused), a copy, or several; None: the compute stream's point now (any
        memory, at the price of waiting for every queued op: not for the steady state). The owner of
        ``src`` keeps it unchanged until the copy is done; the compute stream reads ``dst`` only after
        :meth:`wait`."""

    def to_host(self, src: Tensor, dst: Tensor, after: Any = None) -> Copy:
        """Copy device ``src`` into host ``dst`` once what produced ``src`` is done: None, the compute
        stream's work enqueued so far (issue it right after the producing op: later ops are not waited
        for); else that op's event (a collective's stream's, a :meth:`compute_event`) or the copy that
        wrote it. ``dst`` is readable once the copy is done (``Copy.result()``)."""

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


class CudaCopies(OrderedCopies):
    """Copies on a CUDA device (see the module's docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compute = torch.cuda.current_stream(device)
        """The compute stream: the training thread's current stream at construction (streams are per
        thread, and the optimizer lane and I/O threads also issue copies)."""
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self._h2d_done = Completer("greedysnake-h2d-events")
        self._d2h_done = Completer("greedysnake-d2h-events")
        self._pinned: set[int] = set()
        self.counts = CopyCounts()

    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        # allocated on the compute stream: freed by it, reused by it; copies on side streams record it.
        # Never an inference tensor (evaluation runs under inference_mode; the memory outlives it)
        with torch.inference_mode(False):
            return torch.empty(numel, dtype=dtype, device=self.device)

    def empty_for_h2d(self, numel: int, dtype: torch.dtype) -> Tensor:
        # ownership: allocated on the H2D stream, so the caching allocator hands out memory whose last user
        # was that stream (ordered before the copy into it) or a use recorded on another stream that it
        # waited for; the compute stream reads and frees it (after wait(copy)): record_stream makes the
        # allocator hand it out again only once compute's work enqueued by then is done
        with torch.inference_mode(False), torch.cuda.stream(self.h2d):
            t = torch.empty(numel, dtype=dtype, device=self.device)
        t.record_stream(self.compute)
        return t

    def empty_host(self, numel: int, dtype: torch.dtype) -> Tensor:
        with torch.inference_mode(False):
            return torch.empty(numel, dtype=dtype, pin_memory=True)

    def compute_event(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.compute)  # (any thread: the stream is named, not the thread's current one)
        return event

    def _enqueue(self, stream: Any, src: Tensor, dst: Tensor, device_side: Tensor, waits: list[Any]) -> Copy:
        for event in waits:
            stream.wait_event(event)  # ordering: these events only (see OrderedCopies)
        done = self._h2d_done if stream is self.h2d else self._d2h_done
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            # blocking: the completion thread's synchronize sleeps in the driver (a default event's spins)
            event = torch.cuda.Event(blocking=True)
            event.record(stream)
        # ownership: the device-side tensor is another stream's (compute's, or H2D's own); freeing it while
        # the copy is still on this stream must not hand its memory out before the copy is done
        device_side.record_stream(stream)
        copy = Copy()
        copy.event = event

        def complete(_keep: tuple[Tensor, Tensor] = (src, dst)) -> None:
            # on the completion thread: src and dst (host memory) stay referenced until the copy is done
            event.synchronize()

        return done.submit(complete, copy)

    def wait(self, copy: Copy) -> None:
        self.compute.wait_event(copy.event)

    def pin(self, ptr: int, nbytes: int) -> None:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            # a failed call leaves its error as this thread's last CUDA error, which the next unrelated
            # check (a kernel launch's cudaGetLastError) would raise as its own: clear it, then raise ours
            _clear_last_cuda_error()
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


def _clear_last_cuda_error() -> None:
    """``cudaGetLastError()`` (which returns and resets the calling thread's last error) through the CUDA
    runtime this process loaded: torch's ``cudart()`` module does not bind it. Without a libcudart among
    the loaded libraries (a runtime linked statically), nothing to call: a copy of its own would hold
    another error state."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return
    for path in sorted(paths):
        try:
            ctypes.CDLL(path).cudaGetLastError()  # (dlopen of a loaded library: the same one, no new state)
        except (OSError, AttributeError):
            continue
        return


@dataclass(frozen=True)
class SimEvent:
    """The simulated device's event: a point in one stream's timeline, ``at`` simulated seconds, when the
    work before it is done; ``landed``: its real completion on the host's side (a copy's future; None:
    already true when recorded, the compute stream's work having run on the host as it was enqueued)."""

    stream: str
    at: float
    landed: Future | None = None  # type: ignore[type-arg]


@dataclass(frozen=True)
class Span:
    """One op of the simulated timeline: on ``stream``, from ``start`` to ``end`` simulated seconds."""

    stream: str
    label: str
    start: float
    end: float


class _SimStream:
    """One engine's queue in the simulated timeline: its ops run one after another, each no earlier than
    the events it waits for (``tail``: when the last one ends; written under the device's ``_lock``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tail = 0.0


class SimulatedCopies(OrderedCopies):
    """An asynchronous device simulated on the CPU (see the module's docstring).

    Time model: the host issues work ahead of the device (it is never the bottleneck); an op on a stream
    starts at the later of the stream's end and the events it waits for, and lasts ``duration``: a copy
    ``latency_s + bytes / bytes_per_s``, a compute op what :meth:`queue_compute` is given, a collective
    (:meth:`land_late`) twice a copy. The compute stream's work itself runs on the host when issued, so
    in a Trainer run the compute queue holds only its waits unless a test queues ops."""

    def __init__(self, max_delay_s: float = 0.002, seed: int | None = None, *, bytes_per_s: float = 10e9,
                 latency_s: float = 1e-5) -> None:
        self.device = torch.device("cpu")
        self.max_delay_s = max_delay_s
        self.bytes_per_s, self.latency_s = bytes_per_s, latency_s
        self._random = random.Random(seed)
        self._lock = threading.RLock()
        """Guards the tables and the timeline below. Reentrant: a tensor's finalizer (``unpin``,
        ``_forget_fresh``) may run on a thread that holds it, when an allocation under it starts a garbage
        collection that frees a tensor held in a reference cycle (a future's callback that captured it)."""
        self._h2d_thread = Completer("greedysnake-sim-h2d")
        self._d2h_thread = Completer("greedysnake-sim-d2h")
        self._side_thread = Completer("greedysnake-sim-side")
        """Work on another stream (:meth:`land_late`): a collective's result."""
        self.compute, self.h2d, self.d2h = _SimStream("compute"), _SimStream("h2d"), _SimStream("d2h")
        self._collective = _SimStream("collective")
        self.timeline: collections.deque[Span] = collections.deque(maxlen=100_000)
        """The simulated ops in issue order (the latest 100,000), written under ``_lock``."""
        self.compute_waits: collections.Counter[str] = collections.Counter()
        """Per copy stream: copies that waited for a compute event (under ``_lock``): in the steady state
        only the writes of device-resident weights and D2H copies of what compute produced should."""
        self.compute_stalled_s = 0.0
        """Simulated seconds the compute stream sat waiting for a copy (:meth:`wait`; under ``_lock``)."""
        self.counts = CopyCounts()
        self._device_memory: weakref.WeakSet[Tensor] = weakref.WeakSet()
        """Every tensor :meth:`empty` or :meth:`empty_for_h2d` handed out that is still alive."""
        self._fresh: set[int] = set()
        """Start addresses of :meth:`empty_for_h2d` memory no copy filled yet (under ``_lock``)."""
        self._registered: dict[int, int] = {}
        """Host memory a copy may use: start address -> end, from :meth:`pin` (until :meth:`unpin`) and
        :meth:`empty_host` (until the tensor is freed). Written by any thread under ``_lock``."""

    def _delay(self) -> float:
        with self._lock:
            return self._random.uniform(0.0, self.max_delay_s)

    # -- the time model ---------------------------------------------------------------------------------
    def _schedule(self, stream: _SimStream, duration: float, waits: list[SimEvent], label: str,
                  landed: Future | None) -> SimEvent:  # type: ignore[type-arg]
        """Place an op on ``stream`` after ``waits``; the event after it."""
        with self._lock:
            start = max([stream.tail, *(e.at for e in waits)])
            stream.tail = start + duration
            self.timeline.append(Span(stream.name, label, start, stream.tail))
            if any(e.stream == "compute" for e in waits):
                self.compute_waits[stream.name] += 1
            return SimEvent(stream.name, stream.tail, landed)

    def queue_compute(self, duration_s: float, label: str = "op") -> SimEvent:
        """Queue an op of ``duration_s`` simulated seconds on the compute stream (tests: the work a GPU
        has queued when a copy is issued); the event after it."""
        return self._schedule(self.compute, duration_s, [], label, None)

    def compute_event(self) -> SimEvent:
        with self._lock:
            return SimEvent("compute", self.compute.tail)

    def wait(self, copy: Copy) -> None:
        event = copy.event
        with self._lock:  # the compute stream's later ops start after the copy
            self.compute_stalled_s += max(0.0, event.at - self.compute.tail)
            self.compute.tail = max(self.compute.tail, event.at)
        copy.result()  # the simulated compute stream is the host thread (see the Protocol)

    # -- memory ------------------------------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype) -> Tensor:
        t = _poisoned(numel, dtype)
        self._device_memory.add(t)
        return t

    def empty_for_h2d(self, numel: int, dtype: torch.dtype) -> Tensor:
        t = self.empty(numel, dtype)
        if t.numel():
            ptr = t.data_ptr()
            with self._lock:
                self._fresh.add(ptr)
            weakref.finalize(t, self._forget_fresh, ptr)
        return t

    def _forget_fresh(self, ptr: int) -> None:
        with self._lock:
            self._fresh.discard(ptr)

    def empty_host(self, numel: int, dtype: torch.dtype) -> Tensor:
        t = _poisoned(numel, dtype)
        if t.numel():
            ptr = t.data_ptr()
            with self._lock:
                self._registered[ptr] = ptr + t.numel() * t.element_size()
            weakref.finalize(t, self.unpin, ptr)  # (page-locked for its lifetime, as torch's pinned tensors)
        return t

    def memory_allocated(self) -> int:
        """Bytes of simulated device memory still referenced (``torch.cuda.memory_allocated``'s analogue)."""
        return sum(t.numel() * t.element_size() for t in list(self._device_memory))

    def _check_registered(self, host: Tensor, direction: str) -> None:
        if not host.numel():
            return
        lo = host.data_ptr()
        hi = lo + host.numel() * host.element_size()  # (a contiguous view: every copy here is one)
        with self._lock:
            registered = self._registered.copy()  # (a finalizer may remove an entry while we iterate)
        if any(start <= lo and hi <= end for start, end in registered.items()):
            return
        raise UnregisteredHostMemoryError(
            f"an asynchronous copy {direction} uses {hi - lo} bytes of host memory that the device tier did "
            "not register (page-lock): on CUDA such a copy is synchronous or reads memory that may move. "
            "Copy from or into a staging buffer of the pool, a pinned host region or DeviceCopies.empty_host "
            "memory; this is a bug in greedysnake, please report it.")

    def _check_unordered_write(self, dst: Tensor, waits: list[Any]) -> None:
        """An H2D copy that waits for no event of the compute stream writes fresh H2D memory, once."""
        if not dst.numel() or any(e.stream == "compute" for e in waits):
            return
        ptr = dst.untyped_storage().data_ptr()
        with self._lock:
            if ptr in self._fresh:
                self._fresh.discard(ptr)  # (filled: the compute stream may use it from now on)
                return
        raise UnorderedDeviceWriteError(
            f"an H2D copy of {dst.numel() * dst.element_size()} bytes waits for no compute event, into "
            "memory the compute stream may still read: on CUDA it could overwrite it under a queued kernel. "
            "Copy into DeviceCopies.empty_for_h2d memory (to_new_device), or pass the event recorded after "
            "the memory's last use (after=compute_event()); this is a bug in greedysnake, please report it.")

    # -- copies ------------------------------------------------------------------------------------------
    def _issue_h2d(self, src: Tensor, dst: Tensor, waits: list[Any]) -> Copy:
        self._check_registered(src, "to the device")
        self._check_unordered_write(dst, waits)
        return super()._issue_h2d(src, dst, waits)

    def to_host(self, src: Tensor, dst: Tensor, after: Any = None) -> Copy:
        """As the Protocol's; ``after`` may be a :meth:`land_late` (the simulated other stream), which the
        copy waits for before it reads ``src``."""
        self._check_registered(dst, "to the host")
        return super().to_host(src, dst, after)

    def _enqueue(self, stream: Any, src: Tensor, dst: Tensor, device_side: Tensor, waits: list[Any]) -> Copy:
        assert src.numel() == dst.numel(), (src.shape, dst.shape)
        assert all(isinstance(e, SimEvent) for e in waits), f"waits={waits!r}: the simulated device's events"
        copy = Copy()
        nbytes = dst.numel() * dst.element_size()
        copy.event = self._schedule(stream, self.latency_s + nbytes / self.bytes_per_s, waits,
                                    f"{stream.name} {nbytes} bytes", copy)
        pending = [e.landed for e in waits if e.landed is not None]
        delay = self._delay()
        _poison(dst)  # undefined until the copy lands

        def job() -> None:
            for landed in pending:
                landed.result()  # (a copy or collective on another lane: the events it waits for, really)
            time.sleep(delay)
            dst.copy_(src)  # the source as it is now: a change before this point is a missing wait

        return (self._h2d_thread if stream is self.h2d else self._d2h_thread).submit(job, copy)

    def land_late(self, dst: Tensor, result: Tensor) -> Copy:
        """Work on another stream, simulated: ``dst`` (device memory) holds ``result`` only once the
        returned future is done, late by more than any copy's delay; NaN until then. A copy of ``dst``
        that does not wait for it (``to_host(after=...)``) copies NaN. In the timeline: a collective that
        follows the compute stream's work so far (the gradient's last add), on its own stream."""
        value = result.clone()
        dst.fill_(float("nan"))
        delay = self.max_delay_s + self._delay()
        copy = Copy()
        nbytes = dst.numel() * dst.element_size()
        copy.event = self._schedule(self._collective, 2 * (self.latency_s + nbytes / self.bytes_per_s),
                                    [self.compute_event()], f"collective {nbytes} bytes", copy)

        def job() -> None:
            time.sleep(delay)
            dst.copy_(value)

        return self._side_thread.submit(job, copy)

    def pin(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self._registered[ptr] = ptr + nbytes
        self.counts.add_registration()

    def unpin(self, ptr: int) -> None:
        with self._lock:
            self._registered.pop(ptr, None)

    def close(self) -> None:
        self._side_thread.close()
        self._h2d_thread.close()
        self._d2h_thread.close()


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
