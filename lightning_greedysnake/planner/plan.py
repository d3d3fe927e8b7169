"""Choosing alpha, lag, recompute, saved activation placement and the staging budget from measured costs: an
exhaustive search over a small grid, scored by a two-phase roofline, the one model every plan uses (the
unit size too: :mod:`~lightning_greedysnake.planner.unit_size` scores each size with it). Pure arithmetic.

Step time (vertical order, K micro-batches):

- forward phase: the slowest of its compute (K x sum of unit forwards), its SSD time (each unit's
  weights read once, but unit 0's, which the window's last step leaves in memory; activations written
  when they live on SSD; the deferred ``alpha`` share of the optimizer's traffic plus what deferring
  adds: the deferred gradients out and back, their weights range read again) and the deferred share of
  the optimizer's lane (its reads, compute and writes in sequence per unit; with a second optimizer
  working set the next unit's reads overlap this one's compute);
- backward phase: likewise with the recomputing backward, the second weights read (not the fused last
  unit's: its backward follows its forward), saved activation reads and the other ``1 - alpha`` of the
  optimizer. With ``lag = 0`` the optimizer does not overlap: its backward share adds to the phase
  instead of racing it, at the training thread's rate (``Machine.inline_rate``).

Where the model computes on the host (``Machine.shared_cores``: no GPU) the lane's kernels run on the
cores the training's use: a background step's compute adds to the phase's compute, and only its I/O
overlaps. With every kind in RAM there is nothing left to hide, and the synchronous step (``lag`` 0, on
every core) wins, as Lightning's own step does.

SSD time counts only the bytes of regions on SSD (``UnitCost.on_ssd``, as :func:`~.roofline.traffic`
counts them), and sums reads and writes: one disk serves both, a read stream beside a write stream
about as fast as the two one after the other (``benchmarks/disk_mix.py``; a second working set overlaps
the optimizer's compute with its I/O, not one disk's reads with its writes).

Keeping the autograd graphs (``recompute=False``) takes each unit's recompute out of the backward
phase, and costs every unit's graph for all K micro-batches from the forward until the unit's backward:
in host memory (``activations`` "none": no saved activation traffic), or, where saved activations are on SSD,
their saved tensors there (written in the forward, read back for the backward: more bytes than the units'
inputs alone, only those inputs held): chosen when it is faster and fits the budget.

The window's last optimizer step (the first unit's: last in the backward, first in the next forward)
has nothing left to hide behind when the optimizer runs in the background: its compute, and its reads
unless they were read ahead during that unit's backward (``read_ahead``: room in the staging budget for
the unit's master weights and state), add to the step.

Memory: the staging budget the tensor manager takes for that lag (the staging rule of
:mod:`~lightning_greedysnake.planner.staging`: the must-run work, ``prefetch_units`` weights prefetches
and the slack), optionally a second optimizer working set (so the optimizer's reads of one unit overlap
the write-back of the previous one) and the window's last step read ahead, plus every saved activation kept in
host memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_greedysnake.planner.roofline import Machine, UnitCost
from lightning_greedysnake.planner.staging import staging_budget
from lightning_greedysnake.schedule import window_facts


@dataclass(frozen=True)
class Choice:
    alpha: float
    lag: int
    layers_per_unit: int
    activations: str
    """``host`` or ``ssd``; ``none`` when the graphs are kept (no activations then)."""
    buffer_budget_bytes: int
    host_bytes: int
    """Staging plus host-resident activations."""
    step_s: float
    forward_s: float
    backward_s: float
    recompute: bool = True
    read_ahead: bool = False
    """The budget has room to read the window's last step's master weights and state ahead."""

    def table(self) -> str:
        rows = [
            ("alpha", f"{self.alpha:.2f}"), ("lag", str(self.lag)), ("layers_per_unit", str(self.layers_per_unit)),
            ("recompute", str(self.recompute)), ("read_ahead", str(self.read_ahead)),
            ("activations", self.activations), ("buffer_budget_bytes", f"{self.buffer_budget_bytes:,}"),
            ("host memory (bytes)", f"{self.host_bytes:,}"), ("predicted step (s)", f"{self.step_s:.3f}"),
            ("  forward phase (s)", f"{self.forward_s:.3f}"), ("  backward phase (s)", f"{self.backward_s:.3f}"),
        ]
        return "\n".join(f"{name:<22}{value:>20}" for name, value in rows)


class PlanError(ValueError):
    pass


def merge(units: list[UnitCost], layers_per_unit: int) -> list[UnitCost]:
    """Costs of units made of ``layers_per_unit`` consecutive ones (times and bytes add). The last unit
    is fused (its backward follows its forward per micro-batch, on the kept graph): none of its layers
    recomputes. A kind is on SSD in a merged unit where it is in any of its units (a split's boundary
    unit counts whole: the SSD time errs long)."""
    out = []
    starts = range(0, len(units), layers_per_unit)
    for i in starts:
        group = units[i : i + layers_per_unit]
        fused = i == starts[-1]
        out.append(UnitCost(
            forward_s=sum(u.forward_s for u in group),
            backward_s=sum(u.backward_s - (u.recompute_s if fused else 0.0) for u in group),
            weight_bytes=sum(u.weight_bytes for u in group), grad_bytes=sum(u.grad_bytes for u in group),
            master_bytes=sum(u.master_bytes for u in group), state_bytes=sum(u.state_bytes for u in group),
            params=sum(u.params for u in group), recompute_s=0.0 if fused else sum(u.recompute_s for u in group),
            activation_bytes=sum(u.activation_bytes for u in group),
            on_ssd=frozenset().union(*(u.on_ssd for u in group)),
            on_device=frozenset().union(*(u.on_device for u in group)),
            trained_weight_bytes=sum(u.written_weight_bytes for u in group),
        ))
    return out


def staging_bytes(units: list[UnitCost], lag: int, prefetch_units: int = 1, double_buffered: bool = False) -> int:
    """The staging budget for ``units`` at ``lag`` by the staging rule
    (:func:`~lightning_greedysnake.planner.staging.staging_budget`): the automatic one, or with a second
    optimizer working set (``double_buffered``)."""
    return staging_budget([u.staging() for u in units], lag, prefetch_units).of(double_buffered)


def read_ahead_bytes(units: list[UnitCost]) -> int:
    """Staging for reading the window's last step (the first unit's) ahead: its master weights and state
    (where they are on SSD)."""
    u = units[0]
    return _ssd(u, "master_weights", u.master_bytes) + _ssd(u, "optimizer_states", u.state_bytes)


def _ssd(u: UnitCost, kind: str, nbytes: int) -> int:
    return nbytes if kind in u.on_ssd else 0


def optimizer_bytes(u: UnitCost) -> tuple[int, int]:
    """SSD (read, write) bytes of unit ``u``'s optimizer step: master weights and state in, master
    weights, state and (a trainable unit's) compute weights out, each where its region is on SSD (of the
    compute weights, the trained prefix: frozen ones are never written)."""
    reads = _ssd(u, "master_weights", u.master_bytes) + _ssd(u, "optimizer_states", u.state_bytes)
    writes = reads + _ssd(u, "weights", u.written_weight_bytes)
    return reads, writes


def weight_reads(units: list[UnitCost]) -> tuple[int, int]:
    """SSD bytes of compute weights the (forward, backward) phase reads: every unit's in the forward but
    unit 0's (the window's last step leaves its new weights in memory), every unit's but the fused
    last one's in the backward."""
    ssd = [_ssd(u, "weights", u.weight_bytes) for u in units]
    kept = ssd[0] if units[0].params else 0
    return sum(ssd) - kept, sum(ssd[:-1])


