"""Buffer lifetimes in the tensor manager, with the interleavings forced by a real I/O engine whose
reads of one file wait at a gate (or fail): a staging buffer goes back to the pool only after every
transfer on it completed, on every path (success, failure, drop, teardown)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.io import InlineIOEngine, OffloadIOError, ThreadedIOEngine
from lightning_greedysnake.models import make_units, sequential_chain
from lightning_greedysnake.tensor_manager import TieredTensorStore


class GatedEngine(ThreadedIOEngine):
    """The real threaded engine; reads of files named ``gated`` wait for ``gate``, reads of files named
    ``failing`` raise. Every read that reached a file records (file name, buffer) and its error."""

    def __init__(self, gated: str = "", failing: str = "") -> None:
        super().__init__()
        self.gated, self.failing = gated, failing
        self.gate = threading.Event()
        self.reads: list[tuple[str, object]] = []
        self.errors: list[BaseException] = []

    def submit_read(self, file, offset, buffer, buffer_offset, nbytes):  # type: ignore[no-untyped-def]
        self.reads.append((file.path.name, buffer))
        return super().submit_read(file, offset, buffer, buffer_offset, nbytes)

    def _read_piece(self, file, *args):  # type: ignore[no-untyped-def]
        if file.path.name == self.gated:
            assert self.gate.wait(30), "test gate never opened"
        try:
            if file.path.name == self.failing:
                raise OffloadIOError(5, f"injected read failure in {file.path}")
            return super()._read_piece(file, *args)
        except BaseException as e:
            self.errors.append(e)
            raise


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))


def _store(tmp_path: Path, engine: ThreadedIOEngine, compute_dtype: torch.dtype = torch.float32,
           **offload: object) -> tuple[TieredTensorStore, nn.Sequential]:
    model = _model()
    units = make_units(sequential_chain(model), 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    config = OffloadConfig(**{"buffer_budget_bytes": 64 << 20, **offload}).placed()  # type: ignore[arg-type]
    store = TieredTensorStore(units, names, optimizer, config, compute_dtype=compute_dtype)
    store.open(tmp_path, io_engine=engine)
    store.initialize_from_parameters()
    return store, model


def _half_read_ahead(tmp_path: Path) -> tuple[TieredTensorStore, GatedEngine, int]:
    """prefetch_step of unit 1 stages its master weights, then cannot get the state's buffer (the pool is
    held full but for the master's room): the master buffer is given back with its read still in
    flight, held at the gate. Returns the store, the engine and the master buffer's size."""
    engine = GatedEngine(gated="master_weights.bin")
    store, _ = _store(tmp_path, engine, compute_dtype=torch.bfloat16)
    unit = 1
    lay = store.layouts[unit]
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(s.shape), "exp_avg_sq": torch.zeros(s.shape)}
             for i, s in enumerate(lay.params)}
    store.values.load_unit_optimizer_state(unit, state)  # the step now reads its state too
    store.flush()
    master_bytes = lay.nbytes(4)
    filler = store.pool.acquire(store.pool.budget_bytes - store.pool.in_use_bytes - master_bytes)
    engine.reads.clear()
    try:
        store.prefetch_step(unit)
        assert [name for name, _ in engine.reads] == ["master_weights.bin"]  # went out, held at the gate
    except BaseException:
        engine.gate.set()
        store.close()
        raise
    store.pool.release(filler)
    return store, engine, master_bytes


def test_a_read_ahead_given_up_half_way_keeps_its_first_buffer_until_the_read_lands(tmp_path):
    """The master buffer must not be handed out again before its read completed (it was, and the late
    read overwrote whoever got it)."""
    store, engine, master_bytes = _half_read_ahead(tmp_path)
    try:
        read_buffer = engine.reads[0][1]
        again = store.pool.acquire(master_bytes, block=False)
        assert again is not read_buffer, "a buffer was handed out again while a read was filling it"
        engine.gate.set()
        if again is not None:
            store.pool.release(again)
    finally:
        engine.gate.set()
        store.close()


