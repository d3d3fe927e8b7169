"""The staging rule: how many bytes of page-aligned host memory (the staging pool's budget) the tensor
manager needs. Computed here only: the tensor manager's minimum and automatic budget, the placement at
setup, the unit-size choice and the planner all call :func:`staging_budget`. Pure arithmetic.

What goes through the pool, per unit (:class:`UnitStaging`): a region on SSD is staged whenever it is
used; a region resident on the device is staged by a step on its way there; a region in host RAM is used
in place and takes no staging.

- **The minimum** is what the work that must run holds at once. Synchronously (``lag`` 0): one unit's
  working set (its weights and gradient, and what its step stages: master weights and optimizer state).
  With a background optimizer (``lag`` > 0) the training thread holds one unit's weights and gradient,
  up to ``lag`` queued steps hold theirs, and the running step stages its master and state: ``lag + 1``
  units' weights and gradients plus one step. The largest unit decides.
- **The automatic budget** adds room to read ``prefetch_units`` units' weights ahead (the largest unit's
  weights on SSD, each), and :data:`AUTO_BUDGET_EXTRA_BYTES` of slack for saved activations read
  ahead.
- **The double-buffered budget** adds a second optimizer working set (the largest unit's step: its
  weights and what the step stages): the next step's master weights and state are read while the
  current one computes and writes back, so the disk does not wait for the optimizer's compute nor the
  optimizer for the disk. The pool takes it unless told otherwise with ``auto=False`` (the fixed
  defaults); with ``auto=True`` the first steps take the automatic one and the warm-step plan weighs
  the two (``double_buffered`` in :mod:`~lightning_greedysnake.planner.plan`). Without it a step's
  reads start only when it starts.
  Work ahead of need (prefetches, read-aheads) only ever takes the slack above the minimum, so a
  budget of at least the minimum never deadlocks, and the automatic one never refuses a prefetch it
  promised. (The must-run work holds more than the minimum only while a finished step's write-behind
  lands; work ahead of need waits for that rather than be refused: ``PoolBudget.take_optional``.)

Saved activations on SSD add two saved activations to the minimum once their size is known (the tensor
manager's ``reserve_activations``); the planner counts them with the saved activations it places.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

AUTO_BUDGET_EXTRA_BYTES = 16 << 20
"""The automatic budget's room beyond the minimum and the weights prefetches (saved-activation
read-aheads)."""
SMALLEST_BUDGET_BYTES = 4096
"""The minimum never goes below one page (a model whose state is all in RAM stages nothing)."""


@dataclass(frozen=True)
class UnitStaging:
    """One unit's bytes that go through the staging pool (0 for a region in host RAM)."""

    weights: int
    """Compute weights on SSD: what the training thread stages to compute and a prefetch reads ahead."""
    gradients: int
    """The gradient region (on SSD): held from the unit's backward until its step has read it."""
    step: int
    """What the unit's optimizer step stages beyond those: master weights and optimizer state (on SSD),
    and compute weights resident on the device (their new values, on the way there)."""


@dataclass(frozen=True)
class StagingBudget:
    minimum_bytes: int
    """What the must-run work holds at once (see the module's docstring)."""
    automatic_bytes: int
    """The minimum, ``prefetch_units`` weights prefetches and :data:`AUTO_BUDGET_EXTRA_BYTES`."""
    double_buffered_bytes: int
    """``automatic_bytes`` and a second optimizer working set."""

    def of(self, double_buffered: bool) -> int:
        """The double-buffered budget, or the automatic one."""
        return self.double_buffered_bytes if double_buffered else self.automatic_bytes


def staging_budget(units: Iterable[UnitStaging], lag: int, prefetch_units: int) -> StagingBudget:
    """The staging rule (see the module's docstring) over every unit of a run."""
    units = list(units)
    need = 0
    for u in units:
        held = u.weights + u.gradients
        need = max(need, held + u.step if lag == 0 else (lag + 1) * held + u.step)
    minimum = max(need, SMALLEST_BUDGET_BYTES)
    prefetch = max((u.weights for u in units), default=0) * prefetch_units
    single = minimum + prefetch + AUTO_BUDGET_EXTRA_BYTES
    return StagingBudget(minimum, single, single + max((u.weights + u.step for u in units), default=0))


def unit_staging(sizes: dict[str, int], tiers: dict[str, str]) -> UnitStaging:
    """One unit's :class:`UnitStaging` from its region bytes and tiers per kind (``TensorKind`` and
    ``Tier`` values: ``weights``, ``gradients``, ``master_weights``, ``optimizer_states``; ``host``,
    ``ssd``, ``device``)."""
    def staged(kind: str) -> int:
        return sizes.get(kind, 0) if tiers.get(kind) in ("ssd", "device") else 0

    weights_on_ssd = sizes.get("weights", 0) if tiers.get("weights") == "ssd" else 0
    return UnitStaging(
        weights=weights_on_ssd,
        gradients=staged("gradients"),
        step=staged("master_weights") + staged("optimizer_states") + staged("weights") - weights_on_ssd,
    )
