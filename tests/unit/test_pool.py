import threading
import time

import pytest

from lightning_greedysnake.offload.pool import BufferBudgetError, BufferPool


def test_buffers_are_aligned_reused_and_counted():
    pool = BufferPool(3 * 4096)
    a = pool.acquire(100)
    assert a.nbytes == 4096 and pool.in_use_bytes == 4096
    assert a.tensor.data_ptr() % 4096 == 0
    pool.release(a)
    b = pool.acquire(4096)
    assert b.tensor.data_ptr() == a.tensor.data_ptr()  # the same memory comes back
    pool.release(b)
    pool.close()


def test_a_request_larger_than_the_budget_names_the_setting():
    pool = BufferPool(4096)
    with pytest.raises(BufferBudgetError, match=r"offload.buffer_budget_bytes=4096.*Fix"):
        pool.acquire(8192, what="unit 3 weights")
    pool.close()


def test_non_blocking_returns_none_when_the_budget_is_full_and_a_larger_budget_wakes_a_waiter():
    pool = BufferPool(2 * 4096)
    held = pool.acquire(2 * 4096)
    assert pool.acquire(4096, block=False) is None
    pool.will_return()  # (something will come back: a blocking acquisition waits instead of failing)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(4096)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # waiting for room
    pool.set_budget(3 * 4096)
    waiter.join(5)
    assert not waiter.is_alive() and got[0] is not None
    pool.release(got[0])
    pool.release(held, returning=True)
    pool.close()


def test_blocking_waits_for_a_buffer_that_is_on_its_way_back():
    pool = BufferPool(2 * 4096)
    first = pool.acquire(2 * 4096)
    pool.will_return()  # e.g. released behind a write still in flight

    def finish_write() -> None:
        time.sleep(0.2)
        pool.release(first, returning=True)

    t = threading.Thread(target=finish_write)
    t.start()
    second = pool.acquire(2 * 4096)  # blocks until the "write" completes
    t.join()
    assert second.nbytes == 2 * 4096
    pool.release(second)
    pool.close()


def test_a_request_ahead_of_need_waits_for_a_write_behind_but_not_for_a_holder():
    """Work ahead of need (``block=False``) that does not fit waits, up to ``returning_wait_s``, for a
    buffer already released behind a write still in flight; a buffer its holder keeps, it does not."""
    pool = BufferPool(2 * 4096)
    first = pool.acquire(2 * 4096)
    t0 = time.monotonic()
    assert pool.acquire(4096, block=False, returning_wait_s=5.0) is None  # held, nothing on its way back
    assert time.monotonic() - t0 < 1.0
    pool.will_return()  # released behind a write still in flight

    def finish_write() -> None:
        time.sleep(0.2)
        pool.release(first, returning=True)

    t = threading.Thread(target=finish_write)
    t.start()
    assert pool.acquire(4096, block=False) is None  # (no wait asked: refused at once)
    second = pool.acquire(2 * 4096, block=False, returning_wait_s=5.0)
    t.join()
    assert second is not None and second.nbytes == 2 * 4096
    pool.will_return()
    t0 = time.monotonic()
    assert pool.acquire(4096, block=False, returning_wait_s=0.2) is None  # the write outlasts the wait
    assert time.monotonic() - t0 >= 0.2
    pool.release(second, returning=True)
    pool.close()


def test_blocking_with_nothing_in_flight_fails_fast_instead_of_hanging():
    pool = BufferPool(2 * 4096)
    held = pool.acquire(2 * 4096)
    # (a hang would end after wait_timeout_s with a different message)
    with pytest.raises(BufferBudgetError, match="held by work in progress.*Fix"):
        pool.acquire(4096, what="checkpoint of unit 1")
    pool.release(held)
    pool.close()


