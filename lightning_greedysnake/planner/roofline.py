"""The roofline of one training step, from measured costs: pure arithmetic, no torch.

A step of K micro-batches takes at least the largest of its compute time, its SSD time (bytes moved
over the measured O_DIRECT bandwidths; reads and writes share one device) and its optimizer time
(elements over the measured optimizer rate): the paper's roofline. ``traffic`` gives the SSD bytes per
step the tensor manager moves for a schedule and placement, term by term as it moves them (the tests
check these formulas against the manager's own byte counters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lightning_greedysnake.kinds import REGION_KIND_NAMES
from lightning_greedysnake.planner.staging import UnitStaging, unit_staging
from lightning_greedysnake.schedule import window_facts

ON_SSD = frozenset(REGION_KIND_NAMES)
"""Every kind with a per-unit region: ZeRO-Infinity's placement, the default."""


@dataclass(frozen=True)
class UnitCost:
    """One unit: its compute per micro-batch and its bytes per kind (region sizes, 4 KiB aligned)."""

    forward_s: float
    backward_s: float
    """Recompute plus backward, per micro-batch."""
    weight_bytes: int
    """Compute weights (16-bit under bf16-mixed)."""
    grad_bytes: int
    """fp32 gradient region."""
    master_bytes: int
    """fp32 master weights (0 under 32-true: the weights are the master copy)."""
    state_bytes: int
    """Optimizer state, every slot."""
    params: int
    """Trainable elements."""
    alpha_weight_bytes: int = 0
    """Bytes of the deferred (alpha) range in the weights region (the range re-read as master)."""
    alpha_grad_bytes: int = 0
    """Bytes of the deferred (alpha) range in the gradient region."""
    recompute_s: float = 0.0
    """The part of ``backward_s`` that recomputes the forward (0 for the fused last unit, which keeps
    its graph anyway): what ``recompute=False`` saves."""
    activation_bytes: int = 0
    """Bytes autograd keeps for one micro-batch's graph of this unit (0: not measured): what
    ``recompute=False`` holds in memory per micro-batch until the unit's backward."""
    on_ssd: frozenset[str] = ON_SSD
    """The kinds whose region of this unit lives on SSD; the others are in host memory and move no
    SSD bytes (a kind split between host and SSD has some units of each)."""
    on_device: frozenset[str] = frozenset()
    """The kinds whose region of this unit is resident on the device (compute weights kept on a GPU):
    no SSD bytes, but a step stages their new values on the host on the way there."""
    trained_weight_bytes: int | None = None
    """Bytes of the trained prefix of ``weight_bytes``: what a step writes (and re-reads as master), the
    rest being read-only (frozen parameters: read with the unit, never written back). None: all of
    ``weight_bytes`` (every parameter trained)."""

    @property
    def written_weight_bytes(self) -> int:
        """Compute-weight bytes a step of this unit writes: its trained prefix (0 where nothing is
        trained)."""
        if not self.params:
            return 0
        return self.weight_bytes if self.trained_weight_bytes is None else self.trained_weight_bytes

    def staging(self) -> UnitStaging:
        """What this unit puts through the staging pool (the staging rule's input)."""
        sizes = {"weights": self.weight_bytes, "gradients": self.grad_bytes,
                 "master_weights": self.master_bytes, "optimizer_states": self.state_bytes}
        return unit_staging(sizes, {kind: "ssd" if kind in self.on_ssd else "device" if kind in self.on_device
                                    else "host" for kind in sizes})


@dataclass(frozen=True)
class Machine:
    read_bytes_per_s: float
    write_bytes_per_s: float
    optimizer_elements_per_s: float
    """The optimizer's rate on the lane (a background step: ``lag`` > 0), at the lane's threads."""
    inline_optimizer_elements_per_s: float | None = None
    """Its rate on the training thread (``lag`` 0), at that thread's threads; None: the lane's."""
    shared_cores: bool = False
    """The model computes on the cores the lane's kernels run on (no device tier): a background step
    takes its compute's time from the training's instead of overlapping it, and hides only its I/O
    (measured with every kind in RAM on 2 cores: lag 0 as fast as lag 1)."""

    @property
    def inline_rate(self) -> float:
        return self.inline_optimizer_elements_per_s or self.optimizer_elements_per_s

    @property
    def disk_probed(self) -> bool:
        """The disk's speeds were measured (a machine with nothing on SSD has infinite ones)."""
        return math.isfinite(self.read_bytes_per_s) and math.isfinite(self.write_bytes_per_s)

    @property
    def disk(self) -> str:
        """The disk's speeds as every report writes them (``read 1.07 GB/s, write 1.72 GB/s``); ``no SSD
        traffic`` where nothing was measured (never ``inf``)."""
        if not self.disk_probed:
            return "no SSD traffic"
        return f"read {self.read_bytes_per_s / 1e9:.2f} GB/s, write {self.write_bytes_per_s / 1e9:.2f} GB/s"


@dataclass(frozen=True)
class Traffic:
    read_bytes: int
    write_bytes: int
    terms: dict[str, int] = field(default_factory=dict)
    """Each term by name (``read/weights``, ``write/optimizer_states``, ...), for reports."""


