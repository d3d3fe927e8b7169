"""The device tier's gradient reducer (:class:`DeviceGradientReducer`) over a real two-process gloo group,
on the simulated device: what it leaves is the average over the ranks, never the sum. The Lightning runs
of ``tests/integration/test_distributed.py`` reach it only on the simulated device, and there the
norm-clipping case (the only caller of :meth:`~DeviceGradientReducer.average`) is deselected; so each
of its three collectives is checked here alone, with values that differ per rank."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_greedysnake.offload.device import SimulatedCopies
from lightning_greedysnake.offload.device_reduce import DeviceGradientReducer

WORLD = 2
NUMEL = 10
BOUNDS = [(0, 6), (6, 10)]
"""Partitioned state: rank 0 steps elements [0, 6), rank 1 [6, 10) (unequal chunks, as units split)."""


def _gradient(rank: int) -> torch.Tensor:
    """Rank ``rank``'s local gradient: different on every rank, and never zero."""
    return torch.arange(1, NUMEL + 1, dtype=torch.float32) * (rank + 1) + 100.0 * rank


def _expected() -> torch.Tensor:
    return sum(_gradient(r) for r in range(WORLD)) / WORLD  # type: ignore[return-value]


def _landed(copies: SimulatedCopies, reducer: DeviceGradientReducer, values: torch.Tensor) -> torch.Tensor:
    """:meth:`reduce`'s result as its one consumer reads it: copied to the host after the collective (on
    the simulated device its result lands late, NaN until then)."""
    out = copies.empty_host(values.numel(), values.dtype)
    copies.to_host(values, out, after=reducer.after()).result()
    return out


def _worker(rank: int, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    copies = SimulatedCopies(seed=rank)
    try:
        expected = _expected()
        # average (norm clipping: the whole gradient, averaged in place for its norm)
        flat = copies.empty(NUMEL, torch.float32)
        flat.copy_(_gradient(rank))
        DeviceGradientReducer(copies, rank, WORLD, partitioned=False).average(flat)
        torch.testing.assert_close(flat, expected, rtol=0, atol=0,
                                   msg=lambda m: f"rank {rank}: average() is not the mean of the ranks\n{m}")
        # reduce, replicated state: the whole unit, averaged
        flat = copies.empty(NUMEL, torch.float32)
        flat.copy_(_gradient(rank))
        reducer = DeviceGradientReducer(copies, rank, WORLD, partitioned=False)
        values, first = reducer.reduce(flat, BOUNDS)
        values = _landed(copies, reducer, values)
        assert first == 0
        torch.testing.assert_close(values, expected, rtol=0, atol=0,
                                   msg=lambda m: f"rank {rank}: reduce() (replicated) is not the mean\n{m}")
        # reduce, partitioned state: this rank's chunk of the average only
        flat = copies.empty(NUMEL, torch.float32)
        flat.copy_(_gradient(rank))
        reducer = DeviceGradientReducer(copies, rank, WORLD, partitioned=True)
        values, first = reducer.reduce(flat, BOUNDS)
        values = _landed(copies, reducer, values)
        lo, hi = BOUNDS[rank]
        assert first == lo
        torch.testing.assert_close(
            values, expected[lo:hi], rtol=0, atol=0,
            msg=lambda m: f"rank {rank}: reduce() (partitioned) is not its chunk of the mean\n{m}")
    finally:
        copies.close()
        dist.destroy_process_group()


def test_the_device_reducer_averages_over_two_gloo_ranks(tmp_path: Path) -> None:
    """Two processes (forked, gloo over a FileStore), each with its own gradient: after
    :meth:`average`, and after :meth:`reduce` with replicated or partitioned state, every rank holds the
    element-wise mean of the two gradients (its chunk of it, partitioned). A reducer that skipped the
    division would leave the sum, twice the mean, which Adam's scale invariance would hide from a
    weights-only comparison but norm clipping would not."""
    # forked, not spawned: a spawned child imports torch and Lightning again (seconds each); the children
    # compute nothing in parallel (one thread), so the parent's OpenMP pool is never touched after the fork
    context = mp.start_processes(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=False,
                                 start_method="fork")
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):  # (raises a child's failure, with its traceback)
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise AssertionError("the two gloo ranks did not finish within 120 s")