def test_buffers_of_every_size_come_from_one_mapping_without_a_device_tier():
    """Without a pinner too, the pool maps its budget once and carves every size out of it: a size it has
    not handed out before takes the memory another size gave back, with no new mapping (a fresh one for
    each new size was faulted in and zeroed every time: about a gigabyte a step on compare.py's GPT)."""
    pool = BufferPool(4 * 4096)
    a = pool.acquire(4096)
    b = pool.acquire(3 * 4096)
    segment = pool._arena.segments[0]
    pool.release(a)
    pool.release(b)
    c = pool.acquire(2 * 4096)  # a size not seen before
    d = pool.acquire(2 * 4096)
    assert pool._arena.segments == [segment] and pool.registrations == 0  # (nothing page-locked)
    start = segment.tensor.data_ptr()
    assert {c.tensor.data_ptr() - start, d.tensor.data_ptr() - start} == {0, 2 * 4096}
    pool.release(c)
    pool.release(d)
    pool.shrink(4096)  # (nothing in use: the mapping goes back to the system)
    assert segment.closed and pool._arena.segments == []
    e = pool.acquire(4096)
    assert pool._arena.segments[0].nbytes == 4096  # (a new one, as large as the new budget)
    pool.release(e)
    pool.close()


def test_each_buffer_has_its_own_version_counter_and_none_is_an_inference_tensor():
    """Buffers carved from one segment are separate tensors to autograd: an in-place write into one (a
    step's new weights) does not bump the version of a tensor saved from another (weights used in place,
    saved for backward), which slices of the segment's tensor did. A buffer carved inside inference mode
    (an evaluation loop) is a normal tensor, which training may write and save."""
    import torch

    pool = BufferPool(4 * 4096)
    a, b = pool.acquire(4096), pool.acquire(4096)
    w = torch.ones(4, requires_grad=True)
    saved = a.view(torch.float32, 4)
    loss = (w * saved).sum()  # (autograd saves ``saved`` for w's gradient)
    b.view(torch.float32, 4).add_(1.0)
    loss.backward()  # (raised "modified by an inplace operation" when both were views of the segment)
    pool.release(a)
    pool.release(b)
    with torch.inference_mode():
        c = pool.acquire(4096)
    assert not c.tensor.is_inference()
    pool.release(c)
    pool.close()


def test_a_fragmented_request_ahead_of_need_waits_for_a_write_behind():
    """Work ahead of need (``block=False``) whose bytes fit the budget but no free range does waits, up to
    ``returning_wait_s``, for a buffer on its way back from a write, as it does when the budget is full,
    rather than being refused at once (a promised prefetch was refused under slow writes)."""
    pool = BufferPool(4 * 4096)
    a, b, c, d = (pool.acquire(4096) for _ in range(4))
    pool.release(a)
    pool.release(c)  # (two free pages apart: the two wanted next fit the budget, no free range does)
    assert pool.in_use_bytes + 2 * 4096 <= pool.budget_bytes
    assert pool.acquire(2 * 4096, block=False) is None  # (no wait asked: refused at once)
    pool.will_return()  # b released behind a write still in flight (its page joins the two)

    def finish_write() -> None:
        time.sleep(0.2)
        pool.release(b, returning=True)

    t = threading.Thread(target=finish_write)
    t.start()
    got = pool.acquire(2 * 4096, block=False, returning_wait_s=5.0)
    t.join()
    assert got is not None and got.nbytes == 2 * 4096
    pool.release(got)
    pool.release(d)
    pool.close()


def test_the_debug_pool_poisons_what_is_given_back_and_names_a_write_into_a_free_buffer():
    import torch

    from lightning_greedysnake.offload.pool import PoolCorruptionError

    pool = BufferPool(1 << 20, debug=True)
    buf = pool.acquire(8192, what="unit 3 weights")
    assert buf is not None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.isnan(buf.view(dtype, 1024)).all()  # fresh memory is poisoned too
    buf.view(torch.float32, 2048).fill_(1.0)
    stale = buf.view(torch.float32, 2048)
    pool.release(buf)
    assert torch.isnan(stale).all()  # a use after release computes with NaN, not plausible numbers
    stale[5] = 0.0  # a late write into the free buffer (an I/O or a thread that still used it)
    with pytest.raises(PoolCorruptionError, match=r"last owner was 'unit 3 weights', now acquired for 'x'"):
        pool.acquire(8192, what="x")
    pool.close()


def test_the_debug_pool_follows_the_environment(monkeypatch):
    monkeypatch.setenv("GREEDYSNAKE_DEBUG_POOL", "1")
    assert BufferPool(4096).debug
    monkeypatch.setenv("GREEDYSNAKE_DEBUG_POOL", "0")
    assert not BufferPool(4096).debug


