"""SSD regions order their operations by the bytes they touch, without blocking the submitter."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.io import AlignedBuffer, ThreadedIOEngine
from lightning_greedysnake.offload.stats import IOStats
from lightning_greedysnake.offload.tiers import SSDRegions

KB4 = 4096


class GatedEngine(ThreadedIOEngine):
    """The real threaded engine, but each write waits for a gate to open: a write stays in flight as long
    as the test wants. Records the order in which requests reach the engine."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.read_gate = threading.Event()
        self.read_gate.set()
        self.started: list[tuple[str, int]] = []

    def submit_read(self, file, offset, buffer, buffer_offset, nbytes):  # type: ignore[no-untyped-def]
        self.started.append(("read", buffer_offset))
        return super().submit_read(file, offset, buffer, buffer_offset, nbytes)

    def submit_write(self, file, offset, buffer, buffer_offset, nbytes):  # type: ignore[no-untyped-def]
        self.started.append(("write", buffer_offset))
        return super().submit_write(file, offset, buffer, buffer_offset, nbytes)

    def _write_piece(self, *args):  # type: ignore[no-untyped-def]
        assert self.gate.wait(30), "test gate never opened"
        return super()._write_piece(*args)

    def _read_piece(self, *args):  # type: ignore[no-untyped-def]
        assert self.read_gate.wait(30), "test read gate never opened"
        return super()._read_piece(*args)


@pytest.fixture
def regions(tmp_path):
    engine = GatedEngine()
    r = SSDRegions("optimizer_states", [4 * KB4], engine, tmp_path / "states.bin", IOStats())
    yield r, engine
    engine.gate.set()
    engine.read_gate.set()
    r.close()
    engine.close()


def test_a_read_of_bytes_being_written_waits_and_sees_the_write_while_other_reads_go_ahead(regions):
    r, engine = regions
    src, dst = AlignedBuffer(4 * KB4), AlignedBuffer(4 * KB4)
    src.view(torch.uint8, 4 * KB4).fill_(7)
    write = r.submit_write(0, src, byte_range=(0, 2 * KB4))  # held at the gate
    # these return at once even though the write is in flight (submitting never blocks)
    same = r.submit_read(0, dst, byte_range=(KB4, 2 * KB4))
    other = r.submit_read(0, dst, byte_range=(2 * KB4, 4 * KB4))
    other.result(timeout=30)  # disjoint bytes: not ordered behind the write
    assert not write.done() and not same.done()
    assert ("read", KB4) not in engine.started  # the overlapping read has not even been issued
    engine.gate.set()
    same.result(timeout=30)
    assert write.done()
    assert bool((dst.view(torch.uint8, 4 * KB4)[KB4 : 2 * KB4] == 7).all())  # it saw the write


def test_two_reads_of_the_same_bytes_run_together_and_a_write_waits_for_both(regions):
    r, engine = regions
    a, b, src = AlignedBuffer(4 * KB4), AlignedBuffer(4 * KB4), AlignedBuffer(4 * KB4)
    engine.gate.set()
    first = r.submit_read(0, a)
    second = r.submit_read(0, b)
    assert [op for op, _ in engine.started] == ["read", "read"]  # both issued at once
    engine.gate.clear()
    write = r.submit_write(0, src)
    first.result(timeout=30), second.result(timeout=30)
    engine.gate.set()
    write.result(timeout=30)
    assert engine.started[-1] == ("write", 0)


def test_a_failed_write_fails_the_reads_that_depend_on_it_and_every_wait(regions, tmp_path):
    r, engine = regions
    engine.gate.set()
    buf = AlignedBuffer(4 * KB4)
    r.file.close()  # every request now fails with EBADF
    write = r.submit_write(0, buf, byte_range=(0, KB4))
    read = r.submit_read(0, buf, byte_range=(0, KB4))
    with pytest.raises(OSError):
        write.result(timeout=30)
    with pytest.raises(OSError):
        read.result(timeout=30)
    with pytest.raises(OSError):
        r.wait_all()


def test_a_write_waits_for_an_earlier_read_of_the_same_bytes(regions):
    """Write after read: a read still filling its buffer from bytes a later write replaces must see the
    old bytes (the optimizer reads a unit's state ahead while the previous step's write-behind is queued)."""
    r, engine = regions
    engine.gate.set()
    old, new, dst = AlignedBuffer(4 * KB4), AlignedBuffer(4 * KB4), AlignedBuffer(4 * KB4)
    old.view(torch.uint8, 4 * KB4).fill_(1)
    new.view(torch.uint8, 4 * KB4).fill_(2)
    r.submit_write(0, old).result(timeout=30)
    engine.read_gate.clear()
    engine.started.clear()
    read = r.submit_read(0, dst, byte_range=(0, 2 * KB4))  # held at the read gate
    write = r.submit_write(0, new, byte_range=(KB4, 3 * KB4))  # overlaps the read's second page
    other = r.submit_write(0, new, byte_range=(3 * KB4, 4 * KB4))  # does not: goes ahead
    other.result(timeout=30)
    assert not write.done() and ("write", KB4) not in engine.started  # not even issued
    engine.read_gate.set()
    read.result(timeout=30), write.result(timeout=30)
    assert bool((dst.view(torch.uint8, 4 * KB4)[: 2 * KB4] == 1).all())  # the read saw the old bytes


