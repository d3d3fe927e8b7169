"""The probes of the machine the roofline takes (the disks' bandwidth by request size, the optimizer's rate,
the cores) and the units' compute times read from a trace. The units' byte sizes are the strategy's
planning's to gather (:func:`lightning_greedysnake.strategy.planning.placement.unit_costs`)."""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def disk_bandwidth(directory: Path, nbytes: int = 256 << 20, chunk_bytes: int = 16 << 20,
                   threads: int = 4, repeats: int = 1) -> tuple[float, float]:
    """O_DIRECT (read, write) bytes/s of ``directory``'s filesystem for one request of ``nbytes``
    (:func:`request_bandwidth`): written first, then read back; with ``repeats``, the best of each (a
    shared disk's speed moves 2-3x between seconds: a roofline wants the best)."""
    return request_bandwidth(directory, [nbytes], threads, chunk_bytes, min_probe_bytes=nbytes, repeats=repeats)[nbytes]


PROBE_SIZES = tuple(64 << 10 << (2 * i) for i in range(6))
"""The request sizes the unit-size plan may measure (:func:`request_bandwidth`): 64 KiB to 64 MiB, in
steps of 4x (beyond the I/O threads times the chunk size a request is as fast as the disk)."""


def probe_sizes(requests: Sequence[int]) -> list[int]:
    """The points of :data:`PROBE_SIZES` that bracket ``requests`` (at least one)."""
    low, high = min(requests, default=PROBE_SIZES[0]), max(requests, default=PROBE_SIZES[0])
    below = [s for s in PROBE_SIZES if s <= low][-1:] or [PROBE_SIZES[0]]
    above = [s for s in PROBE_SIZES if s >= high][:1] or [PROBE_SIZES[-1]]
    return [s for s in PROBE_SIZES if below[0] <= s <= above[0]]


def request_bandwidth(directory: Path, sizes: Sequence[int], threads: int = 4, chunk_bytes: int = 16 << 20,
                      direct: bool = True, min_probe_bytes: int = 8 << 20,
                      repeats: int = 1) -> dict[int, tuple[float, float]]:
    """O_DIRECT (read, write) bytes/s of ``directory``'s filesystem for requests of each of ``sizes``
    (4 KiB multiples), through the tensor manager's own I/O engine and its settings: requests one at a
    time, each split into ``chunk_bytes`` chunks over ``threads`` (as a lane waiting on one region sees
    the disk), at least ``min_probe_bytes`` and one request per size, on a scratch file (as large as
    that, or the largest request) removed afterwards; the best of ``repeats``. Small requests pay the
    disk's latency per request: what a small unit costs."""
    from lightning_greedysnake.io import AlignedBuffer, IOConfig, ThreadedIOEngine

    path = Path(directory) / ".greedysnake-bandwidth.bin"
    largest = max(sizes)
    file_bytes = max(min_probe_bytes, largest)
    best: dict[int, list[float]] = {size: [math.inf, math.inf] for size in sizes}  # (read, write) seconds
    try:
        with ThreadedIOEngine(IOConfig(threads, chunk_bytes, direct)) as engine, AlignedBuffer(largest) as buf:
            file = engine.open(path, file_bytes)
            buf.tensor.fill_(1)
            for _ in range(repeats):
                for size in sorted(best):
                    offsets = range(0, file_bytes - size + 1, size)
                    t0 = time.perf_counter()
                    for offset in offsets:
                        engine.write(file, offset, buf, 0, size)
                    os.fsync(file.fd) if file.fd is not None else None
                    best[size][1] = min(best[size][1], (time.perf_counter() - t0) / len(offsets))
                    t0 = time.perf_counter()
                    for offset in offsets:
                        engine.read(file, offset, buf, 0, size)
                    best[size][0] = min(best[size][0], (time.perf_counter() - t0) / len(offsets))
    finally:
        path.unlink(missing_ok=True)
    return {size: (size / read_s, size / write_s) for size, (read_s, write_s) in best.items()}