# -- a device tier's pool: its memory registered once ------------------------------------------------------
class Pinner:
    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self.registrations = 0

    def pin(self, ptr: int, nbytes: int) -> None:
        self.pinned[ptr] = nbytes
        self.registrations += 1

    def unpin(self, ptr: int) -> None:
        del self.pinned[ptr]


def test_a_pinned_pool_registers_its_budget_once_and_carves_every_size_from_it():
    pinner = Pinner()
    pool = BufferPool(8 * 4096, pinner=(pinner.pin, pinner.unpin), debug=True)
    for _ in range(50):  # a changing mix of sizes (a step's weights, gradients, state, checkpoints)
        held = [pool.acquire(n * 4096) for n in (3, 1, 2)]
        pool.release(held[1])
        held[1] = pool.acquire(2 * 4096)
        for buf in held:
            assert buf.tensor.data_ptr() % 4096 == 0
            pool.release(buf)
    assert pinner.registrations == 1 and pool.registrations == 1 and list(pinner.pinned.values()) == [8 * 4096]
    pool.close()
    assert pinner.pinned == {}  # unregistered at close, not before


def test_a_pinned_pool_still_catches_a_write_into_free_memory():
    from lightning_greedysnake.offload.pool import PoolCorruptionError

    pinner = Pinner()
    pool = BufferPool(4 * 4096, pinner=(pinner.pin, pinner.unpin), debug=True)
    buf = pool.acquire(4096, what="unit 0 weights")
    view = buf.tensor
    pool.release(buf)
    view[10] = 1  # a late write (a transfer still filling it)
    with pytest.raises(PoolCorruptionError, match="unit 0 weights"):
        pool.acquire(4096, what="unit 1 weights")
    pool.close()


def test_a_fragmented_pinned_pool_waits_for_a_release_before_it_registers_more():
    pinner = Pinner()
    pool = BufferPool(4 * 4096, pinner=(pinner.pin, pinner.unpin), others_active=lambda: True)
    a, b, c, d = (pool.acquire(4096) for _ in range(4))
    pool.release(a)
    pool.release(c)  # two free pages, not adjacent: the bytes of a 2-page request fit, no range does
    threading.Timer(0.1, pool.release, (b,)).start()  # (the lane gives one back)
    got = pool.acquire(2 * 4096)
    assert got.nbytes == 2 * 4096 and pinner.registrations == 1  # waited, then took the coalesced range
    pool.release(got)
    pool.release(d)
    pool.set_budget(6 * 4096)  # a larger budget: one more segment, once
    held = [pool.acquire(4096) for _ in range(6)]
    for buf in held:
        pool.release(buf)
    assert pinner.registrations == 2
    pool.close()


def test_an_optimizer_job_does_not_wait_for_buffers_the_training_thread_holds_while_blocked_on_it(monkeypatch):
    """The training thread holds buffers and blocks on the lane (submit at the lag bound); the lane's job
    needs a range those buffers would make: nothing can release them until the job goes on, so the job
    registers a segment at once instead of waiting out the valve (a minute here; a second in a run)."""
    from lightning_greedysnake.offload import pool as pool_module
    from lightning_greedysnake.optim.lane import StepLane

    monkeypatch.setattr(pool_module, "FRAGMENTED_WAIT_S", 60.0)
    lane = StepLane(lag=1)
    pinner = Pinner()
    pool = BufferPool(4 * 4096, pinner=(pinner.pin, pinner.unpin), others_active=lane.others_will_release)
    a, b, c, d = (pool.acquire(4096) for _ in range(4))
    pool.release(a)
    pool.release(c)  # two free pages, not adjacent: the bytes of a 2-page request fit, no range does
    got = []
    try:
        lane.submit(lambda: got.append(pool.acquire(2 * 4096)), heavy=True)
        lane.submit(lambda: None, heavy=True)  # blocks here, holding b and d, until the first job is done
        lane.drain()
    finally:
        lane.close()
    assert got[0].nbytes == 2 * 4096
    assert pool.valve_growths == 0 and pool.unserved_growths == 1 and pinner.registrations == 2
    for buf in (got[0], b, d):
        pool.release(buf)
    pool.close()


