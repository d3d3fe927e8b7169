"""Page-aligned staging buffers under a byte budget, with explicit acquire and release.

The budget caps what the tensor manager holds in host memory at once: weights in use and prefetched,
the optimizer's working set, saved activations in flight. A request that can never fit is an error up front;
one that fits later waits for a release (write-behind completions release from I/O threads).

Nobody calls :meth:`BufferPool.release` directly but a :class:`~lightning_greedysnake.offload.staging.Staged`
handle, which does so only after every transfer on its buffer completed.

The pool maps its memory once, as segments of a :class:`StagingArena` (the first as large as the
budget), carves every buffer out of them and gives it back into them; it never unmaps a segment until it
is shrunk or closed. A segment is added only when no free range fits a request the budget allows (a larger
budget, or fragmented free ranges): in the first steps, never in the steady state. The buffers of a run
come in several sizes (a unit's weights, master weights, state, gradient, a deferred part's): a fresh
mapping for each size the moment a cached one did not fit, as this pool once made without a device
tier, faulted in and zeroed about a gigabyte a step on ``compare.py``'s GPT at one block a unit (about
ten mappings of 48 to 160 MiB a step), a ninth of its step with every kind on SSD
(``benchmarks/results/compare_issue54_arena_seq32.json``). With a device tier (a ``pinner``) each segment
is also page-locked for asynchronous copies, once, as it is added: registering memory
(``cudaHostRegister``) is slow and serializes with the driver (``registrations`` counts them).

Debug mode (``GREEDYSNAKE_DEBUG_POOL=1``, or ``debug=True``): every buffer the pool hands out fresh and
every buffer given back is filled with a poison pattern (all bits set: NaN in every float dtype), and an
acquisition of a free range first checks that the pattern is intact. So a read of a buffer after it
was given back computes with NaN instead of plausible stale numbers, and a late write into a free
buffer (an I/O still filling it) is an error naming the buffer's last owner.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable

import torch

from lightning_greedysnake.errors import BufferBudgetError
from lightning_greedysnake.io import AlignedBuffer, align_up
from lightning_greedysnake.io.aligned import ALIGN_BYTES

DEBUG_POOL_ENV = "GREEDYSNAKE_DEBUG_POOL"
POISON_BYTE = 0xFF
"""All bits set: NaN as fp32, bf16 and fp16 (exponent all ones, mantissa not zero)."""


def debug_pool_enabled() -> bool:
    return os.environ.get(DEBUG_POOL_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


FRAGMENTED_WAIT_S = 1.0
"""How long a request whose bytes fit the budget but no free range waits for releases (transfers or the
optimizer lane in flight) before the arena maps another segment."""

FRAGMENTED_POLL_S = 0.05
"""How often a waiting request (fragmented, or a full budget) asks again whether anything will be
released: the other thread may have blocked on the asker since (the training thread waiting on the
optimizer lane whose job asks), and nothing would wake the request to see it."""


class PoolCorruptionError(AssertionError):
    """Debug pool: a buffer was written while it was free (a transfer or a thread still used it)."""


class CarvedBuffer(AlignedBuffer):
    """``nbytes`` of a :class:`StagingArena` segment at ``offset``: the arena owns (and registered) the
    memory, so :meth:`close` gives nothing back (the pool's release does)."""

    def __init__(self, segment: AlignedBuffer, segment_index: int, offset: int, nbytes: int) -> None:
        assert segment.tensor is not None and offset % ALIGN_BYTES == 0 and nbytes % ALIGN_BYTES == 0
        self.nbytes = nbytes
        self.segment_index, self.offset = segment_index, offset
        self._segment = segment
        self._mmap = None
        self._unpin = None
        # its own tensor over the segment's memory, not a view of the segment's tensor: views share their
        # base's version counter, so an in-place write into one buffer (a step's new weights) would look to
        # autograd like a change of every tensor saved from any other (weights used in place on the host).
        # Made outside inference mode whatever the caller's (an evaluation loop's): a slice of the segment's
        # tensor never was an inference tensor, and training writes into the buffer it carves later
        base = segment.tensor
        with torch.inference_mode(False):
            self.tensor = torch.empty(0, dtype=base.dtype).set_(
                base.untyped_storage(), base.storage_offset() + offset, (nbytes,))

    def memoryview(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        end = self.nbytes if nbytes is None else offset + nbytes
        assert 0 <= offset <= end <= self.nbytes, (offset, end, self.nbytes)
        return self._segment.memoryview(self.offset + offset, end - offset)

    @property
    def closed(self) -> bool:
        return self._segment.closed

    def pin(self, pin: Callable[[int, int], None], unpin: Callable[[int], None]) -> None:
        raise AssertionError("a carved buffer is pinned with its segment")

    def close(self) -> None:
        pass  # (the arena's memory: given back by the pool's release, freed with the arena)


class StagingArena:
    """Mapped segments (with a ``pinner``, page-locked: each registered once), with the free ranges of
    each (best fit, coalesced). Owned by a :class:`BufferPool`; every method is called with the pool's
    lock held."""

    def __init__(self, pinner: tuple[Callable[[int, int], None], Callable[[int], None]] | None,
                 debug: bool) -> None:
        self._pinner = pinner
        self._debug = debug
        self.segments: list[AlignedBuffer] = []
        self._holes: list[list[tuple[int, int]]] = []
        """Per segment: its free ranges ``(offset, nbytes)``, sorted by offset, none adjacent."""
        self.registrations = 0
        """Segments registered since construction."""

    @property
    def capacity_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def take(self, nbytes: int) -> CarvedBuffer | None:
        """``nbytes`` (aligned) from the smallest free range they fit (best fit: an exact fit reuses a
        buffer's own range, and a large range stays whole for a large request); None where none fits."""
        best: tuple[int, int, int] | None = None  # (size, segment, index of the range)
        for index, holes in enumerate(self._holes):
            for i, (_, size) in enumerate(holes):
                if size >= nbytes and (best is None or size < best[0]):
                    best = (size, index, i)
        if best is None:
            return None
        size, index, i = best
        holes = self._holes[index]
        offset = holes[i][0]
        holes[i : i + 1] = [(offset + nbytes, size - nbytes)] if size > nbytes else []
        return CarvedBuffer(self.segments[index], index, offset, nbytes)

    def grow(self, nbytes: int, segment_bytes: int) -> CarvedBuffer:
        """``nbytes`` at the start of a new segment of at least ``segment_bytes`` (registered, with a
        pinner)."""
        segment = AlignedBuffer(align_up(max(nbytes, segment_bytes)))
        if self._pinner is not None:
            segment.pin(*self._pinner)
            self.registrations += 1
        if self._debug:
            BufferPool._poison(segment)
        self.segments.append(segment)
        self._holes.append([(nbytes, segment.nbytes - nbytes)] if segment.nbytes > nbytes else [])
        return CarvedBuffer(segment, len(self.segments) - 1, 0, nbytes)

    def give_back(self, buf: CarvedBuffer) -> None:
        holes = self._holes[buf.segment_index]
        start, end = buf.offset, buf.offset + buf.nbytes
        i = bisect.bisect_left(holes, (start, 0))
        assert (i == len(holes) or end <= holes[i][0]) and (i == 0 or sum(holes[i - 1]) <= start), "given back twice"
        if i < len(holes) and holes[i][0] == end:  # merge with the range after it
            end += holes.pop(i)[1]
        if i > 0 and sum(holes[i - 1]) == start:  # and with the one before
            i -= 1
            start = holes.pop(i)[0]
        holes.insert(i, (start, end - start))

    def close(self) -> None:
        for segment in self.segments:
            segment.close()  # (unpinned first)
        self.segments.clear()
        self._holes.clear()


class BufferPool:
    def __init__(self, budget_bytes: int, wait_timeout_s: float = 120.0, debug: bool | None = None,
                 pinner: tuple[Callable[[int, int], None], Callable[[int], None]] | None = None,
                 others_active: Callable[[], bool] | None = None) -> None:
        self.debug = debug_pool_enabled() if debug is None else debug
        """Poison released buffers and check them on reuse (see the module's docstring)."""
        self._last_owner: dict[object, str] = {}
        """Debug mode: who held each free buffer last (its ``what``), for the corruption message."""
        self._owner: dict[int, str] = {}
        self._budget_bytes = budget_bytes
        """The most bytes in use at once. Written under ``_cond`` (:meth:`set_budget`)."""
        self.wait_timeout_s = wait_timeout_s
        self._cond = threading.Condition()
        self._in_use: dict[int, AlignedBuffer] = {}
        self.in_use_bytes = 0
        self._closed = False
        self._returning = 0
        """Buffers whose owners released them but that wait for I/O to finish before coming back."""
        self._arena = StagingArena(pinner, self.debug)
        """The segments every buffer is carved from (see the module's docstring); with a ``pinner`` (``(pin,
        unpin)`` of the device tier), registered."""
        self.others_active = others_active
        """Whether a thread other than the caller holds buffers it will give back without the caller going
        on (asked by the calling thread, about the other: :meth:`StepLane.others_will_release
        <lightning_greedysnake.optim.lane.StepLane.others_will_release>`): then waiting for memory makes
        sense even when no I/O is in flight."""
        self.unserved_growths = 0
        """Segments added for a fragmented request that nothing in flight could serve (no transfer on
        its way back, and ``others_active`` false: the other thread gone idle or blocked on the asker).
        Written under ``_cond``; read after a drain."""
        self.valve_growths = 0
        """Segments added after a fragmented request waited :data:`FRAGMENTED_WAIT_S` for a release
        that did not come (likewise)."""

    @property
    def budget_bytes(self) -> int:
        return self._budget_bytes

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget (any thread; a larger one wakes the acquisitions waiting for room)."""
        with self._cond:
            self._budget_bytes = budget_bytes
            self._cond.notify_all()

    def acquire(self, nbytes: int, *, block: bool = True, what: str = "buffer",
                returning_wait_s: float = 0.0) -> AlignedBuffer | None:
        """A buffer of at least ``nbytes``; ``None`` when ``block`` is False and the budget is full.
        ``returning_wait_s`` (with ``block`` False): a request that does not fit waits up to that long for
        buffers already released whose writes are still in flight (write-behind) to come back, never for
        a holder to release one: those bytes are free in all but the timing."""
        nbytes = align_up(nbytes)
        if nbytes > self.budget_bytes:
            raise BufferBudgetError(
                f"{what} needs {nbytes} bytes but offload.buffer_budget_bytes={self.budget_bytes}. Fix: raise "
                "offload.buffer_budget_bytes (or leave it None for automatic), or lower layers_per_unit."
            )
        fragmented_s = full_s = 0.0
        deadline = time.monotonic() + returning_wait_s
        with self._cond:
            assert not self._closed, "buffer pool is closed"
            arena = self._arena
            while True:
                fits = self.in_use_bytes + nbytes <= self._budget_bytes
                buf = None
                if fits:
                    buf = arena.take(nbytes)
                    if buf is None and arena.capacity_bytes < self._budget_bytes:
                        buf = arena.grow(nbytes, self._budget_bytes - arena.capacity_bytes)  # (first use, a larger budget)
                if buf is None and not block:  # (the budget full, or fragmented: as if full)
                    left = deadline - time.monotonic()
                    if self._returning == 0 or left <= 0:
                        return None
                    self._cond.wait(left)  # (a write-behind's completion gives its buffer back, and notifies)
                    continue
                if fits:
                    in_flight = self._returning > 0 or (self.others_active is not None and self.others_active())
                    if buf is None and (not in_flight or fragmented_s >= FRAGMENTED_WAIT_S):
                        # nothing coming back makes room, or not soon: one more segment
                        buf = arena.grow(nbytes, self._budget_bytes // 4)
                        if in_flight:
                            self.valve_growths += 1
                        else:
                            self.unserved_growths += 1
                    if buf is not None:
                        if self.debug:
                            self._check_poison(buf, what)
                        break
                    # the bytes fit but no free range does: wait for a release to make one (as a full
                    # budget waits), rather than map memory in the steady state
                    t0 = time.monotonic()
                    self._cond.wait(FRAGMENTED_POLL_S)
                    fragmented_s += time.monotonic() - t0
                    continue
                # (here the request does not fit the budget: a non-blocking one returned None above)
                if self._returning == 0 and not (self.others_active is not None and self.others_active()):
                    # nothing in flight will ever give memory back: waiting would hang
                    raise BufferBudgetError(
                        f"{what} needs {nbytes} bytes of staging memory but {self.in_use_bytes} of "
                        f"offload.buffer_budget_bytes={self.budget_bytes} are held by work in progress"
                        f"{self._holders()}. Fix: raise offload.buffer_budget_bytes (or leave it None for automatic)."
                    )
                # waits in short slices, asking again each time: the other thread may block on this
                # one meanwhile (the training thread waiting on the lane whose job asks), and nothing
                # would wake this wait to see that the room will never come. The timeout counts the
                # time since anything came back (a notification), as one long wait would
                t0 = time.monotonic()
                full_s = 0.0 if self._cond.wait(FRAGMENTED_POLL_S) else full_s + time.monotonic() - t0
                if full_s >= self.wait_timeout_s:
                    raise BufferBudgetError(
                        f"waited {self.wait_timeout_s:.0f} s for {nbytes} bytes of staging memory ({what}); "
                        f"{self.in_use_bytes} of offload.buffer_budget_bytes={self.budget_bytes} stay in use"
                        f"{self._holders()}. Fix: raise offload.buffer_budget_bytes."
                    )
            self._in_use[id(buf)] = buf
            if self.debug:
                self._owner[id(buf)] = what
            self.in_use_bytes += nbytes
            return buf

    def wait_returned(self) -> None:
        """Block until every buffer released with transfers still on it has come back (their last
        transfer's completion callback gives it back, which can run just after a waiter on that
        transfer woke up)."""
        with self._cond:
            self._cond.wait_for(lambda: self._returning == 0, timeout=self.wait_timeout_s)

    def will_return(self) -> None:
        """A released buffer waits for I/O; :meth:`release` (with ``returning=True``) follows."""
        with self._cond:
            self._returning += 1

    def release(self, buf: AlignedBuffer, returning: bool = False) -> None:
        with self._cond:
            if returning:
                self._returning -= 1
            owned = self._in_use.pop(id(buf), None)
            assert owned is buf, "released a buffer this pool did not hand out"
            self.in_use_bytes -= buf.nbytes
            assert isinstance(buf, CarvedBuffer)
            if self.debug and not self._closed:
                self._poison(buf)
                self._last_owner[(buf.segment_index, buf.offset)] = self._owner.pop(id(buf), "?")
            self._arena.give_back(buf)
            if self._closed and not self._in_use:
                self._arena.close()
            self._cond.notify_all()

    @staticmethod
    def _poison(buf: AlignedBuffer) -> None:
        assert buf.tensor is not None
        buf.tensor.fill_(POISON_BYTE)

    def _check_poison(self, buf: AlignedBuffer, what: str) -> None:
        assert buf.tensor is not None
        changed = (buf.tensor != POISON_BYTE).nonzero()
        if changed.numel():
            first, count = int(changed[0]), int(changed.numel())
            raise PoolCorruptionError(
                f"debug pool: a free buffer of {buf.nbytes} bytes was written while nobody owned it ({count} "
                f"bytes changed, the first at offset {first}); its last owner was "
                f"{self._last_owner_of(buf)!r}, now acquired for {what!r}. A transfer or a thread "
                "still used it after it was given back."
            )

    def _holders(self) -> str:
        """Debug mode: who holds the buffers in use, for an error (call with the lock held)."""
        if not self.debug:
            return ""
        held = ", ".join(f"{self._owner.get(key, '?')} ({buf.nbytes})" for key, buf in self._in_use.items())
        return f" ({held})"

    def _last_owner_of(self, buf: CarvedBuffer) -> str:
        """(The last owner of the range that started where ``buf`` starts.)"""
        return self._last_owner.get((buf.segment_index, buf.offset), "?")

    @property
    def registrations(self) -> int:
        """Page-lock registrations of the pool's memory since construction (the arena's segments)."""
        with self._cond:
            return self._arena.registrations

    def shrink(self, budget_bytes: int) -> None:
        """A smaller budget, and with nothing in use the segments given back to the system (a request maps a
        new one, of at most the new budget). The end of a run: the hand-back needs one unit's staging, not
        the run's."""
        with self._cond:
            self._budget_bytes = budget_bytes
            if not self._in_use:
                self._arena.close()

    def close(self) -> None:
        """Frees the segments now, or as the last buffer still in use comes back."""
        with self._cond:
            self._closed = True
            if not self._in_use:
                self._arena.close()
