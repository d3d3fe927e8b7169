"""The device tier's transfers on the simulated device: copies are late, destinations are NaN until they
land, and every hand-over (a compute wait, a handle that tracks a copy, a chained write) holds."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from lightning_greedysnake.io import AlignedBuffer
from lightning_greedysnake.offload.device import SimulatedCopies, device_copies_for, then
from lightning_greedysnake.offload.pool import BufferPool
from lightning_greedysnake.offload.staging import Staged
from lightning_greedysnake.offload.tiers import HostRegions


@pytest.fixture
def copies():
    c = SimulatedCopies(max_delay_s=0.02, seed=0)
    yield c
    c.close()


def host(copies, values: torch.Tensor) -> torch.Tensor:
    """``values`` in host memory the device tier registered (an async copy refuses any other)."""
    out = copies.empty_host(values.numel(), values.dtype)
    out.copy_(values)
    return out


def test_a_simulated_copy_is_late_and_its_destination_nan_until_it_lands(copies):
    src = host(copies, torch.arange(1000, dtype=torch.float32))
    dst = copies.empty(1000, torch.float32)
    assert dst.isnan().all()  # fresh device memory is NaN, not zeros that might pass
    copy = copies.to_device(src, dst)
    assert not copy.done() and dst.isnan().all()  # still in flight
    copies.wait(copy)
    assert torch.equal(dst, src)


def test_a_copy_reads_its_source_when_it_runs_so_a_change_before_it_landed_shows():
    copies = SimulatedCopies(max_delay_s=0.05, seed=1)
    try:
        src = copies.empty(10, torch.float32).fill_(1.0)
        dst = copies.empty_host(10, torch.float32)
        copy = copies.to_host(src, dst)
        src.fill_(7.0)  # the owner changed the source before the copy was done: a missing wait
        copy.result()
        assert torch.equal(dst, torch.full((10,), 7.0))
    finally:
        copies.close()


def test_copies_of_one_direction_land_in_order_and_close_waits_for_them():
    copies = SimulatedCopies(max_delay_s=0.01, seed=2)
    order: list[int] = []
    dsts = [copies.empty(4, torch.float32) for _ in range(8)]
    for i, dst in enumerate(dsts):
        copies.to_device(host(copies, torch.full((4,), float(i))), dst).add_done_callback(lambda _, i=i: order.append(i))
    copies.close()  # waits for what is in flight
    assert order == list(range(8))
    assert all(torch.equal(d, torch.full((4,), float(i))) for i, d in enumerate(dsts))
    copies.close()  # idempotent


def test_then_submits_after_the_first_and_passes_failures_on():
    first: Future = Future()
    submitted = threading.Event()
    second: Future = Future()

    def submit() -> Future:
        submitted.set()
        return second

    chained = then(first, submit)
    assert not submitted.is_set()
    first.set_result(None)
    assert submitted.is_set() and not chained.done()
    second.set_result(None)
    assert chained.result(timeout=1) is None

    failed: Future = Future()
    never = then(failed, lambda: pytest.fail("submitted after a failed copy"))
    failed.set_exception(OSError("copy failed"))
    with pytest.raises(OSError, match="copy failed"):
        never.result(timeout=1)


def test_a_host_region_handle_waits_for_a_copy_reading_it_before_it_is_released(copies):
    """A host-tier region is changed in place by the optimizer step once its handle is given back: the
    device copy still reading it must land first."""
    regions = HostRegions("weights", [4096], pinner=(copies.pin, copies.unpin))
    try:
        held = Staged(regions.host_buffer(0), None, "unit 0 weights")
        held.view(torch.float32, 16).copy_(torch.arange(16.0))
        dst = copies.empty(16, torch.float32)
        copy = copies.to_device(held.view(torch.float32, 16), dst)
        held.track_write(copy)
        held.release()
        assert copy.done()  # release returned only after the copy
        regions.host_buffer(0).view(torch.float32, 16).zero_()  # the step may change it now
        assert torch.equal(dst, torch.arange(16.0))
    finally:
        regions.close()


def test_a_pooled_buffer_returns_to_the_pool_only_after_the_copy_out_of_it(copies):
    # poisons what comes back: an early return corrupts the copy
    pool = BufferPool(1 << 20, debug=True, pinner=(copies.pin, copies.unpin))
    buf = pool.acquire(4096, what="weights")
    assert buf is not None
    held = Staged(buf, pool, "weights")
    held.view(torch.float32, 16).copy_(torch.arange(16.0))
    dst = copies.empty(16, torch.float32)
    copy = copies.to_device(held.view(torch.float32, 16), dst)
    held.track_write(copy)
    held.release()
    assert pool.in_use_bytes == 4096 or copy.done()
    pool.wait_returned()
    assert copy.done() and pool.in_use_bytes == 0
    assert torch.equal(dst, torch.arange(16.0))
    pool.close()


def test_pinning_goes_through_the_device_and_is_undone_at_close():
    pinned: dict[int, int] = {}
    buf = AlignedBuffer(8192)
    buf.pin(lambda ptr, n: pinned.__setitem__(ptr, n), lambda ptr: pinned.pop(ptr))
    assert list(pinned.values()) == [8192]
    buf.close()
    assert pinned == {}


def test_the_device_tier_is_chosen_by_the_device_and_the_switch(monkeypatch):
    monkeypatch.delenv("GREEDYSNAKE_SIMULATE_DEVICE", raising=False)
    assert device_copies_for(torch.device("cpu")) is None
    monkeypatch.setenv("GREEDYSNAKE_SIMULATE_DEVICE", "1")
    sim = device_copies_for(torch.device("cpu"))
    assert isinstance(sim, SimulatedCopies)
    sim.close()


def test_devices_the_tensor_manager_does_not_run_on_are_refused_with_the_fix(monkeypatch):
    from lightning_greedysnake.config import GreedySnakeConfig, OffloadConfig
    from lightning_greedysnake.strategy.manager_setup import check_device

    default = GreedySnakeConfig()
    check_device(default, torch.device("cuda"), distributed=False)  # one GPU, state offloaded: served
    with pytest.warns(UserWarning, match=r"data parallel with offloading on CUDA .* not yet across real GPUs"):
        check_device(default, torch.device("cuda"), distributed=True)
    resident = GreedySnakeConfig(offload=OffloadConfig(weights="device"))
    check_device(resident, torch.device("cuda"), distributed=False)  # resident weights beside a host optimizer
    monkeypatch.setenv("GREEDYSNAKE_SIMULATE_DEVICE", "1")
    check_device(resident, torch.device("cpu"), distributed=False)
    with pytest.raises(ValueError, match=r"'cpu' or 'cuda' devices, not 'mps'.*Fix"):
        check_device(default, torch.device("mps"), distributed=False)


def test_the_byte_counters_are_exact_under_concurrent_copy_issuers():
    """``CopyCounts.add``: the training thread and the optimizer lane (a step's new resident weights) both
    issue copies, and the counters add every copy's bytes whichever threads issue them at once. An unlocked
    ``+=`` loses some when a thread switch lands between its read and its write; on CPython a bare
    ``int += int`` never switches there (nothing in it yields), so here the byte counts are an ``int``
    whose addition gives the GIL away (as any Python-level ``__add__`` may), with switching made frequent:
    without the lock, updates are lost."""
    import sys
    import time

    class Yielding(int):
        """A byte count whose arithmetic yields the GIL between the counter's read and its write."""

        def __mul__(self, other: object) -> Yielding:
            return Yielding(int(self) * int(other))  # type: ignore[call-overload]

        def __radd__(self, other: object) -> int:
            time.sleep(0)  # (releases the GIL: another issuer's whole += may run here)
            return int(other) + int(self)  # type: ignore[call-overload]

    class Tensor(torch.Tensor):
        def numel(self) -> int:
            return Yielding(super().numel())

    copies = SimulatedCopies(max_delay_s=0.0, seed=0)
    threads, per_thread = 8, 200
    src = host(copies, torch.ones(4)).as_subclass(Tensor)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        def issue() -> None:
            dst = copies.empty(4, torch.float32).as_subclass(Tensor)
            back = copies.empty_host(4, torch.float32).as_subclass(Tensor)
            for _ in range(per_thread):
                copies.to_device(src, dst)
                copies.to_host(dst, back)

        workers = [threading.Thread(target=issue) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(interval)
        copies.close()
    assert copies.counts.bytes_to_device == threads * per_thread * 16
    assert copies.counts.bytes_to_host == threads * per_thread * 16
    assert copies.counts.copies == 2 * threads * per_thread


# -- where real CUDA is stricter, the simulator is too ---------------------------------------------------
def test_an_async_copy_from_host_memory_nobody_registered_is_refused(copies):
    from lightning_greedysnake.offload.device import UnregisteredHostMemoryError

    dst = copies.empty(16, torch.float32)
    with pytest.raises(UnregisteredHostMemoryError, match="did not register"):
        copies.to_device(torch.ones(16), dst)  # pageable memory: synchronous (or wrong) on CUDA
    with pytest.raises(UnregisteredHostMemoryError):
        copies.to_host(dst, torch.empty(16))
    buf = AlignedBuffer(4096)
    buf.pin(copies.pin, copies.unpin)
    copies.to_device(buf.view(torch.float32, 16, 64), dst).result()  # a view inside a pinned buffer
    buf.close()  # unpinned
    with pytest.raises(UnregisteredHostMemoryError):
        copies.to_device(AlignedBuffer(4096).view(torch.float32, 16), dst)
    copies.to_host(dst, copies.empty_host(16, torch.float32)).result()


def test_a_copy_after_another_streams_work_waits_for_it_and_copies_nan_if_not():
    copies = SimulatedCopies(max_delay_s=0.01, seed=3)
    try:
        reduced = copies.empty(64, torch.float32)
        landing = copies.land_late(reduced, torch.arange(64.0))  # a collective's result, late
        assert reduced.isnan().all()
        waited = copies.empty_host(64, torch.float32)
        copies.to_host(reduced, waited, after=landing).result()
        assert torch.equal(waited, torch.arange(64.0))
        early = copies.empty(64, torch.float32)
        copies.land_late(early, torch.arange(64.0))
        missed = copies.empty_host(64, torch.float32)
        copies.to_host(early, missed).result()  # no ``after``: the copy ran before the collective landed
        assert missed.isnan().all()
    finally:
        copies.close()


# -- the two-engine time model: a copy waits for its events, not for the compute queued before it --------
N_QUEUED = 8
OP_S = 1e-3
"""Compute ops queued ahead of a copy, and each one's simulated duration (a copy of a few KB: a few us)."""


@pytest.fixture
def timed():
    """The simulated device with deterministic copy durations (no random delay: the timeline is exact)."""
    c = SimulatedCopies(max_delay_s=0.0, seed=0, bytes_per_s=1e9, latency_s=1e-6)
    yield c
    c.close()


def test_an_h2d_prefetch_issued_behind_queued_compute_finishes_before_it(timed):
    """A weights prefetch (or a checkpoint's load) issued while N ops are queued on the compute stream runs
    on the copy engine beside them: done before the first of them is. Copies that waited for the whole
    compute stream (the old rule) ran after the N ops, and the op that needs the copy stalled."""
    queued = [timed.queue_compute(OP_S, f"op {i}") for i in range(N_QUEUED)]
    src = host(timed, torch.arange(1000.0))
    dst, copy = timed.to_new_device(src)
    assert copy.event.at < queued[0].at  # (the old rule: after queued[-1])
    timed.wait(copy)
    timed.queue_compute(OP_S, "the op that uses it")
    assert timed.compute_stalled_s == 0.0 and torch.equal(dst, src)
    assert timed.compute_waits["h2d"] == 0


def test_a_d2h_copy_waits_for_the_op_that_produced_its_source_not_the_ops_after_it(timed):
    """A gradient or checkpoint leaves the device once the op producing it is done, while later ops run."""
    src = timed.empty(1000, torch.float32).copy_(torch.arange(1000.0))  # (the host ran the producing op)
    produced = timed.queue_compute(OP_S, "the producing op")
    after = [timed.queue_compute(OP_S, f"op {i}") for i in range(N_QUEUED)]
    out = timed.empty_host(1000, torch.float32)
    copy = timed.to_host(src, out, after=produced)
    assert produced.at <= timed.timeline[-1].start and copy.event.at < after[0].at
    copy.result()
    assert torch.equal(out, torch.arange(1000.0))


def test_a_write_of_resident_weights_waits_for_their_last_read_only(timed):
    """A step's H2D copy into a device-resident weights region follows the event recorded after the
    compute stream's last read of it (before the step was submitted), and runs beside the ops queued
    after that; a D2H read of the region follows the write that produced its bytes, on the device."""
    from lightning_greedysnake.offload.device_regions import DeviceRegions

    regions = DeviceRegions("weights", [4096], timed)
    buf = AlignedBuffer(4096)
    buf.pin(timed.pin, timed.unpin)
    back = AlignedBuffer(4096)
    back.pin(timed.pin, timed.unpin)
    try:
        regions.readers({0}, done=False)  # acquired: the unit's backward reads it
        last_read = timed.queue_compute(OP_S, "backward of the unit")
        regions.readers({0}, done=True)  # the step is submitted
        later = [timed.queue_compute(OP_S, f"op {i}") for i in range(N_QUEUED)]  # the rest of backward
        buf.view(torch.float32, 1024).copy_(torch.arange(1024.0))
        write = regions.submit_write(0, buf)
        assert last_read.at <= write.event.at < later[0].at  # (the old rule: after later[-1])
        read = regions.submit_read(0, back)
        assert write.event.at < read.event.at < later[0].at
        read.result()
        assert torch.equal(back.view(torch.float32, 1024), torch.arange(1024.0))
    finally:
        regions.close()
        buf.close()
        back.close()


def test_a_host_checkpoint_is_copied_back_one_op_ahead_of_the_op_that_loads_it(timed):
    """The engine hints the next op's checkpoint before the current op's compute is enqueued: its H2D copy
    is issued then (after the D2H copy that saved it, on the device), overlaps the current op, and the
    op that loads it waits for nothing."""
    from lightning_greedysnake.config import OffloadConfig
    from lightning_greedysnake.offload.activations import ActivationStore
    from lightning_greedysnake.offload.stats import IOStats

    config = OffloadConfig.everywhere("host")
    store = ActivationStore(None, config, IOStats(), timed)  # type: ignore[arg-type]  # (host: no staging)
    hidden = timed.empty(1000, torch.float32).copy_(torch.arange(1000.0))  # unit 0's output: unit 1's input
    timed.queue_compute(OP_S, "F 0.0")
    store.save(1, 0, hidden)
    store.release(1, 0)  # after F 1.0: device memory gone, the host copy stays for backward
    for i in range(N_QUEUED):
        timed.queue_compute(OP_S, f"the rest of the window, op {i}")
    store.prefetch(1, 0)  # before B 2.0's compute (the op before B 1.0)
    current = timed.queue_compute(OP_S, "B 2.0")
    loaded = store.load(1, 0)  # B 1.0
    timed.queue_compute(OP_S, "B 1.0")
    labels = [span.label for span in timed.timeline]
    h2d = next(span for span in timed.timeline if span.stream == "h2d")
    assert labels.index(h2d.label) < labels.index("B 2.0")  # issued one op ahead
    assert h2d.end < current.at and timed.compute_stalled_s == 0.0
    assert store.device_loads == {"ahead": 1, "just_in_time": 0}
    assert torch.equal(loaded, torch.arange(1000.0))
    store.drop(1, 0)


def test_an_h2d_copy_that_waits_for_nothing_must_write_fresh_memory(timed):
    """Where CUDA would let such a copy overwrite memory under a queued kernel, the simulator refuses it:
    only memory from empty_for_h2d, and only once, is written with no event to wait for."""
    from lightning_greedysnake.offload.device import FRESH, UnorderedDeviceWriteError

    src = host(timed, torch.ones(16))
    with pytest.raises(UnorderedDeviceWriteError, match="waits for no compute event"):
        timed.to_device(src, timed.empty(16, torch.float32), after=FRESH)  # the compute stream's memory
    fresh = timed.empty_for_h2d(16, torch.float32)
    timed.to_device(src, fresh, after=FRESH).result()
    with pytest.raises(UnorderedDeviceWriteError):
        timed.to_device(src, fresh, after=FRESH)  # filled once: the compute stream may be reading it now
    timed.to_device(src, fresh, after=timed.compute_event()).result()  # after its last use: fine


# -- CUDA copies, run on the CPU against a recording stand-in for torch.cuda ------------------------------
class _FakeEvent:
    made: list[_FakeEvent] = []

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.blocking, self.enable_timing = blocking, enable_timing
        self.synchronized_on: list[str] = []
        _FakeEvent.made.append(self)

    def record(self, stream: object = None) -> None:
        pass

    def synchronize(self) -> None:
        self.synchronized_on.append(threading.current_thread().name)

    def query(self) -> bool:
        return True


class _FakeStream:
    def __init__(self, device: object = None) -> None:
        self.waited: list[object] = []

    def wait_stream(self, other: object) -> None:
        self.waited.append(other)

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


@pytest.fixture
def fake_cuda(monkeypatch):
    import contextlib

    _FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    _FakeEvent.recorded_streams = []
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: _FakeEvent.recorded_streams.append((self.data_ptr(), stream)))
    return _FakeEvent


def test_cuda_copy_completions_block_in_the_driver_instead_of_spinning(fake_cuda):
    from lightning_greedysnake.offload.device import CudaCopies

    copies = CudaCopies(torch.device("cpu"))
    try:
        src, dst = torch.arange(8.0), torch.empty(8)
        copies.to_device(src, dst).result(timeout=5)
        copies.to_host(dst, torch.empty(8)).result(timeout=5)
    finally:
        copies.close()
    waited = [e for e in fake_cuda.made if e.synchronized_on]
    assert len(waited) == 2
    # a default event's synchronize spins a core per copy in flight; a blocking one sleeps
    assert all(e.blocking for e in waited)
    assert {name for e in waited for name in e.synchronized_on} == {"greedysnake-h2d-events", "greedysnake-d2h-events"}


def test_cuda_copies_wait_for_their_events_only(fake_cuda):
    """The CUDA path of the rule: a prefetch's copy stream waits for nothing (its memory is allocated for
    it, and recorded on the compute stream that uses it); a D2H copy for the event after the producing
    op; a write of used memory for the event that freed it. Never the compute stream itself."""
    from lightning_greedysnake.offload.device import CudaCopies

    copies = CudaCopies(torch.device("cpu"))
    try:
        dst, copy = copies.to_new_device(torch.arange(8.0))
        assert copies.h2d.waited == []
        assert (dst.data_ptr(), copies.compute) in fake_cuda.recorded_streams  # freed after compute's uses
        produced = copies.compute_event()
        copies.to_host(dst, torch.empty(8), after=produced).result(timeout=5)
        assert copies.d2h.waited == [produced]
        freed = copies.compute_event()
        copies.to_device(torch.ones(8), copies.empty(8, torch.float32), after=freed).result(timeout=5)
        assert copies.h2d.waited == [freed]
        copy.result(timeout=5)
        assert copies.compute not in copies.h2d.waited + copies.d2h.waited
    finally:
        copies.close()
