"""Choosing ``layers_per_unit`` at setup, before any file is shaped by it: pure arithmetic over each
candidate's placement (its SSD bytes per step), the offload disks' measured bandwidth at that
candidate's request sizes, and the optimizer's rate. No torch.

What a unit's size changes, and what setup can see of it:

- **SSD time.** Every region of a unit moves as one request (split into ``io_chunk_bytes`` chunks over
  the I/O threads): small units make small requests, which a disk serves at a fraction of its bandwidth
  (per-request latency, too few chunks to keep the threads busy). Measured: each disk's O_DIRECT
  bandwidth at the candidate's request size (:func:`~lightning_greedysnake.planner.measure.request_bandwidth`).
- **Host memory.** The staging grows with the unit (its working set, the queued steps' weights and
  gradients, the prefetch): what is left of the host budget keeps fewer kinds in RAM, so more bytes go
  over the SSD. Counted: each candidate's own placement plan within the same budget.
- **The pipeline's fill.** One unit's share of the transfers does not overlap compute (the first
  unit's reads before anything computes, the last one's writes after): ``1/units`` of the SSD time,
  which is all of it for a model in one unit.
- **The window's tail.** The window's last optimizer step (unit 0's) overlaps nothing: its optimizer
  time and its state reads grow with the unit. Counted: unit 0's elements over the measured optimizer
  rate, and its master weights and state on SSD over the read bandwidth.

Not seen at setup: compute. Larger units recompute less (the fused last unit is not recomputed at all)
and pay less per-op overhead, which helps small models on CPUs; how much depends on the tokens per
micro-batch, which setup does not see. The score therefore leaves compute out: it prefers the smallest
unit unless larger ones move the same bytes measurably faster, which is where the disk binds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from lightning_greedysnake.planner.roofline import Traffic, UnitCost

Bandwidth = Callable[[int], tuple[float, float]]
"""``bandwidth(request_bytes) -> (read, write)`` bytes/s of the offload disks together at that request
size (several paths: the slowest path's times their number; units are striped round robin)."""


@dataclass(frozen=True)
class UnitSizeScore:
    layers_per_unit: int
    ssd_s: float
    """Seconds of SSD transfer per step: each kind's bytes over the bandwidth at its request size."""
    fill_s: float
    """The part of ``ssd_s`` no compute overlaps: one unit's share."""
    tail_s: float
    """Seconds of the window's last step (unit 0's), which nothing overlaps."""
    ssd_bytes: int
    """SSD bytes per step with this candidate's placement."""

    @property
    def score_s(self) -> float:
        return self.ssd_s + self.fill_s + self.tail_s


def request_bytes(units: Sequence[UnitCost]) -> dict[str, int]:
    """The mean request of each kind: its region bytes per unit (0 where a kind has none)."""
    sizes = {
        "weights": [u.weight_bytes for u in units], "master_weights": [u.master_bytes for u in units],
        "optimizer_states": [u.state_bytes for u in units], "gradients": [u.grad_bytes for u in units],
    }
    return {kind: sum(s) // max(1, sum(1 for x in s if x)) for kind, s in sizes.items()}


def requests(units: Sequence[UnitCost], state_slots: int = 1) -> list[int]:
    """The request sizes (bytes) a step of ``units`` makes of the disks: each kind's mean region on SSD,
    the optimizer state's per slot."""
    sizes = request_bytes(units)
    sizes["optimizer_states"] //= max(1, state_slots)
    return [size for kind, size in sizes.items() if size and any(kind in u.on_ssd for u in units)]


def score_unit_size(layers_per_unit: int, units: Sequence[UnitCost], traffic: Traffic, bandwidth: Bandwidth,
                    optimizer_elements_per_s: float, state_slots: int = 1) -> UnitSizeScore:
    """Score one candidate: ``units`` are its units (region sizes and their tiers, as its placement
    plan put them) and ``traffic`` that plan's SSD bytes per step. The optimizer state region holds
    ``state_slots`` slots, each read and written as its own range."""
    sizes = request_bytes(units)
    ssd = 0.0
    for name, nbytes in traffic.terms.items():
        op, kind = name.split("/", 1)
        size = sizes[kind] // (max(1, state_slots) if kind == "optimizer_states" else 1)
        read, write = bandwidth(max(1, size))
        ssd += nbytes / (read if op == "read" else write)
    u = units[0]
    tail_reads = sum(nbytes for kind, nbytes in (("master_weights", u.master_bytes), ("optimizer_states", u.state_bytes))
                     if kind in u.on_ssd)
    tail = u.params / optimizer_elements_per_s
    if tail_reads:
        tail += tail_reads / bandwidth(max(1, tail_reads))[0]
    return UnitSizeScore(layers_per_unit, ssd, ssd / len(units), tail, traffic.read_bytes + traffic.write_bytes)


def choose_unit_size(scores: Mapping[int, UnitSizeScore], tolerance: float = 0.1) -> int:
    """The candidate with the lowest score; a larger one only where it beats every smaller one by more
    than ``tolerance`` of the smaller's score (measurement noise must not buy memory)."""
    best: UnitSizeScore | None = None
    for lpu in sorted(scores):
        s = scores[lpu]
        if best is None or s.score_s < best.score_s * (1 - tolerance):
            best = s
    assert best is not None, "no candidate unit size"
    return best.layers_per_unit


def table(scores: Mapping[int, UnitSizeScore], chosen: int) -> str:
    rows = [(f"{'layers_per_unit':<17}{'SSD GB/step':>12}{'SSD (s)':>10}{'fill (s)':>10}{'last step (s)':>15}"
            f"{'score (s)':>11}")]
    for lpu in sorted(scores):
        s = scores[lpu]
        rows.append(f"{lpu:<17}{s.ssd_bytes / 1e9:>12.3f}{s.ssd_s:>10.3f}{s.fill_s:>10.3f}{s.tail_s:>15.3f}"
                    f"{s.score_s:>11.3f}"
                    + ("   <- chosen" if lpu == chosen else ""))
    return "\n".join(rows)