def test_the_debug_pool_sees_no_write_into_a_free_buffer_after_a_read_ahead_is_given_up(tmp_path, monkeypatch):
    """The same interleaving under the poisoning pool: had the buffer gone back with its read in flight,
    the read would land in a free (poisoned) buffer, and its next acquisition would fail naming it."""
    monkeypatch.setenv("GREEDYSNAKE_DEBUG_POOL", "1")
    store, engine, master_bytes = _half_read_ahead(tmp_path)
    try:
        engine.gate.set()
        store.flush()  # the read has landed
        for _ in range(2):  # a cached buffer is checked for writes while it was free
            held = store.pool.acquire(master_bytes, what="the test")
            assert held is not None
            store.pool.release(held)
    finally:
        engine.gate.set()
        store.close()


def test_a_failed_weights_prefetch_gives_its_buffer_back(tmp_path):
    engine = GatedEngine(failing="weights.bin")
    store, _ = _store(tmp_path, engine)
    try:
        before = store.pool.in_use_bytes
        store.prefetch(1)
        with pytest.raises(OffloadIOError, match="injected"):
            store.acquire_unit(1)
        assert store.pool.in_use_bytes == before, "the prefetch's buffer leaked"
    finally:
        store.close()


def test_closing_waits_for_a_checkpoint_read_ahead_before_closing_its_file(tmp_path):
    engine = GatedEngine(gated="activations.bin")
    store, _ = _store(tmp_path, engine, activations="ssd")
    closer = None
    try:
        store.save_activation(1, 0, torch.randn(4, 64))
        store.activations.flush()
        store.prefetch_activation(1, 0)
        assert [name for name, _ in engine.reads] == ["activations.bin"]  # in flight, at the gate
        closer = threading.Thread(target=store.close)
        closer.start()
        closer.join(0.3)  # close must wait for the read: it is still gated
        engine.gate.set()
        closer.join(30)
        assert not closer.is_alive()
        assert engine.errors == [], "the read ran against a closed file"
    finally:
        engine.gate.set()
        if closer is None:
            store.close()


def test_new_16_bit_weights_are_cast_from_master_before_master_goes_back(tmp_path, monkeypatch):
    """The bf16 race: the master buffer went back to the pool (after its write) before the 16-bit cast
    read it, and a same-size gradient accumulator could be zeroed into it first; plausible numbers,
    rarely. With the poisoning pool and transfers that complete as they are submitted (the inline
    engine), a cast after the give-back reads NaN every time."""
    monkeypatch.setenv("GREEDYSNAKE_DEBUG_POOL", "1")
    store, model = _store(tmp_path, InlineIOEngine(), compute_dtype=torch.bfloat16)
    try:
        assert store.pool.debug
        unit = 1
        store.acquire_unit(unit)
        model[unit](torch.randn(4, 64, dtype=torch.bfloat16)).float().square().sum().backward()
        store.gradient_ready(unit)  # lag 0: stepped right here
        store.release_unit(unit)
        master = store.values.unit_master_weights(unit)
        store.acquire_unit(unit)
        compute = [p.data.clone() for p in store.params[unit]]
        store.release_unit(unit)
        for m, c in zip(master, compute, strict=True):
            assert torch.isfinite(c).all()
            assert torch.equal(c, m.to(torch.bfloat16))
    finally:
        store.close()


