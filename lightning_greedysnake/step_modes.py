"""How a window's units are stepped: chosen once, when the tensor manager is built, from the run's
clipping and loss scaling (:func:`step_mode`), never re-decided per step.

- :class:`InLine`: each unit is stepped on the optimizer lane as soon as its gradient is complete (during
  backward); its deferred (alpha) part follows the window's end and overlaps the next forward.
- :class:`DeferredForClipping`: clipping by the global norm (or a custom ``configure_gradient_clipping``)
  needs every gradient first: each complete gradient waits on its tier with its norms recorded, and
  every unit's whole step runs after clipping, in unit order; under loss scaling each gradient is
  unscaled first, and a window with a gradient not finite anywhere steps nothing.
- :class:`Speculative`: fp16 loss scaling without deferred clipping: in line, each step into the other
  slot of its unit's regions, and the whole window undone where any gradient on any rank was not finite.

The tensor manager calls :meth:`StepMode.gradient_ready` for each unit with a gradient and
:meth:`StepMode.finish` once per window, after clipping. Training thread only; the steps they submit run
on the lane.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from lightning_greedysnake.offload.gradients import GradientAccumulator
from lightning_greedysnake.offload.residency import WeightsResidency
from lightning_greedysnake.optim import ClipPolicy, UnitStepper


class StepMode(ABC):
    """The components a window's gradients and steps pass between, and what this mode does with them."""

    speculative = False
    """Steps write the other slot of their unit's regions (the tensor manager keeps two)."""

    def __init__(self, stepper: UnitStepper, grads: GradientAccumulator, weights: WeightsResidency,
                 host_group: Any = None) -> None:
        self.stepper = stepper
        self.grads = grads
        self.weights = weights
        self.host_group = host_group
        """Data parallel: the process group the window's verdict is agreed over (None: the default one)."""

    @abstractmethod
    def gradient_ready(self, unit: int) -> None:
        """``unit``'s gradient for this window is complete (and it trains, and one reached it)."""

    @abstractmethod
    def finish(self, inv_scale: float | None) -> bool:
        """After clipping: the window's remaining steps. False: it stepped nothing (a gradient not finite
        under loss scaling, ``inv_scale``), and its gradients went."""


class InLine(StepMode):
    """Each unit's backward part as its gradient completes; the forward parts once the window is over."""

    def gradient_ready(self, unit: int) -> None:
        grad = self.grads.take(unit)
        weights = self.weights.donate(unit)  # released by the engine soon; the job gives it back
        has_grad = self.grads.pop_has_grad(unit)
        self.weights.drop_prefetch(unit)
        self.stepper.submit_backward_part(unit, grad, weights, has_grad, averaged=self.grads.reducer is not None)

    def finish(self, inv_scale: float | None) -> bool:
        self.stepper.submit_forward_parts()  # (they overlap the next forward)
        return True


class Speculative(InLine):
    """In line, before the window is known to be finite: each unit's finiteness noted as its gradient
    completes (no wait), the window's verdict read once at its end."""

    speculative = True

    def gradient_ready(self, unit: int) -> None:
        self.grads.note_finiteness(unit)
        super().gradient_ready(unit)

    def finish(self, inv_scale: float | None) -> bool:
        """The window's verdict (one read of every unit's finiteness flag, agreed over the ranks): finite,
        the forward parts follow and the speculative steps stand; else every step of the window is waited
        for and undone, its gradients dropped: False."""
        bad = torch.tensor(0.0 if self.grads.take_finiteness() else 1.0)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(bad, torch.distributed.ReduceOp.MAX, group=self.host_group)
        if not bool(bad):
            self.stepper.commit()
            return super().finish(inv_scale)
        for unit in self.stepper.roll_back():
            self.weights.drop_prefetch(unit)  # (unit 0's new weights, kept for the next forward)
        self.grads.discard()
        return False


class DeferredForClipping(StepMode):
    """Every step waits for clipping: the gradients wait on their tier with their norms recorded."""

    def gradient_ready(self, unit: int) -> None:
        reducer, collectives = self.grads.reducer, self.stepper.collectives
        self.grads.record_norms(unit, reducer.average if reducer is not None else (
            collectives.average_gradient if collectives is not None else None))
        self.stepper.wait_for_clipping(unit)
        if not self.weights.is_held(unit):
            self.grads.spill(unit)  # wait on the gradients tier until finish (else: at the unit's release)

    def finish(self, inv_scale: float | None) -> bool:
        """Every unit's whole step, in unit order, clipped as asked; under loss scaling (``inv_scale``) each
        gradient unscaled first, or, where one is not finite, no step and the gradients dropped: False."""
        if inv_scale is not None and not self.grads.norms_finite():
            self.stepper.discard()
            self.grads.discard()
            return False
        values, coef = self.stepper.take_clipping()
        for unit in self.stepper.take_waiting():
            grad = self.grads.take_waiting(unit)
            self.weights.drop_prefetch(unit)
            self.stepper.submit_whole_step(unit, grad, self.grads.pop_has_grad(unit), values, coef, inv_scale)
        self.grads.clear_norms()
        return True


def step_mode(clip: ClipPolicy, loss_scaled: bool) -> type[StepMode]:
    """How a run with this clipping (and loss scaling: fp16) steps its windows."""
    if clip.defer:
        return DeferredForClipping
    return Speculative if loss_scaled else InLine