# -- what preflight counts: the bytes the offload files will take --------------------------------------------
def _state(numel: int = 8192, units: int = 3, slots: int = 2):
    from lightning_greedysnake.layout import StateLayout, build_unit_layout

    layouts = tuple(build_unit_layout(u, [("w", (numel,), 0)]) for u in range(units))
    return StateLayout(layouts, compute_itemsize=2, num_slots=slots, separate_master=True)  # (bf16-mixed, Adam)


def _opened_files(state, tmp_path, slots: int, gradients_from=None) -> tuple[dict[str, int], dict[str, int]]:
    """``RegionMap.ssd_bytes()`` (what preflight checks the disk for), and the bytes of the files the same
    map then creates, with every kind on SSD."""
    from lightning_greedysnake.config import OffloadConfig
    from lightning_greedysnake.offload.regions import FILE_NAMES, RegionMap

    regions = RegionMap(state, OffloadConfig.everywhere("ssd").placed(), IOStats(), slots, None, None, gradients_from)
    counted = regions.ssd_bytes()
    engine = ThreadedIOEngine()
    try:
        regions.open([tmp_path], [engine])
        made = {kind.value: (tmp_path / name).stat().st_size for kind, name in FILE_NAMES.items()
                if (tmp_path / name).exists()}
    finally:
        regions.close()
        engine.close()
    return counted, made


@pytest.mark.parametrize("slots", [1, 2], ids=["one-slot", "fp16-two-slots"])
def test_preflight_counts_every_slot_the_offload_files_take(tmp_path, slots):
    """``RegionMap.ssd_bytes``: fp16's speculative steps keep two regions per unit of weights, master
    weights and optimizer state (a step writes the slot not in use), and the files are that large; a
    preflight counting one slot would let a disk with room for half of them through, to fail mid-run."""
    from lightning_greedysnake.config import REGION_KINDS

    state = _state()
    counted, made = _opened_files(state, tmp_path, slots)
    assert counted == made
    once = {kind.value: sum(state.all_region_bytes(kind)) for kind in REGION_KINDS}
    assert counted == {"weights": slots * once["weights"], "master_weights": slots * once["master_weights"],
                       "optimizer_states": slots * once["optimizer_states"], "gradients": once["gradients"]}


@pytest.mark.parametrize("settings, alpha_max", [
    (dict(), 0.5),  # (auto, alpha unset: the warm-step plan may choose up to max(ALPHAS))
    (dict(alpha=0.1), 0.1),  # (the user's)
    (dict(auto=False), 0.25),  # (the fixed default, for the run)
    (dict(schedule="horizontal"), None),  # (whole gradients wait between micro-batches)
], ids=["planned", "users", "fixed", "horizontal"])
def test_the_gradients_file_holds_the_deferred_part_of_any_alpha_the_plan_may_choose(tmp_path, settings, alpha_max):
    """``deferred_gradients_only``: in the vertical order only a unit's deferred part (its last alpha share)
    waits on the gradients' tier, so preflight counts only those bytes; with alpha left to the warm-step
    plan, the largest it may choose (0.5, not the first steps' 0.25), or a plan choosing more would write
    past what the disk was checked for."""
    from types import SimpleNamespace

    from lightning_greedysnake.config import GreedySnakeConfig
    from lightning_greedysnake.optim import ClipPolicy
    from lightning_greedysnake.planner.plan import ALPHAS
    from lightning_greedysnake.strategy.manager_setup import deferred_gradients_only
    from lightning_greedysnake.tensor_manager import gradients_from

    assert max(ALPHAS) == 0.5
    user = GreedySnakeConfig(**settings)
    alpha = deferred_gradients_only(SimpleNamespace(settings=user), user.resolved(), ClipPolicy())
    assert alpha == alpha_max
    state = _state()
    counted, made = _opened_files(state, tmp_path, 1, gradients_from(state, alpha))
    unit_bytes = state.region_bytes(TensorKind.GRADIENTS, 0)
    if alpha_max is None:
        assert counted["gradients"] == made["gradients"] == 3 * unit_bytes  # (whole, preallocated)
        return
    deferred = [state.units[u].numel - state.split(u, alpha_max) for u in (1, 2)]  # (unit 0 is never deferred)
    assert 0 < deferred[0] < state.units[1].numel
    assert counted["gradients"] == 4 * sum(deferred)  # (fp32)
    assert made["gradients"] == 3 * unit_bytes  # (sparse: sized for whole gradients, the parts written take disk)