def window_tail(units: list[UnitCost], machine: Machine, k: int, lag: int, read_ahead: bool,
                recompute: bool = True) -> float:
    """Seconds the window's last step adds with a background optimizer: nothing is left to overlap it,
    and the next forward starts with its unit (which is why the tensor manager never defers part of it,
    whatever ``alpha``). Its compute, and its reads unless read ahead behind that unit's backward. With
    ``lag`` 0 the backward phase already pays every step in line."""
    if lag == 0:
        return 0.0
    u = units[0]
    reads = optimizer_bytes(u)[0] / machine.read_bytes_per_s
    if read_ahead:
        reads = max(0.0, reads - k * (u.backward_s - (0.0 if recompute else u.recompute_s)))
    return reads + u.params / machine.optimizer_elements_per_s


def score(units: list[UnitCost], machine: Machine, k: int, alpha: float, lag: int, unit_input_bytes: int,
          activations: str, double_buffered: bool = False, recompute: bool = True,
          read_ahead: bool = False) -> tuple[float, float]:
    """(forward phase, backward phase) seconds of one vertical step. ``double_buffered``: the staging
    budget holds a second optimizer working set, so one unit's state reads overlap the previous unit's
    compute instead of following it (the disk still serves every read and write in turn).
    ``recompute=False``: graphs kept, no recompute; ``activations`` ``ssd``: their saved tensors written to SSD in
    the forward and read back for the backward, else held. ``read_ahead``: the window's last
    step reads ahead (see :func:`window_tail`, counted in the backward)."""
    read, write = machine.read_bytes_per_s, machine.write_bytes_per_s
    rate = machine.optimizer_elements_per_s if lag else machine.inline_rate
    f_weights, b_weights = (n / read for n in weight_reads(units))

    def opt_io(group: list[UnitCost]) -> float:
        """SSD seconds of the steps of ``group`` (see :func:`optimizer_bytes`)."""
        moved = [optimizer_bytes(u) for u in group]
        return sum(r for r, _ in moved) / read + sum(w for _, w in moved) / write

    def lane(io: float, cpu: float) -> float:
        """The optimizer lane's seconds for ``io`` of transfers and ``cpu`` of compute."""
        return max(io, cpu) if double_buffered else io + cpu

    # unit 0 is never deferred (see window_tail): the forward phase gets alpha of the other units' steps
    rest = units[1:]
    f_opt_io, b_opt_io = alpha * opt_io(rest), opt_io(units) - alpha * opt_io(rest)
    f_opt_cpu = alpha * sum(u.params for u in rest) / rate
    b_opt_cpu = sum(u.params for u in units) / rate - f_opt_cpu
    # deferring costs bytes too: the deferred range's gradient goes to SSD and back, and its weights
    # range is read again (as master under 32-true, to refresh the 16-bit copy under bf16-mixed)
    deferred_io = alpha * sum(_ssd(u, "gradients", u.grad_bytes) * (1 / read + 1 / write)
                              + _ssd(u, "weights", u.written_weight_bytes) / read for u in rest)
    saved = ((k * (len(units) - 1) * unit_input_bytes if recompute else k * sum(u.activation_bytes for u in units[:-1]))
             if activations == "ssd" else 0)
    f_compute = k * sum(u.forward_s for u in units)
    b_compute = k * sum(u.backward_s - (0.0 if recompute else u.recompute_s) for u in units)
    if lag == 0:
        forward = max(f_compute, f_weights + saved / write) + lane(f_opt_io + deferred_io, f_opt_cpu)
        backward = max(b_compute, b_weights + saved / read) + lane(b_opt_io, b_opt_cpu)
    else:
        # the window's last step (unit 0's) does not overlap the backward: it is the tail (its reads
        # and compute); its writes go behind the next forward
        tail_io, tail_cpu = opt_io(units[:1]), units[0].params / rate
        tail_writes = optimizer_bytes(units[0])[1] / write
        f_ssd = f_weights + saved / write + f_opt_io + deferred_io + tail_writes
        # on shared cores the lane's compute is the training's to pay (see the module's docstring)
        f_shared, b_shared = (f_opt_cpu, b_opt_cpu - tail_cpu) if machine.shared_cores else (0.0, 0.0)
        forward = max(f_compute + f_shared, f_ssd, lane(f_opt_io + deferred_io, f_opt_cpu))
        backward = max(b_compute + b_shared, b_weights + saved / read + b_opt_io - tail_io,
                       lane(b_opt_io - tail_io, b_opt_cpu - tail_cpu))
        backward += window_tail(units, machine, k, lag, read_ahead, recompute)
    # a saved activation on SSD is read at most one op ahead, and only from spare staging budget: counted on
    # the backward's critical path rather than hidden behind compute (conservative)
    backward += saved / read
    return forward, backward


