"""Non-finite losses and gradients (``on_nonfinite``): named where they first appear instead of
training on with NaN weights to ``max_steps`` and exit code 0.

Every loss is kept as its micro-batch is back-propagated and the window's are checked together at its
last micro-batch (one host sync per window, not one per micro-batch); every unit's complete gradient on the
optimizer lane (the stepper's ``check_finite``). ``"skip"`` works on losses: every loss of a window is
known before any unit of it is stepped (the vertical and the horizontal order step units only once the
window's last micro-batch is back-propagated), so a window with a non-finite loss is dropped whole.

The guard answers (:meth:`NonFiniteGuard.drops_window`, :meth:`NonFiniteGuard.end_window`) and warns or
raises; the strategy acts on the engine. Training thread only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_greedysnake.offload.device import named_sync
from lightning_greedysnake.steps import step_running


class NonFiniteError(FloatingPointError):
    """A loss or gradient was not finite and ``on_nonfinite='raise'``."""


class NonFiniteGuard:
    def __init__(self, mode: str, warn: Callable[[str, str], None], loss_scaled: bool = False) -> None:
        self.mode = mode
        self._warn = warn
        self._loss_scaled = loss_scaled
        """16-mixed: a non-finite loss makes non-finite gradients, and the loss scaler skips that step."""
        self._window: str | None = None
        """The first non-finite loss of the window in progress, described."""
        self._skipping = False
        """The window in progress was dropped (its remaining ops will not run)."""
        self._losses: list[tuple[int, Tensor]] = []
        """(micro-batch, loss) of the window so far, checked at its last micro-batch."""
        self.stepped_nonfinite: tuple[list[int], int] | None = None
        """Where ``'raise'`` stopped on a gradient: the units stepped with a non-finite one and the
        ``global_step`` during that step. The check runs once the step is over, so its update landed before
        the raise (Lightning never counted it); the after-fit note says so."""

    def _check_losses(self, step: int) -> None:
        """The window's losses so far, checked with one host sync (every loss is kept until then as a
        0-dim tensor: no sync per micro-batch)."""
        losses, self._losses = self._losses, []
        if not losses:
            return
        with named_sync("window losses finite"):
            if bool(torch.isfinite(torch.stack([loss for _, loss in losses])).all()):
                return
        microbatch, loss = next((m, t) for m, t in losses if not math.isfinite(float(t)))
        what = f"the loss of micro-batch {microbatch} of {step_running(step)} is {float(loss)}"
        if self.mode == "raise":
            raise NonFiniteError(f"greedysnake: {what}. on_nonfinite='raise' stops here. Fix: lower the learning "
                                 "rate, clip gradients, or check the data of that batch.")
        if self._window is None:
            self._window = what

    def drops_window(self, loss: Tensor, microbatch: int, *, last: bool, step: int) -> bool:
        """Micro-batch ``microbatch`` was back-propagated (``last``: the window's last; ``step``: the
        ``global_step`` during it): keep its loss, check the window's at its last micro-batch, and answer
        whether to drop the window there (``"skip"`` and a loss of it not finite): no unit of it was stepped
        yet, so its gradients can go whole."""
        if microbatch == 0:  # a new window (one Lightning cut short left its losses unchecked: forget them)
            self._losses, self._window = [], None
        self._losses.append((microbatch, loss.detach().float().reshape(())))
        if not last:
            return False
        self._check_losses(step)  # before the window's units are stepped (they are, from here on)
        if self.mode != "skip" or self._window is None:
            return False
        self._skipping = True
        return True

    def end_window(self, step: int) -> bool:
        """The window is over: True when it was dropped (nothing of it is left to finish or step; under
        loss scaling that counts as an overflow, as GradScaler would see its gradients)."""
        self._check_losses(step)  # (a window cut short by the end of the data)
        what, self._window = self._window, None
        skipped, self._skipping = self._skipping, False
        if skipped:
            self._warn(f"nonfinite_skip_{step}", f"greedysnake: {what}; on_nonfinite='skip' dropped that step's "
                       "update (no unit was stepped).")
        elif what is not None and self._loss_scaled:
            self._warn("nonfinite", f"greedysnake: {what}; under 16-mixed its gradients are not finite either, so "
                       "the loss scaler skips that step and backs off (on_nonfinite='warn'). (Reported once.)")
        elif what is not None:
            self._warn("nonfinite", f"greedysnake: {what}; training goes on (on_nonfinite='warn'), and the "
                       "weights will be NaN from here. Fix: on_nonfinite='raise' to stop, 'skip' to drop such "
                       "steps, or lower the learning rate / clip gradients. (Reported once.)")
        return skipped

    def check_gradients(self, units: list[int], step: int) -> None:
        """Units whose gradient had a non-finite value, seen on the lane by the end of optimizer step
        ``step`` (0-based, as ``global_step`` before it counts this one)."""
        if not units:
            return
        what = (f"the gradient of unit{'s' if len(units) > 1 else ''} {sorted(set(units))} is not finite "
                f"(found by {step_running(step)}; the lane steps units in the background)")
        if self.mode == "raise":
            self.stepped_nonfinite = (sorted(set(units)), step)
            raise NonFiniteError(f"greedysnake: {what}; those units were stepped with it. on_nonfinite='raise' "
                                 "stops here. Fix: lower the learning rate or clip gradients.")
        self._warn("nonfinite_grad", f"greedysnake: {what} (those units were stepped with it). Fix: "
                   "on_nonfinite='raise' to stop there, or lower the learning rate / clip gradients. (Reported once.)")
