"""The saved-activation store: each unit's input per micro-batch, kept from forward to backward.

On the host tier a saved activation is the tensor itself. On the SSD tier it is written to a scratch file at
once (the staging buffer comes back when the write is done) and read back just in time: for the op
that uses it (:meth:`load`), one op ahead when the budget's slack allows (:meth:`prefetch`), and given
back as soon as the op is done with it (:meth:`release` after a forward, :meth:`drop` after its
backward). So memory holds one saved activation being used and at most one being read ahead, whatever K and
the number of units, plus those still being written (bounded by the budget: a save waits for writes to
return buffers).

Device tier (``copies``): saved activations are computed in device memory. On the ``device`` tier they stay
there; on ``host`` each is copied (D2H stream, after the event right after the forward that produced it)
into page-locked host memory and back (H2D stream); on ``ssd`` the D2H copy lands in a staging buffer
whose write to the scratch file is submitted when the copy completes (chained, on the copy's completion
thread), and the read-back bytes are copied to device memory. The copy back is issued one op ahead, by
:meth:`prefetch` (a host saved activation's at once, ordered after its D2H copy on the device; an SSD one's on
the I/O thread that completes its read), into new memory of the H2D stream's, so it waits for none of
the ops queued on the compute stream and overlaps the op before the one that loads it; :meth:`load`
makes the compute stream wait for it (a copy not prefetched is issued there, just in time). So device
memory holds, besides the saved activation in use, at most the one read ahead.

Threads: the training thread; reads and writes complete on I/O threads and are ordered here: a
saved activation is read only after its write completed, and the scratch file closes only after every
transfer on it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lightning_greedysnake.config import OffloadConfig, TensorKind, Tier
from lightning_greedysnake.io import IOEngine, OffloadFile, align_up
from lightning_greedysnake.offload.device import FRESH, Copy, DeviceCopies, then
from lightning_greedysnake.offload.preflight import check_room, human_bytes
from lightning_greedysnake.offload.regions import FILE_NAMES
from lightning_greedysnake.offload.staging import Staged, StagingArena
from lightning_greedysnake.offload.stats import IOStats
from lightning_greedysnake.offload.tiers import SSDScratch


@dataclass(frozen=True)
class ActivationTierPlan:
    """``auto=True`` with ``offload.activations`` unset: the saved activations' tier is decided at their
    first save, when their size is known: host memory while a window's fit ``share_bytes``, else SSD."""

    share_bytes: int
    """Their share of the host budget (1/8 of it)."""
    report: Callable[[str], None]
    """Says where they went, once (rank zero's info)."""


@dataclass
class _OnSSD:
    offset: int
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype
    write: Future[None]
    scratch: SSDScratch
    """The scratch file (of the offload directory) that holds it."""
    loaded: Staged | None = None
    """The saved activation's bytes in memory (its reads perhaps still in flight when read ahead)."""
    read: Future[None] | None = None
    """The read that fills ``loaded``."""
    on_device: Tensor | None = None
    """Device tier: the saved activation in device memory (until release or drop): the forward's output,
    or the loaded bytes copied there."""
    pending: Future[Copy] | None = None
    """Device tier: the H2D copy into ``on_device`` issued ahead of the op that loads it (resolved once
    issued, on the read's completion), which that op's compute waits for (:meth:`ActivationStore.load`)."""


@dataclass
class _OnHost:
    """Device tier, ``host`` saved activations: the copy in page-locked host memory."""

    host: Tensor
    shape: torch.Size
    landed: Copy
    """The D2H copy that fills ``host``."""
    on_device: Tensor | None = None
    """The saved activation in device memory: the forward's output, or ``host`` copied back
    (until release)."""
    pending: Copy | None = None
    """The H2D copy into ``on_device`` issued ahead of the op that loads it, not waited for yet."""


