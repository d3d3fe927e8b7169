"""Page-aligned staging buffers under a byte budget, with explicit acquire and release.

The budget caps what the tensor manager holds in host memory at once: weights in use and prefetched,
the optimizer's working set, checkpoints in flight. A request that can never fit is an error up front;
one that fits later waits for a release (write-behind completions release from I/O threads).

Nobody calls :meth:`BufferPool.release` directly but a :class:`~lightning_greedysnake.offload.staging.Staged`
handle, which does so only after every transfer on its buffer completed.

Debug mode (``GREEDYSNAKE_DEBUG_POOL=1``, or ``debug=True``): every buffer the pool hands out fresh and
every buffer given back is filled with a poison pattern (all bits set: NaN in every float dtype), and an
acquisition of a cached buffer first checks that the pattern is intact. So a read of a buffer after it
was given back computes with NaN instead of plausible stale numbers, and a late write into a free
buffer (an I/O still filling it) is an error naming the buffer's last owner.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Callable

from lightning_greedysnake.io import AlignedBuffer, align_up

DEBUG_POOL_ENV = "GREEDYSNAKE_DEBUG_POOL"
POISON_BYTE = 0xFF
"""All bits set: NaN as fp32, bf16 and fp16 (exponent all ones, mantissa not zero)."""


def debug_pool_enabled() -> bool:
    return os.environ.get(DEBUG_POOL_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


class BufferBudgetError(ValueError):
    """A single request is larger than the whole budget, or the budget stayed full too long."""


class PoolCorruptionError(AssertionError):
    """Debug pool: a buffer was written while it was free (a transfer or a thread still used it)."""


class BufferPool:
    def __init__(self, budget_bytes: int, wait_timeout_s: float = 120.0, debug: bool | None = None,
                 pinner: tuple[Callable[[int, int], None], Callable[[int], None]] | None = None,
                 others_active: Callable[[], bool] | None = None) -> None:
        self.debug = debug_pool_enabled() if debug is None else debug
        """Poison released buffers and check them on reuse (see the module's docstring)."""
        self._last_owner: dict[int, str] = {}
        """Debug mode: who held each free buffer last (its ``what``), for the corruption message."""
        self._owner: dict[int, str] = {}
        self._budget_bytes = budget_bytes
        """The most bytes held at once (in use plus cached). Written under ``_cond`` (:meth:`set_budget`)."""
        self.wait_timeout_s = wait_timeout_s
        self._cond = threading.Condition()
        self._free: dict[int, list[AlignedBuffer]] = defaultdict(list)
        self._free_bytes = 0
        self._in_use: dict[int, AlignedBuffer] = {}
        self.in_use_bytes = 0
        self.peak_bytes = 0
        """Most bytes held at once (in use plus cached), since construction."""
        self._closed = False
        self._returning = 0
        """Buffers whose owners released them but that wait for I/O to finish before coming back."""
        self.pinner = pinner
        """``(pin, unpin)`` of the device tier: every new buffer is page-locked for asynchronous copies."""
        self.others_active = others_active
        """Whether another thread (the optimizer lane) holds buffers it will give back: then waiting for
        memory makes sense even when no I/O is in flight."""

    @property
    def budget_bytes(self) -> int:
        return self._budget_bytes

    def set_budget(self, budget_bytes: int) -> None:
        """A new budget (any thread; a larger one wakes the acquisitions waiting for room)."""
        with self._cond:
            self._budget_bytes = budget_bytes
            self._cond.notify_all()

    def acquire(self, nbytes: int, *, block: bool = True, what: str = "buffer") -> AlignedBuffer | None:
        """A buffer of at least ``nbytes``; ``None`` when ``block`` is False and the budget is full."""
        nbytes = align_up(nbytes)
        if nbytes > self.budget_bytes:
            raise BufferBudgetError(
                f"{what} needs {nbytes} bytes but offload.buffer_budget_bytes={self.budget_bytes}. Fix: raise "
                "offload.buffer_budget_bytes (or leave it None for automatic), or lower layers_per_unit."
            )
        with self._cond:
            assert not self._closed, "buffer pool is closed"
            while True:
                if not block and self.in_use_bytes + nbytes > self._budget_bytes:
                    return None
                cached = self._free.get(nbytes)
                if cached:
                    buf = cached.pop()
                    self._free_bytes -= nbytes
                    if self.debug:
                        self._check_poison(buf, what)
                    break
                if self.in_use_bytes + nbytes <= self.budget_bytes:
                    self._evict(self.in_use_bytes + self._free_bytes + nbytes - self.budget_bytes)
                    buf = AlignedBuffer(nbytes)
                    if self.pinner is not None:
                        buf.pin(*self.pinner)
                    if self.debug:
                        self._poison(buf)  # fresh memory is zero: as plausible as stale numbers
                    break
                if not block:
                    return None
                if self._returning == 0 and not (self.others_active is not None and self.others_active()):
                    # nothing in flight will ever give memory back: waiting would hang
                    raise BufferBudgetError(
                        f"{what} needs {nbytes} bytes of staging memory but {self.in_use_bytes} of "
                        f"offload.buffer_budget_bytes={self.budget_bytes} are held by work in progress. Fix: "
                        "raise offload.buffer_budget_bytes (or leave it None for automatic)."
                    )
                if not self._cond.wait(self.wait_timeout_s):
                    raise BufferBudgetError(
                        f"waited {self.wait_timeout_s:.0f} s for {nbytes} bytes of staging memory ({what}); "
                        f"{self.in_use_bytes} of offload.buffer_budget_bytes={self.budget_bytes} stay in use. "
                        "Fix: raise offload.buffer_budget_bytes."
                    )
            self._in_use[id(buf)] = buf
            if self.debug:
                self._owner[id(buf)] = what
            self.in_use_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.in_use_bytes + self._free_bytes)
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
            if self._closed:
                buf.close()
            else:
                if self.debug:
                    self._poison(buf)
                    self._last_owner[id(buf)] = self._owner.pop(id(buf), "?")
                self._free[buf.nbytes].append(buf)
                self._free_bytes += buf.nbytes
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
                f"{self._last_owner.get(id(buf), '?')!r}, now acquired for {what!r}. A transfer or a thread "
                "still used it after it was given back."
            )

    def _evict(self, excess: int) -> None:
        """Close cached buffers until ``excess`` bytes are gone (called with the lock held)."""
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            while bufs and excess > 0:
                evicted = bufs.pop()
                self._last_owner.pop(id(evicted), None)
                evicted.close()
                self._free_bytes -= size
                excess -= size

    def close(self) -> None:
        """Frees cached buffers; buffers still in use are freed as they come back."""
        with self._cond:
            self._closed = True
            for bufs in self._free.values():
                for buf in bufs:
                    buf.close()
            self._free.clear()
            self._free_bytes = 0