def interpolate(measured: dict[int, tuple[float, float]]) -> Callable[[int], tuple[float, float]]:
    """``bandwidth(request_bytes)`` from :func:`request_bandwidth`'s points: linear in log2 of the size
    between two points, the nearest point's outside them."""
    points = sorted(measured.items())

    def bandwidth(size: int) -> tuple[float, float]:
        if size <= points[0][0]:
            return points[0][1]
        for (s0, (r0, w0)), (s1, (r1, w1)) in itertools.pairwise(points):
            if size <= s1:
                f = (math.log2(size) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return r0 + f * (r1 - r0), w0 + f * (w1 - w0)
        return points[-1][1]

    return bandwidth


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def probe_numel(params: int) -> int:
    """The optimizer-rate probe's elements for a model of ``params`` trainable ones: at least 64K, at most
    1M (16 MiB of fp32 Adam state: small enough for any host budget)."""
    return min(1 << 20, max(1 << 16, params))


def optimizer_rate(numel: int = 1 << 23, repeats: int = 3, optimizer: Any = None, threads: int | None = None,
                   shape: tuple[int, ...] | None = None) -> float:
    """Elements per second of one step of ``optimizer``'s class (with its first param group's settings)
    on the host, as the optimizer lane runs it: on a thread of its own with ``threads`` intra-op threads
    (the lane's planned count, :func:`lightning_greedysnake.planner.threads.optimizer_threads`; None:
    on the calling thread, with its threads). Default optimizer: fused AdamW. Rates differ by an order
    of magnitude between optimizers (``benchmarks/optimizer_rate.py``): the plan must see the user's own.
    ``shape``: step one parameter of this shape, scaled to about ``numel`` elements with its proportions
    kept (an optimizer stepped on whole parameters, Muon, costs more than linearly in a matrix's size);
    None: a flat one. ``optimizer`` may also be a factory of it over a list of parameters (the strategy's:
    the class configured as the user's instance is, which a bare construction may not be)."""
    if threads is None:
        return _optimizer_rate(numel, repeats, optimizer, shape)
    from concurrent.futures import ThreadPoolExecutor

    import torch

    def measure() -> float:
        torch.set_num_threads(threads)  # (per thread, as the lane's: the caller keeps its own)
        return _optimizer_rate(numel, repeats, optimizer, shape)

    with ThreadPoolExecutor(1, thread_name_prefix="greedysnake-optimizer-rate") as worker:
        return worker.submit(measure).result()  # (raises the thread's error here; leaving joins the thread)


def _optimizer_rate(numel: int, repeats: int, optimizer: Any, shape: tuple[int, ...] | None = None) -> float:
    import torch

    if shape:
        factor = min(1.0, (numel / max(math.prod(shape), 1)) ** (1.0 / len(shape)))
        shape = tuple(max(1, int(d * factor)) for d in shape)
        numel = math.prod(shape)
    p = torch.zeros(shape or numel, requires_grad=True)
    p.grad = torch.full_like(p, 1e-3)
    if optimizer is None:
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    else:
        hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"} if not callable(optimizer) else {}
        opt = optimizer([p]) if callable(optimizer) else type(optimizer)([{**hyper, "params": [p]}])
    opt.step()  # creates the state (and compiles, for an optimizer that does)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return numel / best


def is_backward_op(name: str) -> bool:
    """Whether the compute lane's op ``name`` is a unit's backward (``B{u}.{m}``, ``L{u}.{m} backward``:
    recompute included) rather than its forward (``F{u}.{m}``, ``L{u}.{m} forward``): the engine's and the
    strategy's names, read by :func:`unit_times` and by the step telemetry's forward phase."""
    return name[:1] in ("B", "L") and not name.endswith("forward")


def unit_times(spans: dict[str, list[tuple[float, float, str]]], num_units: int
               ) -> tuple[list[float], list[float]]:
    """Forward and backward (recompute included) seconds per micro-batch of each unit, from the compute
    lane of a trace (op names ``F{u}.{m}``, ``B{u}.{m}``, ``L{u}.{m} forward/backward``): the fastest of its
    micro-batches, the op's time with nothing else on the cores. The rest are slowed by whatever ran beside
    them (on shared cores the optimizer lane's kernels and the I/O threads, which the roofline counts as
    terms of their own: counted again in the compute, they made a disk-bound backward look compute-bound
    and moved the optimizer's I/O into the forward, where the disk binds). This assumes a window's
    micro-batches alike in shape; where their lengths vary (padding per batch) it is the shortest one's
    time, which only plans for a faster compute than the mean: a speed decision, never the results'."""
    fwd: dict[int, list[float]] = {}
    bwd: dict[int, list[float]] = {}
    for start, end, name in spans.get("compute", []):
        op = name.split(" ")[0]
        if not op or op[0] not in "FBL" or "." not in op:
            continue
        unit = int(op[1:].split(".")[0])
        (bwd if is_backward_op(name) else fwd).setdefault(unit, []).append(end - start)

    def fastest(values: list[float]) -> float:
        return min(values, default=0.0)

    return ([fastest(fwd.get(u, [])) for u in range(num_units)],
            [fastest(bwd.get(u, [])) for u in range(num_units)])