def test_a_wait_for_room_times_out_only_after_nothing_came_back_for_the_timeout():
    """A long wait while buffers keep coming back (a slow disk's long steps, each giving some memory back)
    is progress, not a hang: the timeout counts from the last buffer back, not from the request."""
    pool = BufferPool(8 * 4096, wait_timeout_s=1.0, others_active=lambda: True)
    held = [pool.acquire(4096) for _ in range(8)]

    def churn() -> None:  # gives a page back and takes it again, for twice the timeout; then makes room
        for _ in range(20):
            time.sleep(0.1)
            pool.release(held.pop())
            held.append(pool.acquire(4096))
        for _ in range(4):
            pool.release(held.pop())

    t = threading.Thread(target=churn)
    t.start()
    got = pool.acquire(4 * 4096, what="unit 1 optimizer_states")
    t.join()
    assert got.nbytes == 4 * 4096
    for buf in (got, *held):
        pool.release(buf)
    pool.close()


def test_an_optimizer_job_waiting_for_a_full_budget_fails_fast_once_the_training_thread_blocks_on_it():
    """The lane's job waits for room the training thread will give back; then the training thread blocks
    on the lane (submit at the lag bound), still holding it: nothing can ever release it. The waiting job
    sees that (it asks again while it waits) and fails naming the holders, not after the pool's long
    timeout with another message."""
    from lightning_greedysnake.optim.lane import OptimizerLaneError, StepLane

    lane = StepLane(lag=1)
    pool = BufferPool(2 * 4096, wait_timeout_s=60.0, debug=True, others_active=lane.others_will_release)
    held = pool.acquire(2 * 4096, what="unit 0 gradients")
    try:
        lane.submit(lambda: pool.acquire(4096, what="unit 1 optimizer_states"), heavy=True)
        time.sleep(0.2)  # (the job waits: the training thread is not blocked on it yet)
        with pytest.raises(OptimizerLaneError, match=r"unit 1 optimizer_states.*held by work in progress "
                                                     r"\(unit 0 gradients \(8192\)\)"):
            lane.submit(lambda: None, heavy=True)  # blocks here, holding the buffer, until the job ends
            lane.drain()
    finally:
        lane.close()
    pool.release(held)
    pool.close()


# -- the staging budget: work ahead of need takes only the slack over the minimum ---------------------------
def _budget_with_slack(slack_bytes: int):
    from lightning_greedysnake.config import OffloadConfig
    from lightning_greedysnake.layout import StateLayout, build_unit_layout
    from lightning_greedysnake.offload.staging import PoolBudget

    units = tuple(build_unit_layout(u, [("w", (2048,), 0)]) for u in range(3))
    state = StateLayout(units, compute_itemsize=4, num_slots=2, separate_master=False)
    minimum = PoolBudget(state, OffloadConfig.everywhere("ssd").placed(), 0, False).minimum_bytes
    config = OffloadConfig.everywhere("ssd", buffer_budget_bytes=minimum + slack_bytes).placed()
    return PoolBudget(state, config, 0, False)


def test_a_refused_request_ahead_of_need_gives_its_slack_back():
    """``PoolBudget.take_optional`` counts a request against the slack before it asks the pool (so nothing
    else claims the room while it waits for a write-behind); when the pool refuses (full for the moment:
    the must-run work holds more than the minimum until its writes land) or raises, those bytes stop
    counting. Were they left counted, every refusal would shrink the slack for the rest of the run, and
    read-ahead would stop for good after a few busy moments."""
    slack = 4 * 4096
    budget = _budget_with_slack(slack)
    pool = budget.pool
    held = pool.acquire(pool.budget_bytes, what="a step's buffers, their write-behind in flight")
    for _ in range(3):  # (each refusal would leak 8 KiB: three are more than the slack)
        assert budget.take_optional(2 * 4096, "unit 2 read-ahead", within_slack=True) is None  # the pool is full
    with pytest.raises(BufferBudgetError):  # (larger than the whole pool: the pool raises)
        budget.take_optional(pool.budget_bytes + 4096, "unit 2 read-ahead", within_slack=False)
    pool.release(held)
    # the whole slack is there again: for a request ahead of need, and for one already held
    buf = budget.take_optional(slack, "unit 1 read-ahead", within_slack=True)
    assert buf is not None
    assert not budget.adopt_optional(4096)  # (the slack is all taken now)
    budget.give_back(slack)
    pool.release(buf)
    assert budget.adopt_optional(slack)
    budget.give_back(slack)
    pool.close()