class ActivationStore:
    def __init__(self, arena: StagingArena, config: OffloadConfig, stats: IOStats,
                 copies: DeviceCopies | None = None, plan: ActivationTierPlan | None = None) -> None:
        """``plan``: ``auto=True`` with ``offload.activations`` unset, their share of the host budget and
        where to report: the first save, which knows the saved activations' size, keeps a window's saved
        activations in host memory if they fit that share, else puts them on SSD (where the run has an offload
        directory), and says so."""
        self._arena = arena
        self._copies = copies
        self._copied: dict[tuple[int, int], _OnHost] = {}
        """Device tier, ``host`` saved activations."""
        self._config = config
        self._stats = stats
        self._scratches: list[SSDScratch] = []
        """One scratch file per offload directory; unit u's saved activations in ``u % len(...)``'s."""
        self._host: dict[tuple[int, int], Tensor] = {}
        self._ssd: dict[tuple[int, int], _OnSSD] = {}
        self._loaded = 0
        self.peak_loaded = 0
        """Most SSD saved activations in memory at once (in use or read ahead), since construction."""
        self.unit_input_bytes = 0
        """The largest saved activation seen (one unit input of one micro-batch), for planning."""
        self.prefetches = 0
        """SSD saved activation reads started ahead of need, since construction."""
        self.device_loads: dict[str, int] = {"ahead": 0, "just_in_time": 0}
        """Device tier: H2D copies of saved activations back to the device, issued one op ahead
        (:meth:`prefetch`) or by the op that loads them, since construction (training thread)."""
        self.files: list[Path] = []
        self._window_counts: list[int] = []
        """Per scratch file, the saved activations a window saves there (K micro-batches x its units)."""
        self._window: tuple[int, int] = (0, 0)
        """The window's (micro-batches, units), from :meth:`begin_window`."""
        self._reserved = False
        self.tier: Tier = config.tier(TensorKind.ACTIVATIONS)  # type: ignore[assignment]
        """Where saved activations go (host, SSD or device); planned at the first save with a ``plan``."""
        self._plan = plan
        self._offload: tuple[list[Path], list[IOEngine]] = ([], [])

    def _decide(self, nbytes: int) -> None:
        assert self._plan is not None
        plan, self._plan = self._plan, None
        share, report = plan.share_bytes, plan.report
        count = self._window[0] * max(0, self._window[1] - 1)
        need = count * nbytes
        if need <= share:
            report(f"greedysnake: saved activations in host memory ({count} of {nbytes:,} bytes a window: "
                   f"{need:,} bytes, within their share of the host budget, {share:,})")
            return
        dirs, engines = self._offload
        if not dirs:
            report(f"greedysnake: saved activations stay in host memory, {need:,} bytes a window, over their "
                   f"share of the host budget ({share:,}): this run has no offload directory (nothing else is on "
                   "SSD). Fix: offload.activations=ssd with offload.path, or a smaller micro-batch.")
            return
        self.tier = Tier.SSD
        self.open(dirs, engines)
        self.begin_window(*self._window)
        report(f"greedysnake: saved activations on SSD ({count} of {nbytes:,} bytes a window: {need:,} bytes, "
               f"over their share of the host budget, {share:,}; set offload.activations to fix it)")

    def open(self, offload_dirs: list[Path], engines: list[IOEngine]) -> None:
        """On the SSD tier: a scratch file in each offload directory (saved activations striped by unit)."""
        self._offload = (offload_dirs, engines)
        if self.tier is Tier.SSD:
            assert offload_dirs and len(engines) == len(offload_dirs), "SSD saved activations need an offload directory"
            for directory, engine in zip(offload_dirs, engines, strict=True):
                path = directory / FILE_NAMES[TensorKind.ACTIVATIONS]
                self.files.append(path)
                self._scratches.append(SSDScratch(TensorKind.ACTIVATIONS.value, engine, path, self._stats))
            self._window_counts = [0] * len(self._scratches)

    def to_ssd(self) -> None:
        """Between windows: saved activations go to SSD from the next window on (the warm-step plan's kept
        graphs on SSD), in this run's offload directories."""
        if self.tier is Tier.SSD:
            return
        dirs, engines = self._offload
        assert dirs and not self._host and not self._copied, "to SSD between windows, with an offload directory"
        self._plan = None  # (decided)
        self.tier = Tier.SSD
        self.open(dirs, engines)

    def open_files(self) -> list[OffloadFile]:
        return [scratch.file for scratch in self._scratches]

    def begin_window(self, num_microbatches: int, num_units: int) -> None:
        """A window of ``num_microbatches`` begins (saved activations: the input of every unit but the first):
        at its first save, when their size is known, each scratch file gets room for all of its
        saved activations at once (a disk too small fails there, with the fix)."""
        self._window = (num_microbatches, num_units)
        n = max(1, len(self._scratches))
        self._window_counts = [num_microbatches * sum(1 for u in range(1, num_units) if u % n == d) for d in range(n)]
        self._reserved = False

    def save(self, unit: int, microbatch: int, hidden: Tensor) -> None:
        key = (unit, microbatch)
        nbytes = hidden.numel() * hidden.element_size()
        self.unit_input_bytes = max(self.unit_input_bytes, nbytes)
        if self._plan is not None:
            self._decide(nbytes)
        assert key not in self._host and key not in self._ssd and key not in self._copied, f"saved activation {key} twice"
        if not self._scratches:  # (not on SSD)
            if self._copies is not None and self.tier is Tier.HOST:
                host = self._copies.empty_host(hidden.numel(), hidden.dtype)
                # the device tensor stays for the next unit's forward (no wait for the copy there);
                # released after it, read back for backward. Ordering: the D2H copy follows the forward
                # that produced ``hidden`` (the compute stream's point now: save comes right after it)
                landed = self._copies.to_host(hidden.reshape(-1), host, after=self._copies.compute_event())
                self._copied[key] = _OnHost(host, hidden.shape, landed, on_device=hidden)
            else:
                self._host[key] = hidden
            return
        self._arena.budget.reserve_activations(nbytes)
        if not self._reserved:
            self._check_room(nbytes)
            for scratch, count in zip(self._scratches, self._window_counts, strict=True):
                scratch.reserve(count * align_up(nbytes))
            self._reserved = True
        held = self._arena.acquire(nbytes, f"saved activation of unit {unit}")
        try:
            scratch, buf = self._scratches[unit % len(self._scratches)], held.buf
            offset = scratch.allocate(nbytes)
            if self._copies is None:
                held.view(hidden.dtype, hidden.numel()).copy_(hidden.reshape(-1))
                write = scratch.submit("write", offset, buf, nbytes)
            else:
                # ordering: after the forward that produced ``hidden`` (the compute stream's point now)
                landed = self._copies.to_host(hidden.reshape(-1), held.view(hidden.dtype, hidden.numel()),
                                              after=self._copies.compute_event())
                # the write reads the buffer only once the D2H copy filled it
                write = then(landed, lambda: scratch.submit("write", offset, buf, nbytes))
            held.track_write(write)
        finally:
            held.release()  # back once written
        # device tier: the device tensor stays for the next unit's forward, as on the host tier
        self._ssd[key] = _OnSSD(offset, nbytes, hidden.shape, hidden.dtype, write, scratch,
                                on_device=hidden if self._copies is not None else None)

    def _check_room(self, nbytes: int) -> None:
        """Before the window's first saved activation is written: room in each offload directory for all of the
        window's there (``nbytes`` each). The start-of-run preflight cannot count them (their size is known
        at the first save), so this is their preflight: a disk too small is refused here, before anything
        of the window is written or stepped, naming the directory, the bytes and the fix."""
        for scratch, count in zip(self._scratches, self._window_counts, strict=True):
            total = align_up(count * align_up(nbytes))
            more = total - scratch.file.size_bytes
            if more > 0:
                check_room(scratch.path.parent, more,
                           f"this run's saved activations ({count} of {human_bytes(nbytes)} a window in this "
                           f"directory, {human_bytes(total)}: the input of every unit but the first, for each micro-batch of the window; "
                           "sized at the first window, checked before any of it is written)",
                           fixes=("keep saved activations in host memory (offload.activations=host)",
                                  "use a smaller micro-batch or fewer micro-batches a step (accumulate_grad_batches)"))

    def load(self, unit: int, microbatch: int) -> Tensor:
        """The saved activation, in memory until :meth:`release` or :meth:`drop`; on a device tier the compute
        stream's later work waits for its copy to the device."""
        key = (unit, microbatch)
        if not self._scratches:
            copied = self._copied.get(key)
            if copied is None:
                return self._host[key]
            if copied.on_device is None:  # (not prefetched: just in time)
                self._copy_back(copied)
                self.device_loads["just_in_time"] += 1
            if copied.pending is not None:
                assert self._copies is not None
                self._copies.wait(copied.pending)  # hand-over: the H2D stream -> this op's compute
                copied.pending = None
            return copied.on_device  # type: ignore[return-value]
        ck = self._ssd[key]
        if ck.on_device is not None and ck.pending is None:
            return ck.on_device  # (the forward's output, kept for the next unit's; or loaded already)
        if ck.loaded is None:
            ck.write.result()  # the read must see the completed write
            held = self._arena.acquire(ck.nbytes, f"saved activation of unit {unit}")
            self._read(ck, held)
        held = ck.loaded
        assert held is not None
        held.take_over()
        if held.reads_pending:
            try:
                self._arena.await_reads(held, label=TensorKind.ACTIVATIONS.value)
            except BaseException:
                # (await_reads gave it back)
                ck.loaded, ck.read, ck.on_device, ck.pending = None, None, None, None
                self._loaded -= 1
                raise
        host = held.view(ck.dtype, ck.shape.numel())
        if self._copies is None:
            return host.view(ck.shape)
        if ck.pending is not None:
            copy = ck.pending.result()  # issued as the read completed (just waited for: a moment at most)
        else:  # (not prefetched: just in time)
            self.device_loads["just_in_time"] += 1
            flat, copy = self._copies.to_new_device(host)
            ck.on_device = flat.view(ck.shape)
            held.track_write(copy)  # the staging buffer goes back only after the copy read it
        ck.pending = None
        self._copies.wait(copy)  # hand-over: the H2D stream -> the compute stream (the op that loads it)
        return ck.on_device  # type: ignore[return-value]

    def _copy_back(self, copied: _OnHost) -> None:
        """Start ``copied``'s H2D copy into new device memory, ordered after the D2H copy that filled its
        host memory (on the device: no host wait) and after no compute."""
        assert self._copies is not None
        flat, copied.pending = self._copies.to_new_device(copied.host, after=copied.landed)
        copied.on_device = flat.view(copied.shape)

    def prefetch(self, unit: int, microbatch: int) -> None:
        """The op after the current one reads this saved activation: start bringing it in now. Host
        saved activations on a device tier: the H2D copy starts now. SSD: the read starts now (from the budget's slack, and
        only once its write is complete: a read never races the write), and on a device tier the H2D copy
        as soon as it lands (on the I/O thread that completes it)."""
        key = (unit, microbatch)
        copied = self._copied.get(key)
        if copied is not None:
            if copied.on_device is None:
                self._copy_back(copied)
                self.device_loads["ahead"] += 1
            return
        ck = self._ssd.get(key)
        if ck is None or ck.on_device is not None:
            return
        if ck.loaded is None:
            if not ck.write.done():
                return
            held = self._arena.acquire_optional(ck.nbytes, f"saved activation of unit {unit} read-ahead")
            if held is None:
                return
            self._read(ck, held)
            self.prefetches += 1
        if self._copies is not None and ck.read is not None:
            self._copy_after_read(ck, ck.read)

    def _copy_after_read(self, ck: _OnSSD, read: Future[None]) -> None:
        """Issue ``ck``'s H2D copy once ``read`` landed its bytes in ``ck.loaded``: into new memory of the
        H2D stream's (allocated here, training thread), from the I/O thread that completes the read.
        ``ck.loaded`` tracks the copy (given back only after it); ``ck.pending`` resolves to it once
        issued (or fails as the read or the issue did: :meth:`load` raises the read's own error first)."""
        assert self._copies is not None and ck.loaded is not None
        copies, held = self._copies, ck.loaded
        host = held.view(ck.dtype, ck.shape.numel())
        flat = copies.empty_for_h2d(host.numel(), host.dtype)
        issued: Future[Copy] = Future()

        def issue() -> Copy:  # on the I/O thread, once the read landed
            try:
                copy = copies.to_device(host, flat, after=FRESH)  # (new memory: waits for no compute)
            except BaseException as err:
                issued.set_exception(err)
                raise
            issued.set_result(copy)
            return copy

        def not_issued(f: Future[None]) -> None:  # (a failed read: nothing issued; load raises its error)
            if (err := f.exception()) is not None and not issued.done():
                issued.set_exception(err)

        landed = then(read, issue)
        landed.add_done_callback(not_issued)
        held.track_write(landed)  # the staging buffer goes back only after the copy read it
        ck.on_device, ck.pending = flat.view(ck.shape), issued
        self.device_loads["ahead"] += 1

    def _read(self, ck: _OnSSD, held: Staged) -> None:
        try:
            read = ck.scratch.submit("read", ck.offset, held.buf, ck.nbytes)
            held.track_read(read)
        except BaseException:
            held.release()
            raise
        ck.loaded, ck.read = held, read
        self._loaded += 1
        self.peak_loaded = max(self.peak_loaded, self._loaded)

    def release(self, unit: int, microbatch: int) -> None:
        """The op is done with the saved activation for now; it stays stored (on SSD: its buffer
        goes back)."""
        ck = self._ssd.get((unit, microbatch))
        if ck is not None:
            ck.on_device, ck.pending = None, None  # device memory back to its allocator (uses recorded)
            if ck.loaded is not None:
                self._unload(ck)
        copied = self._copied.get((unit, microbatch))
        if copied is not None:
            copied.on_device, copied.pending = None, None  # (device memory back to its allocator)

    def drop(self, unit: int, microbatch: int) -> None:
        """The saved activation will not be read again in this window."""
        self._host.pop((unit, microbatch), None)
        self._copied.pop((unit, microbatch), None)
        ck = self._ssd.pop((unit, microbatch), None)
        if ck is not None and ck.loaded is not None:
            self._unload(ck)  # a read-ahead may still be filling it: the handle waits for that

    def _unload(self, ck: _OnSSD) -> None:
        held, ck.loaded, ck.read = ck.loaded, None, None
        ck.on_device, ck.pending = None, None
        assert held is not None
        self._loaded -= 1
        held.release()

    def _drop_all(self, closing: bool) -> None:
        """Drop every saved activation, each once its write completed (raising a failed one
        unless ``closing``)."""
        for key in list(self._ssd):
            ck = self._ssd[key]
            self.drop(*key)
            # (closing: a write chained after a device copy may not be submitted yet)
            (ck.write.exception if closing else ck.write.result)()
        self._host.clear()
        self._copied.clear()

    def end_window(self) -> None:
        """Forget the window's saved activations; the scratch space is reused by the next window."""
        self._drop_all(closing=False)
        for scratch in self._scratches:
            scratch.reset()

    def close(self) -> None:
        """Give back every loaded saved activation and close the scratch file once nothing is in flight
        on it."""
        self._drop_all(closing=True)
        scratches, self._scratches = self._scratches, []
        for scratch in scratches:
            scratch.close()

    def flush(self) -> None:
        """Wait for every saved activation transfer in flight."""
        for scratch in self._scratches:
            scratch.wait_all()