@dataclass(frozen=True)
class Prediction:
    compute_s: float
    ssd_s: float
    optimizer_s: float
    traffic: Traffic

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.ssd_s, self.optimizer_s)

    @property
    def bound(self) -> str:
        """What limits the step: ``compute``, ``ssd`` or ``optimizer``."""
        return max(("compute", self.compute_s), ("ssd", self.ssd_s), ("optimizer", self.optimizer_s),
                   key=lambda kv: kv[1])[0]


def traffic(units: list[UnitCost], schedule: str, k: int, *, clip_norm: bool = False, slack: bool = True) -> Traffic:
    """SSD bytes of one steady-state step (after the first, whose optimizer state is not read yet).

    What the order costs comes from its ops (:func:`~lightning_greedysnake.schedule.window_facts`): each unit's
    weights are read once per load (vertical: for its forward and again for its backward, the fused last unit
    once; horizontal: per micro-batch, unit 0 staying in memory from one micro-batch's backward into the next
    forward), and a partial gradient goes out and back each time it is left incomplete (horizontal: between
    micro-batches; the last micro-batch's backward completes each one and hands it to its step). In both, unit 0's step ends the window and, when it is whole (nothing deferred, no global norm
    to wait for), in one process, with ``slack`` in the staging budget over its minimum (the automatic
    budget has it), leaves the new weights in memory for the next window's first forward: one read
    less. The optimizer reads and writes its state, writes the new compute weights, and under 32-true
    reads the weights as master where they are not in memory; the deferred range of each gradient
    goes to the gradients tier and back. Frozen parameters are read-only: a step writes (and re-reads)
    only each unit's trained prefix of its weights (``UnitCost.written_weight_bytes``), while every read
    of a unit's weights for compute reads its whole region. Each term counts only the units whose region
    of that kind is on SSD (``UnitCost.on_ssd``).
    """
    assert k >= 1 and units
    facts = window_facts(schedule, len(units), k)
    # norm clipping makes every gradient wait, modelled where the order completes each at once (with partial
    # sums waiting anyway, the setting's own traffic is not modelled: counted as without it)
    clip_norm = clip_norm and facts.completes_gradients_at_once
    t: dict[str, int] = {}

    def add(name: str, nbytes: int) -> None:
        if nbytes:
            t[name] = t.get(name, 0) + nbytes

    def both(kind: str, nbytes: int) -> None:
        add(f"read/{kind}", nbytes)
        add(f"write/{kind}", nbytes)

    on = {kind: [kind in u.on_ssd for u in units] for kind in ON_SSD}
    w = [u.weight_bytes if s else 0 for u, s in zip(units, on["weights"])]
    g = [u.grad_bytes if u.params and s else 0 for u, s in zip(units, on["gradients"])]
    add("read/weights", sum(loads * nbytes for loads, nbytes in zip(facts.weight_loads, w)))
    if slack and units[0].params and not units[0].alpha_weight_bytes and not clip_norm:
        add("read/weights", -w[0])
    # a step writes its trained prefix only: the frozen rest of the region is read with the unit, never written
    w_trained = [u.written_weight_bytes if s else 0 for u, s in zip(units, on["weights"])]
    add("write/weights", sum(w_trained))
    separate_master = any(u.master_bytes for u in units)
    both("optimizer_states", sum(u.state_bytes for u, s in zip(units, on["optimizer_states"]) if s))
    both("master_weights", sum(u.master_bytes for u, s in zip(units, on["master_weights"]) if s))  # (none: 32-true)
    # a step reads the unit's weights range (as master under 32-true, to refresh the 16-bit copy under
    # bf16-mixed) where it is on SSD, unless the unit is still in memory when its step comes: in either
    # order every unit is (its step follows its last backward), for its backward part; with norm clipping none
    alpha_w = [u.alpha_weight_bytes if s else 0 for u, s in zip(units, on["weights"])]
    refresh = sum(w_trained) if clip_norm else sum(alpha_w)
    add("read/weights" if separate_master else "read/master_weights", refresh)
    if clip_norm:
        # every gradient waits on SSD for the global norm
        both("gradients", sum(g))
    else:
        # partial sums out and back while incomplete: the last backward-side op completes them
        both("gradients", sum(spills * nbytes for spills, nbytes in zip(facts.gradient_spills, g)))
        both("gradients", sum(u.alpha_grad_bytes for u, s in zip(units, on["gradients"]) if s))
    reads = sum(v for name, v in t.items() if name.startswith("read/"))
    writes = sum(v for name, v in t.items() if name.startswith("write/"))
    return Traffic(reads, writes, t)


def predict(units: list[UnitCost], machine: Machine, schedule: str, k: int, **options: bool) -> Prediction:
    """The roofline prediction of one step (``options``: :func:`traffic`'s). On shared cores
    (``Machine.shared_cores``) the optimizer's kernels run on the cores the model computes on, whichever
    thread runs them: the compute term is the two added (at the optimizer's in-line rate), and the
    optimizer's own term is that same step alone."""
    tr = traffic(units, schedule, k, **options)
    compute = k * sum(u.forward_s + u.backward_s for u in units)
    ssd = tr.read_bytes / machine.read_bytes_per_s + tr.write_bytes / machine.write_bytes_per_s
    elements = sum(u.params for u in units)
    if machine.shared_cores:
        optimizer = elements / machine.inline_rate
        return Prediction(compute + optimizer, ssd, optimizer, tr)
    return Prediction(compute, ssd, elements / machine.optimizer_elements_per_s, tr)