def test_ctrl_c_while_waiting_for_a_lane_slot_gives_the_steps_handles_back(tmp_path):
    """Ctrl-C lands while the training thread waits for a slot on the optimizer lane (lag steps queued):
    the step was never submitted, so its gradient and weights go back, and the unit stays current (a
    later acquisition does not wait forever for a step that will never come)."""
    import signal

    engine = ThreadedIOEngine()
    model = _model()
    units = make_units(sequential_chain(model), 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    release_lane = threading.Event()
    store = TieredTensorStore(units, {id(p): n for n, p in model.named_parameters()}, optimizer,
                              OffloadConfig(buffer_budget_bytes=64 << 20).placed(), lag=1, alpha=0.25,
                              gradient_observer=lambda unit, flat: release_lane.wait(30))  # the lane's first step waits
    store.open(tmp_path, io_engine=engine)
    store.initialize_from_parameters()
    previous = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        baseline = store.pool.in_use_bytes
        for unit in (2, 1):
            store.acquire_unit(unit)
            model[unit](torch.randn(4, 64)).square().sum().backward()
            if unit == 1:
                signal.setitimer(signal.ITIMER_REAL, 0.3)  # Ctrl-C while submit waits for the slot
                with pytest.raises(KeyboardInterrupt):
                    store.gradient_ready(unit)
            else:
                store.gradient_ready(unit)
            store.release_unit(unit)
        assert store.gate.is_current(1)  # never stepped: nobody has to wait for it
        release_lane.set()
        store.grads.discard()
        store.drain()
        assert store.pool.in_use_bytes == baseline, "the interrupted step's buffers leaked"
        store.acquire_unit(1)  # returns at once
        store.release_unit(1)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        release_lane.set()
        store.close()


@pytest.mark.parametrize("drop", ["step_read_ahead", "weights_prefetch"])
def test_a_read_dropped_in_flight_never_lands_in_a_buffer_handed_out_again(tmp_path, monkeypatch, drop):
    """Dropping work ahead of need whose read is still in flight (``PartStepper.drop_read_ahead``, when a
    unit's weights or state are about to change; ``WeightsResidency.drop_prefetch``, when its step is
    submitted) must give the buffer back only once the read landed, through the handle's waiting
    release. With the read held at the gate, the buffer is dropped, then a buffer of the same size is
    taken from the (poisoning) pool and filled with a pattern before the gate opens: had the drop sent
    the buffer straight back to the pool, the pool would hand out that very buffer (the last one freed
    of its size) and the late read would overwrite the pattern. Afterwards the unit's values still
    read back right, and reusing buffers of that size finds no write into a free one."""
    monkeypatch.setenv("GREEDYSNAKE_DEBUG_POOL", "1")
    gated = "master_weights.bin" if drop == "step_read_ahead" else "weights.bin"
    engine = GatedEngine(gated=gated)
    store, _ = _store(tmp_path, engine, compute_dtype=torch.bfloat16)
    unit = 1
    expected = [p.detach().clone() for p in _model()[unit].parameters()]  # (the same seed: the stored values)
    mine = None
    try:
        assert store.pool.debug
        engine.reads.clear()
        if drop == "step_read_ahead":
            store.prefetch_step(unit)
            assert store.stepper.parts.has_read_ahead(unit)
        else:
            store.prefetch(unit)
            assert store.weights.is_staged(unit)
        assert [name for name, _ in engine.reads] == [gated]  # went out, held at the gate
        in_flight = engine.reads[0][1]
        nbytes = in_flight.nbytes
        if drop == "step_read_ahead":
            store.stepper.parts.drop_read_ahead(unit)
            assert not store.stepper.parts.has_read_ahead(unit)
        else:
            store.weights.drop_prefetch(unit)
            assert not store.weights.is_staged(unit)
        mine = store.pool.acquire(nbytes, what="the test, while the dropped read is in flight")
        assert mine is not None and mine.tensor is not None
        mine.tensor.fill_(0x5A)
        engine.gate.set()
        store.flush()  # the dropped read has landed, wherever it landed
        changed = int((mine.tensor != 0x5A).sum())
        assert changed == 0, (
            f"the read dropped in flight ({gated}) landed in a buffer the pool had handed out again: "
            f"{changed} of its {nbytes} bytes overwritten")
        assert engine.errors == []
        store.pool.release(mine)
        mine = None
        for _ in range(2):  # a cached buffer of that size is checked for writes while it was free
            again = store.pool.acquire(nbytes, what="the test, after the read landed")
            assert again is not None
            store.pool.release(again)
        for got, want in zip(store.values.unit_master_weights(unit), expected, strict=True):
            assert torch.equal(got, want)
        store.acquire_unit(unit)
        for p, want in zip(store.params[unit], expected, strict=True):
            assert torch.equal(p.data, want.to(torch.bfloat16))
        store.release_unit(unit)
    finally:
        engine.gate.set()
        if mine is not None:
            store.pool.release(mine)
        store.close()
