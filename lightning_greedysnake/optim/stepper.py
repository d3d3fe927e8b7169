"""The per-unit stepper: when each unit's optimizer step runs, on which thread, in how many parts.

- A unit's step runs on the optimizer lane (:class:`StepLane`) as soon as its gradient is complete: its
  backward part at once (the lane may trail backward by ``lag`` units), its forward (alpha) part, when
  ``alpha`` defers one, after the window's backward, overlapping the next forward. A synchronous lane
  (``lag=0``) runs the backward part of a unit whose step stages nothing (all in host memory) once the
  window's backward is done (:meth:`StepLane.run_held`), as Lightning steps after backward.
- With clipping by the global norm (or a custom ``configure_gradient_clipping``) every unit's whole step
  waits until the whole backward is done and the clip coefficient is known.
- A unit's :class:`UpdateGate` entry is cleared when its step is submitted and published by the job
  that runs its last part, once the new weights are on their tier (and, with partitioned state, once
  every rank's chunk was gathered). Unit 0's step ends the window and the next forward starts with it,
  so it is never split, and its new weights may stay in memory for that forward (``keep_weights``).

Threads: everything here but the jobs runs on the training thread; the jobs run on the lane, in
submission order, and own the handles they captured.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.layout import StateLayout
from lightning_greedysnake.optim.contract import OptimizerContract, StepPath
from lightning_greedysnake.optim.lane import StepLane
from lightning_greedysnake.optim.part_step import PartStepper
from lightning_greedysnake.optim.protocols import StagedBuffer, StepCollectives, Staging, UpdateGate
from lightning_greedysnake.optim.state_format import StateFormat
from lightning_greedysnake.optim.unit_optimizer import UnitOptimizer


@dataclass
class ClipPolicy:
    """How gradients are clipped, known at setup from the Trainer."""

    value: float | None = None
    """Clip each element to [-value, value], unit by unit as each gradient completes."""
    defer: bool = False
    """Hold every unit's step until the whole backward is done (global-norm clipping needs all
    gradients first; a custom ``configure_gradient_clipping`` may need them too)."""


class SpeculativeSteps:
    """fp16 loss scaling without deferred clipping: a window's steps run before it is known to be finite,
    each writing its unit's other slot; this keeps what undoing them restores. Training thread only, no
    lock (the lane's jobs never touch it): :meth:`record` at a step's submission, before its job is queued
    (no job of that unit in flight, so its slots and scalars are settled); :meth:`restore` only with the
    lane drained (the jobs write what it restores)."""

    def __init__(self, staging: Staging) -> None:
        self._staging = staging
        self._journal: dict[int, tuple[tuple[int, ...], UnitOptimizer, Any]] = {}
        """Per unit stepped in this window: its slots, its optimizer and that one's scalar state before."""

    def record(self, unit: int, opt: UnitOptimizer) -> None:
        """``unit``'s step is being submitted: keep its state from before the window's first step of it."""
        if unit not in self._journal:
            self._journal[unit] = (self._staging.slots.of(unit), opt, opt.snapshot())

    def commit(self) -> None:
        """The window's steps stand (its gradients were finite, or it was abandoned)."""
        self._journal.clear()

    def restore(self) -> list[int]:
        """Undo the window's steps: each stepped unit's slots (its previous values, untouched) and scalar
        state as they were; returns those units."""
        units = sorted(self._journal)
        for unit, (slots, opt, scalars) in self._journal.items():
            self._staging.slots.restore(unit, slots)
            opt.restore(scalars)
        self._journal.clear()
        return units


class UnitStepper:
    def __init__(self, optimizer: torch.optim.Optimizer | None, state: StateLayout, slots: tuple[str, ...],
                 staging: Staging, gate: UpdateGate, compute_dtype: torch.dtype, clip: ClipPolicy,
                 alpha: float, lane: StepLane, *, state_format: StateFormat | None = None,
                 keep_weights: Callable[[int, StagedBuffer], bool] | None = None,
                 collectives: StepCollectives | None = None, loss_scaler: Any = None, speculative: bool = False,
                 gradient_observer: Callable[[int, Tensor], None] | None = None,
                 trim_heap: bool = True, contract: OptimizerContract | None = None) -> None:
        """``lane``: the optimizer lane the steps run on (its depth is the lag), the caller's to share
        (the pool asks it whether buffers are on their way back); this stepper closes it.
        ``keep_weights``: offered unit 0's new weights after its step: True when it kept them (and owns
        the handle). ``collectives``: data parallel's. ``loss_scaler`` (fp16): each gradient is unscaled
        by its ``inv_scale`` (read when the step is submitted, on the training thread, which alone
        updates the scale, after the window); an overflow is the loss scaler's to handle, so no unit
        checks its gradient for non-finite values then. ``speculative``: see :class:`SpeculativeSteps`
        (each step's :meth:`Staging.flip` at its end). ``gradient_observer``: told ``(unit, flat fp32
        gradient)`` once per window for every stepped unit: the complete gradient (averaged over the
        ranks, before clipping), on the thread running the step, valid only during the call.
        ``trim_heap``: give the heap's free pages back to the OS after each part's step. ``contract``: how
        the optimizer is stepped (flat slices or whole parameters; state made at construction), default
        element-wise (:func:`~lightning_greedysnake.optim.contract.optimizer_contract`)."""
        self.optimizer = optimizer
        self.contract = contract or OptimizerContract(StepPath.ELEMENT_WISE, slots)
        self.state = state
        self.slots = slots
        self.clip = clip
        self.compute_dtype = compute_dtype
        self.alpha = alpha
        self._staging = staging
        self._gate = gate
        self.unit_optimizers: list[UnitOptimizer | None] = [self._unit_optimizer(u) for u in range(state.num_units)]
        self.parts = PartStepper(staging, self.unit_optimizers, slots, compute_dtype, state_format, trim_heap)
        self._state_format = state_format
        self.lane = lane
        self.keep_weights = keep_weights or (lambda unit, held: False)
        self.collectives = collectives
        self.gradient_observer = gradient_observer
        self.loss_scaler = loss_scaler
        self.speculation = SpeculativeSteps(staging) if speculative else None
        self.check_finite = loss_scaler is None
        """Look for a non-finite value in every unit's complete gradient (one sum on the lane)."""
        self.nonfinite: list[int] = []
        """Units whose gradient had a non-finite value since the training thread last took the list
        (appended on the lane; :meth:`take_nonfinite` on the training thread)."""
        self._nonfinite_lock = threading.Lock()
        self.steps_completed = [0] * state.num_units
        """Per unit, optimizer steps completed (all parts), since construction: written by the thread that
        runs a step's last part, read on the training thread after :meth:`drain`."""
        self._alpha_pending: list[tuple[int, list[dict[str, Any]], list[bool]]] = []
        """Forward parts to submit after this window's backward: (unit, hyperparameters, has_grad)."""
        self._waiting: list[int] = []
        """Units whose complete gradient waits for clipping (deferred mode)."""
        self._clip_coef: Tensor | None = None
        self._value_clips: list[float] = []

    def _unit_optimizer(self, u: int) -> UnitOptimizer | None:
        if self.optimizer is None:
            return None
        lay = self.state.units[u]
        return UnitOptimizer(self.optimizer, lay, self.slots, self.state.split(u, self.alpha_of(u)),
                             self.state.bounds(u), whole_parameters=self.contract.whole_parameters,
                             eager_state=self.contract.eager_state, calls=self.contract.calls)

    # -- the split --------------------------------------------------------------------------------------
    def alpha_of(self, unit: int) -> float:
        """The deferred fraction of ``unit``'s update. Never of unit 0's: its step ends the window and the
        next forward starts with it, so a deferred part would run right away anyway, only adding its
        gradient's trip to the SSD and back."""
        return 0.0 if unit == 0 else self.alpha

    def defers(self, unit: int) -> bool:
        """Whether ``unit`` has a deferred (alpha) part on any rank: every rank must make the same
        decision, since the weights gather follows the unit's last part."""
        ranks = range(self.state.shard[1]) if self.state.shard is not None else [None]
        for r in ranks:
            lo, hi = self.state.bounds(unit, r)
            if self.state.split(unit, self.alpha_of(unit), (lo, hi)) < hi:
                return True
        return False

    def deferred_range(self, unit: int) -> tuple[int, int]:
        """Elements of ``unit`` this rank steps in the next forward (empty when nothing is deferred)."""
        opt = self.unit_optimizers[unit]
        if opt is None or not self.state.units[unit].trainable_numel:
            return 0, 0
        return opt.part_range(1)

    def trains(self, unit: int) -> bool:
        return self.unit_optimizers[unit] is not None and self.state.units[unit].trainable_numel > 0

    def reconfigure(self, alpha: float, lag: int) -> None:
        """Between steps, with the lane drained: re-split every unit keeping its state, resize the lane."""
        self.parts.drop_all_read_aheads()  # read for the old split
        self.alpha = alpha
        for u, old in enumerate(self.unit_optimizers):
            if old is None:
                continue
            new = self._unit_optimizer(u)
            assert new is not None
            for j in range(len(old.trainable)):
                if old.param_initialized(j):
                    new.set_param_scalar_state(j, old.param_scalar_state(j), old.param_streamed(j))
            new.set_calls(*old.call_state())
            self.unit_optimizers[u] = new  # in place: the part stepper shares the list
        self.lane.set_lag(lag)

    def call_state(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """The optimizer's per-call state (:class:`~lightning_greedysnake.optim.unit_optimizer.CallState`) as
        the units' steps left it, per user param group and attribute (with the lane drained: every unit's
        parts agree then)."""
        groups: dict[int, dict[str, Any]] = {}
        attributes: dict[str, Any] = {}
        for opt in self.unit_optimizers:
            if opt is None:
                continue
            unit_groups, unit_attributes = opt.call_state()
            for gi, entries in unit_groups.items():
                groups.setdefault(gi, entries)
            for name, value in unit_attributes.items():
                attributes.setdefault(name, value)
        return groups, attributes

    def load_calls(self) -> None:
        """Every unit's per-call state from the user's optimizer (as a checkpoint just loaded it)."""
        for opt in self.unit_optimizers:
            if opt is not None:
                opt.load_calls(opt.user_optimizer)

    # -- submitting (training thread) ------------------------------------------------------------------------
    def _hyper(self) -> list[dict[str, Any]]:
        """The user's param-group hyperparameters now (the LR Lightning's step would use), as a snapshot:
        a deferred part must not see the LR scheduler's next value."""
        assert self.optimizer is not None
        return [
            {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]

    def read_ahead(self, unit: int, unit_need_bytes: Callable[[], int], last: bool = True) -> bool:
        """A hint: ``unit``'s step comes (``last``: it is the window's last, which the next forward waits
        for); read what it reads now if the budget allows (:meth:`PartStepper.read_ahead`). Returns whether
        its reads are under way or it has none (:meth:`TensorStore.prefetch_step`)."""
        if not 0 <= unit < self.state.num_units or self.clip.defer or not self._gate.is_current(unit):
            return False
        if self.unit_optimizers[unit] is None or self.parts.has_read_ahead(unit):
            return True
        return self.parts.read_ahead(unit, unit_need_bytes(), last)

    def submit_backward_part(self, unit: int, grad: StagedBuffer, weights: StagedBuffer | None,
                             has_grad: list[bool], averaged: bool = False) -> None:
        """``unit``'s gradient is complete: step its backward part on the lane (the forward part follows
        with :meth:`submit_forward_parts`). ``averaged``: data parallel already averaged it over the ranks
        (on the device), so the lane does not. The job owns ``grad`` and ``weights`` (the unit's acquired
        compute weights, if still held) and gives them back."""
        hyper = self._hyper()
        opt = self.unit_optimizers[unit]
        assert opt is not None
        if self.speculation is not None:
            self.speculation.record(unit, opt)  # (no job of it in flight)
        self._gate.begin(unit)
        deferred = self.defers(unit)
        inv_scale = self.loss_scaler.inv_scale if self.loss_scaler is not None else None
        if deferred:
            self._alpha_pending.append((unit, hyper, has_grad))
        values = [] if self.clip.value is None else [self.clip.value]
        staging = self.parts.staging_bytes(unit, weights is not None)
        self._staging.budget.count_step_submitted(staging)

        def backward_part() -> None:  # on the lane
            stepped = grad_given_back = False
            try:
                flat = self._gradient(unit, grad, inv_scale, values, average=not averaged)
                try:
                    self.parts.step_part(unit, 0, flat, weights, hyper, has_grad, reads_out=self.lane.start_aheads)
                finally:
                    self._staging.budget.count_step_staged(staging)
                lo, hi = opt.part_range(1)
                grad_given_back = True
                if deferred and lo < hi:
                    # the forward part's gradient waits on its tier until the forward-part step
                    self._staging.put_back(TensorKind.GRADIENTS, unit, grad,
                                           self.state.byte_ranges(TensorKind.GRADIENTS, unit, lo, hi))
                else:
                    grad.release()
                stepped = True
            finally:
                if not grad_given_back:
                    grad.release()
                if weights is not None and not (
                    stepped and not deferred and unit == 0 and self.state.shard is None
                    and self.keep_weights(unit, weights)
                ):
                    weights.release()
            if not deferred:
                self._complete(unit)

        # a synchronous step (lag 0) that holds no staging buffer (gradient, weights and state all in
        # host memory) waits for the end of the window's backward, Lightning's own order: its temporaries
        # then reuse what the backward freed rather than stack on its live activations (inside the
        # backward it overlaps nothing either); one holding staging buffers runs at once, so they come back
        hold = staging == 0 and not grad.pooled and not (weights is not None and weights.pooled)
        try:
            self.lane.submit(backward_part, heavy=True, hold=hold)  # (blocks while lag steps are queued)
        except BaseException:
            # not submitted (the lane failed, or Ctrl-C while waiting for a slot): nothing was stepped,
            # the unit's weights on their tier are current, and its handles go back here
            self._staging.budget.count_step_staged(staging)
            if deferred:
                self._alpha_pending.pop()
            grad.release()
            if weights is not None:
                weights.release()
            self._gate.publish(unit)
            raise

    def submit_forward_parts(self) -> None:
        """After a window's backward: the deferred (alpha) part of every stepped unit, in the order the
        next forward needs them; each unit's forward waits for its own."""
        pending, self._alpha_pending = sorted(self._alpha_pending, key=lambda e: e[0]), []
        for unit, hyper, has_grad in pending:

            def forward_part(unit: int = unit, hyper: list = hyper, has_grad: list = has_grad) -> None:  # lane
                opt = self.unit_optimizers[unit]
                assert opt is not None
                lo, hi = opt.part_range(1)
                if lo < hi:  # (a rank's chunk may end before the split: nothing deferred on this rank)
                    # the gradient's read goes out with the part's own (one wait for all: step_part)
                    held = self._staging.stage(TensorKind.GRADIENTS, unit, read=True, wait=False,
                                               ranges=self.state.byte_ranges(TensorKind.GRADIENTS, unit, lo, hi))
                    try:
                        flat = held.view(torch.float32, self.state.units[unit].trained_numel)
                        self.parts.step_part(unit, 1, flat, None, hyper, has_grad,
                                             reads_out=self.lane.start_aheads, grad_reads=held)
                    finally:
                        held.release()
                self._complete(unit)

            self.lane.submit(forward_part, heavy=False, ahead=lambda unit=unit: self._read_ahead_deferred(unit))

    def _read_ahead_deferred(self, unit: int) -> bool:
        """A queued forward part's ``ahead`` (on the lane, from the job before it: see
        :meth:`StepLane.start_aheads`): its master weights and state, from the slack only. Part 1's ranges
        are the unit's last step's until this part runs, whatever ran since (part 0 writes its own)."""
        return not self.clip.defer and self.parts.read_ahead(unit, 0, last=False, part=1)

    # -- clipping (deferred mode) -------------------------------------------------------------------------
    def wait_for_clipping(self, unit: int) -> None:
        """Deferred mode: ``unit``'s gradient is complete; its step waits for :meth:`submit_whole_step`."""
        self._waiting.append(unit)

    def take_waiting(self) -> list[int]:
        waiting, self._waiting = sorted(self._waiting), []
        return waiting

    def clip_by_norm(self, max_norm: float, total: Tensor) -> None:
        """Deferred mode: scale every waiting gradient as ``clip_grad_norm_`` would (applied at step)."""
        self._clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)

    def clip_by_value(self, value: float) -> None:
        if not self.clip.defer:
            if self.clip.value is None or float(value) != float(self.clip.value):
                raise ValueError(
                    f"gradient clipping by value {value} was requested at step time, but greedysnake already "
                    f"stepped units with clip value {self.clip.value}. Fix: set Trainer(gradient_clip_val=...) "
                    "to the value you pass to clip_gradients."
                )
            return
        self._value_clips.append(float(value))

    def take_clipping(self) -> tuple[list[float], Tensor | None]:
        """The clipping requested for this window (value clips, norm coefficient), forgotten here."""
        values, coef = list(self._value_clips), self._clip_coef
        self._value_clips, self._clip_coef = [], None
        return values, coef

    def submit_whole_step(self, unit: int, grad: StagedBuffer | None, has_grad: list[bool], values: list[float],
                          coef: Tensor | None, inv_scale: float | None = None) -> None:
        """Deferred mode, after clipping: ``unit``'s whole step (``grad``: its gradient in memory, owned by
        the job from now on; None: on its tier), its gradient unscaled by ``inv_scale`` first under loss
        scaling (GradScaler's order: unscale, clip, step)."""
        hyper = self._hyper()
        self._gate.begin(unit)

        def whole_step() -> None:  # on the lane
            held = grad if grad is not None else self._staging.stage(TensorKind.GRADIENTS, unit, read=True)
            try:
                flat = self._gradient(unit, held, inv_scale, values, coef)
                self.parts.step_part(unit, 0, flat, None, hyper, has_grad)
                self.parts.step_part(unit, 1, flat, None, hyper, has_grad)
            finally:
                held.release()
            self._complete(unit)

        try:
            self.lane.submit(whole_step, heavy=False)
        except BaseException:
            if grad is not None:
                grad.release()
            self._gate.publish(unit)  # never stepped: its weights are current
            raise

    def _gradient(self, unit: int, grad: StagedBuffer, inv_scale: float | None, values: list[float],
                  coef: Tensor | None = None, average: bool = False) -> Tensor:
        """``unit``'s complete gradient, a flat fp32 view of ``grad`` made ready to step in place (in a job, on
        the lane): averaged over the ranks when ``average``, unscaled by ``inv_scale``, observed (non-finite
        check, gradient observer), then clipped: clamped to each of ``values``, scaled by ``coef``."""
        grad.wait_reads()  # hand-over from the device's D2H copy of the gradient, if any, to the lane
        flat = grad.view(torch.float32, self.state.units[unit].trained_numel)
        if self.collectives is not None and average:
            self.collectives.average_gradient(flat)  # data parallel: the ranks' gradients averaged, as DDP does
        if inv_scale is not None:
            flat.mul_(inv_scale)  # (GradScaler's order: unscale, clip, step)
        if self.check_finite and not math.isfinite(float(flat.sum())):  # inf - inf is NaN: one pass
            with self._nonfinite_lock:
                self.nonfinite.append(unit)
        if self.gradient_observer is not None:
            self.gradient_observer(unit, flat)
        for v in values:
            flat.clamp_(-v, v)
        if coef is not None:
            flat.mul_(coef)
        return flat

    def take_nonfinite(self) -> list[int]:
        with self._nonfinite_lock:
            units, self.nonfinite = self.nonfinite, []
        return units

    def _complete(self, unit: int) -> None:
        """``unit``'s last part is stepped (in its job, on the lane): the slots it wrote become current, every
        rank's chunk of the new weights is gathered into the weights tier, and the unit is published."""
        self._staging.slots.flip(unit)  # (speculative: the step wrote the other slot)
        self._gather_weights(unit)
        self.steps_completed[unit] += 1
        self._gate.publish(unit)

    def _gather_weights(self, unit: int) -> None:
        """Partitioned state: after this rank's chunk of ``unit`` is stepped, bring every other chunk's new
        compute weights into the weights tier (all ranks call this in the same unit order)."""
        if self.state.shard is None:
            return
        assert self.collectives is not None, "partitioned state needs a weights gatherer"
        # the trained prefix only: the read-only rest of the region is the same on every rank, never written
        prefix = self.state.byte_ranges(TensorKind.WEIGHTS, unit, 0, self.state.units[unit].trained_numel)
        held = self._staging.stage(TensorKind.WEIGHTS, unit, read=True, ranges=prefix)
        try:
            flat = held.view(self.compute_dtype, self.state.units[unit].trained_numel)
            self.collectives.gather_weights(flat, [self.state.bounds(unit, r) for r in range(self.state.shard[1])])
        except BaseException:
            held.release()
            raise
        self._staging.put_back(TensorKind.WEIGHTS, unit, held, prefix)

    # -- lifetime (training thread) ---------------------------------------------------------------------------
    def drain(self) -> None:
        """Complete every pending step, deferred forward parts included."""
        if self._alpha_pending:
            self.submit_forward_parts()
        self.lane.drain()

    def discard(self) -> None:
        """An abandoned window: forget its waiting steps and read-aheads. A unit whose backward part was
        stepped already (a failure in the middle of the window's backward) gets its forward part too, so
        no unit is left half updated; where the lane failed, nothing more runs."""
        if self._alpha_pending and not self.lane.failed:
            self.submit_forward_parts()
        self._alpha_pending.clear()
        self._waiting.clear()
        if self.speculation is not None:
            self.speculation.commit()  # (an abandoned window's steps stand, as without speculation)
        self.parts.drop_all_read_aheads()

    def commit(self) -> None:
        """Speculative steps: the window's gradients were all finite; its steps stand (training thread)."""
        assert self.speculation is not None
        self.speculation.commit()

    def roll_back(self) -> list[int]:
        """Speculative steps: the window had a non-finite gradient. Skip its forward parts, wait for every
        step of it on the lane, then undo each stepped unit (:meth:`SpeculativeSteps.restore`). Returns
        those units (training thread)."""
        pending, self._alpha_pending = self._alpha_pending, []
        self.lane.drain()
        for unit, _, _ in pending:
            self._gate.publish(unit)  # never completed: its current values (restored below) stand
        assert self.speculation is not None
        units = self.speculation.restore()
        for unit in set(units) - {unit for unit, _, _ in pending}:
            self.steps_completed[unit] -= 1  # (completed, and now undone)
        self.parts.drop_all_read_aheads()
        return units

    def close(self) -> None:
        """Run what is queued (a failed lane runs nothing more) and stop the lane; drop read-aheads and
        the training thread's state scratch (``lag=0`` steps here)."""
        self.lane.close()
        self.parts.drop_all_read_aheads()
        if self._state_format is not None:
            self._state_format.release_scratch()