ALPHAS = tuple(a / 20 for a in range(11))
"""The alphas the warm-step plan chooses from when the user left ``alpha`` unset (the largest bounds what the
gradients' SSD file must hold: :func:`~lightning_greedysnake.offload.regions.RegionMap`)."""


def plan(units: list[UnitCost], machine: Machine, k: int, host_budget_bytes: int, unit_input_bytes: int,
         alphas: tuple[float, ...] = ALPHAS, lags: tuple[int, ...] = (0, 1, 2),
         activation_placements: tuple[str, ...] = ("host", "ssd"),
         recompute: tuple[bool, ...] = (True, False), prefetch_units: int = 1, layers_per_unit: int = 1,
         schedule: str = "vertical", graphs_on_ssd: bool | None = None) -> Choice:
    """The fastest configuration whose host memory fits ``host_budget_bytes`` (ties: less memory), for
    ``units`` as given (the unit size is :mod:`~lightning_greedysnake.planner.unit_size`'s to choose).

    ``units``: per-unit costs (``layers_per_unit`` blocks each: :func:`merge` them; the last one is the
    fused unit); ``unit_input_bytes``: one unit input of one micro-batch;
    ``prefetch_units``: the weights prefetches the staging budget holds room for (``offload.prefetch_units``).
    Keeping the graphs is considered only where every recomputed unit's activation bytes were measured;
    ``graphs_on_ssd``: whether their saved tensors may go to SSD (None: where saved activations may).
    ``schedule``: the window's order. Horizontally one micro-batch's activations or graphs are alive at a
    time, not K's; the step time is scored as vertical's (the order setup picks horizontal only where nothing
    is on SSD, so the two differ only in how much of the optimizer the backward hides).
    """
    held = window_facts(schedule, len(units), k).live_microbatches  # (whose activations or graphs are alive at once)
    measured = all(u.activation_bytes > 0 for u in units[:-1])
    options = [(True, c) for c in activation_placements] if True in recompute else []
    if False in recompute and measured:
        # kept graphs held in memory ("none": no saved activation besides them), or their saved tensors on SSD
        on_ssd = "ssd" in activation_placements if graphs_on_ssd is None else graphs_on_ssd
        options += [(False, "none")] + [(False, "ssd")] * on_ssd
    best: Choice | None = None
    smallest = None
    merged = merge(units, 1)  # (the last unit fused: it recomputes nothing)
    for lag in lags:
        for double, ahead in ((False, False), (True, False), (False, True), (True, True)):
            if ahead and lag == 0:
                continue  # the synchronous step reads in line anyway
            staging = (staging_bytes(merged, lag, prefetch_units, double)
                       + (read_ahead_bytes(merged) if ahead else 0))
            for recomputing, activations in options:
                if recomputing:
                    host_ckpt = held * (len(merged) - 1) * unit_input_bytes if activations == "host" else 0
                elif activations == "none":  # every unit's graph for every micro-batch alive, but the fused last unit's
                    host_ckpt = held * sum(u.activation_bytes for u in merged[:-1])
                else:  # those graphs' saved tensors on SSD: their inputs still held, two graphs' bytes staged
                    host_ckpt = (held * (len(merged) - 1) * unit_input_bytes
                                 + 2 * max((u.activation_bytes for u in merged[:-1]), default=0))
                host = staging + host_ckpt
                smallest = host if smallest is None else min(smallest, host)
                if host > host_budget_bytes:
                    continue
                for alpha in alphas:
                    f, b = score(merged, machine, k, alpha, lag, unit_input_bytes, activations, double,
                                 recompute=recomputing, read_ahead=ahead)
                    choice = Choice(alpha, lag, layers_per_unit, activations, staging, host, f + b, f, b,
                                    recomputing, ahead)
                    # ties: less memory, then recompute (the method's default)
                    key = (choice.step_s, choice.host_bytes, not choice.recompute)
                    if best is None or key < (best.step_s, best.host_bytes, not best.recompute):
                        best = choice
    if smallest is None:
        raise PlanError("no configuration to consider: kept graphs (recompute=False) need every unit's activation "
                        "bytes measured, and recomputing was not allowed")
    if best is None:
        raise PlanError(
            f"no configuration fits a host memory budget of {host_budget_bytes:,} bytes; the smallest needs "
            f"{smallest:,}. Fix: allow more host memory, or use fewer micro-batches (K) or a smaller model."
        )
    return best
