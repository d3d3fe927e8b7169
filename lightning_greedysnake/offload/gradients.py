"""The gradient accumulator: every unit's gradient for the window in one flat fp32 buffer.

Gradients never stay in ``param.grad``: a post-accumulate hook adds each micro-batch's gradient into the
unit's flat fp32 accumulator and clears ``param.grad``. A unit's accumulator lives from its first
gradient to its optimizer step; if the unit is released before its gradient is complete (the horizontal
order), or the step waits for the global norm, the accumulator waits on the ``gradients`` tier.

Device tier (``copies``): the accumulator lives in device memory instead, on the compute stream, and
leaves it once per window (vertical order): :meth:`take` copies it into a host staging handle on the
D2H stream, ordered after the op that produced it (the last add's point on the compute stream, or the
collective's event); the handle tracks the copy, and whoever reads it (the step job, a write to the tier)
waits for it first (``wait_reads``). A spilled accumulator comes back with an H2D copy into new memory of
the H2D stream's (it waits for no queued compute), which the compute stream waits for.

Threads: the training thread, and on CUDA autograd's device thread, which runs the hooks while the
training thread waits in ``backward()`` (that call is the hand-over). A handle taken with :meth:`take`
belongs to the caller (a step job) from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.layout import StateLayout
from lightning_greedysnake.offload.device import DeviceCopies, named_sync
from lightning_greedysnake.offload.device_reduce import DeviceGradientReducer
from lightning_greedysnake.offload.residency import slot_view
from lightning_greedysnake.offload.staging import Staged, StagingArena


class GradientAccumulator:
    def __init__(self, arena: StagingArena, state: StateLayout, params: list[list[nn.Parameter]],
                 copies: DeviceCopies | None = None, reducer: DeviceGradientReducer | None = None) -> None:
        self._arena = arena
        self._copies = copies
        self._on_device: dict[int, Tensor] = {}
        """Device tier: accumulators in device memory (instead of ``_grads``)."""
        self.reducer = reducer
        """Data parallel on the device tier: averages each gradient over the ranks before :meth:`take`
        copies it."""
        self._state = state
        self.params = params
        self.where: dict[int, tuple[int, int]] = {
            id(p): (u, i) for u, ps in enumerate(params) for i, p in enumerate(ps)
        }
        """Parameter id -> (unit, index in the unit's layout)."""
        self._grads: dict[int, Staged] = {}
        """Accumulators in memory."""
        self._spilled: set[int] = set()
        """Units whose accumulator waits on the gradients tier."""
        self._has_grad: dict[int, list[bool]] = {}
        """Per unit in this window, per parameter of its layout: whether a gradient reached it."""
        self._norms: dict[int, list[Tensor | None]] = {}
        """Per-parameter 2-norms of the complete gradients waiting for clipping by the global norm."""
        self._finite: list[Tensor] = []
        """Speculative steps (fp16): per unit completed in this window, whether its gradient is finite."""
        self._hooks: list[Any] = []
        self._laid_out: list[tuple[nn.Parameter, str, bool]] = []
        """Every parameter with its name and ``requires_grad`` as laid out (:meth:`register_hooks`)."""
        self._scratch: Tensor | None = None
        """fp32 room for one parameter's 16-bit gradient on its way into the accumulator."""
        self._largest_param = max((s.numel for lay in state.units for s in lay.params), default=1)

    # -- hooks -------------------------------------------------------------------------------------------
    def register_hooks(self) -> None:
        for ps in self.params:
            for p in ps:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._laid_out = [(p, slot.name, p.requires_grad) for ps, lay in zip(self.params, self._state.units, strict=True)
                          for p, slot in zip(ps, lay.params, strict=True)]

    def check_requires_grad(self) -> None:
        """Refuse a parameter whose ``requires_grad`` changed since the layout was made (at the start of fit):
        a frozen one is read-only there, with no room for a gradient or state, and a hook collects the
        gradients of the others (training thread, at the start of every window)."""
        for p, name, was in self._laid_out:
            if p.requires_grad != was:
                raise ValueError(
                    f"parameter {name!r} changed requires_grad from {was} to {p.requires_grad} during fit: "
                    "strategy='greedysnake' lays out which parameters are trained when fit starts (a frozen one "
                    "read-only, with no gradient, state or master room), so it would not train as Lightning "
                    "does. Fix: set requires_grad before trainer.fit; to unfreeze (or freeze) during training, end "
                    "the fit and start a new one from its checkpoint (trainer.fit(..., ckpt_path=...)), which lays "
                    "the parameters out again.")

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _on_grad(self, p: Tensor) -> None:
        """Post-accumulate hook: move this micro-batch's gradient into the unit's fp32 accumulator."""
        u, i = self.where[id(p)]
        grad = p.grad
        if grad is None:
            return
        slot = self._state.units[u].params[i]
        if slot.group is None:
            p.grad = None  # trainable but not in the optimizer: Lightning would never step it either
            return
        view = slot_view(self.flat(u), slot)
        if not self._has_grad[u][i]:
            view.copy_(grad)  # nothing written here yet in this window: the first gradient is the sum
        elif grad.dtype == view.dtype:
            view.add_(grad)
        else:
            # fp32 += bf16 through torch's type promotion allocates an fp32 temporary per call, fresh
            # memory to fault in: a copy into a kept buffer and an fp32 add is the same sum, bit for bit
            if self._scratch is None or self._scratch.numel() < grad.numel():
                self._scratch = torch.empty(max(grad.numel(), self._largest_param), dtype=view.dtype,
                                            device=view.device)
            scratch = self._scratch[: grad.numel()].view(grad.shape)
            scratch.copy_(grad)
            view.add_(scratch)
        self._has_grad[u][i] = True
        p.grad = None

    # -- accumulators -------------------------------------------------------------------------------------
    def flat(self, u: int) -> Tensor:
        """Unit ``u``'s accumulator in memory: started on its first gradient (zero only where written, until
        :meth:`_complete`), read back if spilled."""
        if self._copies is not None:
            return self._device_flat(u)
        held = self._grads.get(u)
        if held is None:
            if u in self._spilled:
                self._spilled.discard(u)
                held = self._arena.stage(TensorKind.GRADIENTS, u, read=True)
            else:
                held = self._arena.stage(TensorKind.GRADIENTS, u, read=False)  # (not zeroed: see _complete)
                self._has_grad[u] = [False] * len(self._state.units[u].params)
            self._grads[u] = held
        return held.view(torch.float32, self._state.units[u].trained_numel)

    def _device_flat(self, u: int) -> Tensor:
        assert self._copies is not None
        flat = self._on_device.get(u)
        if flat is not None:
            return flat
        numel = self._state.units[u].trained_numel
        if u in self._spilled:
            self._spilled.discard(u)
            held = self._arena.stage(TensorKind.GRADIENTS, u, read=True)
            try:
                # new memory of the H2D stream's: the copy waits for no queued compute (the adds before it
                # went into the accumulator taken when it spilled)
                flat, copy = self._copies.to_new_device(held.view(torch.float32, numel))
                held.track_write(copy)  # the host bytes stay until the copy is done
                self._copies.wait(copy)  # hand-over: the H2D stream -> the compute stream's next add
            finally:
                # a pooled buffer comes back once the copy is done; a host-tier region's handle waits for
                # it here (a host wait, in the horizontal order and deferred clipping only)
                held.release()
        else:
            flat = self._copies.empty(numel, torch.float32)  # (the compute stream's: it writes it first)
            self._has_grad[u] = [False] * len(self._state.units[u].params)  # (not zeroed: see _complete)
        self._on_device[u] = flat
        return flat

    def _complete(self, u: int) -> Tensor:
        """Unit ``u``'s accumulator with zeros wherever no gradient was written (alignment padding, and the
        parameters without a gradient so far), before anyone reads it whole: the ranks' average, the
        finiteness sum, the gradient observer, its tier. A fresh accumulator is not zeroed up front (a
        memory pass over every gradient): each parameter's first gradient is copied in."""
        flat = self.flat(u)
        end = 0
        written = sorted((s.offset_numel, s.offset_numel + s.numel)
                         for s, h in zip(self._state.units[u].params, self._has_grad[u], strict=True) if h)
        for lo, hi in written:
            if lo > end:
                flat[end:lo].zero_()
            end = hi
        if flat.numel() > end:
            flat[end:].zero_()
        return flat

    def has(self, u: int) -> bool:
        """A gradient reached unit ``u`` in this window."""
        return u in self._grads or u in self._on_device or u in self._spilled

    def in_memory(self, u: int) -> bool:
        return u in self._grads or u in self._on_device

    def on_host(self, u: int) -> bool:
        """Whether unit ``u``'s accumulator is in a host buffer now (on a device tier never: :meth:`take`
        stages one for the step)."""
        return u in self._grads

    def spill(self, u: int) -> None:
        """Send unit ``u``'s accumulator to its tier (the buffer comes back once written)."""
        held = self.take(u, reduce=False)  # (a partial sum: reduced only once complete)
        self._arena.put_back(TensorKind.GRADIENTS, u, held)  # (waits for a D2H copy still filling it)
        self._spilled.add(u)

    def take(self, u: int, reduce: bool = True) -> Staged:
        """Unit ``u``'s complete accumulator, in host memory (on a device tier: being copied there, which
        the handle tracks); the caller owns the handle from now on. With a device ``reducer`` (data
        parallel on the device tier) and ``reduce`` it is averaged over the ranks first, and with partitioned state
        only this rank's chunk comes over (the rest of the host buffer is zero)."""
        self._complete(u)
        if self._copies is None:
            return self._grads.pop(u)
        flat = self._on_device.pop(u)
        numel, lo, after = flat.numel(), 0, None
        if reduce and self.reducer is not None:
            flat, lo = self.reducer.reduce(flat, [self._state.bounds(u, r) for r in range(self.reducer.world)])
            after = self.reducer.after()
        held = self._arena.stage(TensorKind.GRADIENTS, u, read=False)
        try:
            host = held.view(torch.float32, numel)
            host[:lo].zero_()
            host[lo + flat.numel():].zero_()
            # ordering: the copy follows the op that produced ``flat``, no later one: the collective on it
            # (its stream's event), else the compute stream's point now, right after the last add (and
            # _complete's zeroing) were enqueued. The device memory goes back to its allocator here, the
            # copy's stream recorded on it
            produced = after if after is not None else self._copies.compute_event()
            held.track_read(self._copies.to_host(flat, host[lo : lo + flat.numel()], after=produced))
        except BaseException:
            held.release()
            raise
        return held

    def take_waiting(self, u: int) -> Staged | None:
        """Like :meth:`take`, but a spilled accumulator stays on its tier (None: the step reads it back)."""
        self._spilled.discard(u)
        if u in self._on_device:
            return self.take(u, reduce=False)  # (averaged already, for its norm)
        return self._grads.pop(u, None)

    def pop_has_grad(self, u: int) -> list[bool]:
        """Per trainable parameter of unit ``u``: whether it got a gradient in this window (for the step;
        torch skips parameters without one)."""
        has = self._has_grad.pop(u, None) or [False] * len(self._state.units[u].params)
        return [h for h, slot in zip(has, self._state.units[u].params, strict=True) if slot.group is not None]

    # -- norms (clipping by the global norm) --------------------------------------------------------------
    def record_norms(self, u: int, reduce: Callable[[Tensor], None] | None) -> None:
        """Unit ``u``'s gradient is complete: average it over the ranks (``reduce``) and keep the norm of
        each parameter's gradient, for :meth:`global_norm`."""
        flat = self._complete(u)
        if reduce is not None:
            reduce(flat)  # the norm is of the averaged gradient (nothing else on the lane now)
        has = self._has_grad[u]
        views = [slot_view(flat, s) for s, h in zip(self._state.units[u].params, has, strict=True) if h]
        norms = iter(torch._foreach_norm(views, 2.0) if views else [])
        self._norms[u] = [next(norms) if h else None for h in has]

    def global_norm(self, order: Iterable[nn.Parameter]) -> Tensor:
        """The 2-norm over every waiting gradient, combined in ``order`` (the optimizer's parameter order,
        as ``torch.nn.utils.clip_grad_norm_`` combines them)."""
        norms = []
        for p in order:
            where = self.where.get(id(p))
            if where is None:
                continue
            per_unit = self._norms.get(where[0])
            if per_unit is not None and per_unit[where[1]] is not None:
                norms.append(per_unit[where[1]])
        if not norms:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def note_finiteness(self, u: int) -> None:
        """Speculative steps: record whether unit ``u``'s complete gradient is finite, as a 0-dim tensor
        where the gradient is (no wait for a device), for :meth:`take_finiteness`."""
        self._finite.append(torch.isfinite(self._complete(u).sum()))  # (inf - inf is NaN: one pass finds either)

    def take_finiteness(self) -> bool:
        """Whether every gradient noted since the last call was finite (one read of all the flags)."""
        flags, self._finite = self._finite, []
        if not flags:
            return True
        with named_sync("window gradients finite"):
            return bool(torch.stack(flags).all())

    def norms_finite(self) -> bool:
        """Whether every recorded norm is finite (an inf or NaN anywhere in a gradient makes its norm so):
        one host read of all of them."""
        norms = [n for per_unit in self._norms.values() for n in per_unit if n is not None]
        if not norms:
            return True
        with named_sync("window gradient norms finite"):
            return bool(torch.isfinite(torch.stack(norms)).all())

    def clear_norms(self) -> None:
        self._norms.clear()

    def discard(self) -> None:
        """Drop every gradient of the window (abandoned before its step, as Lightning's zero_grad)."""
        self._finite.clear()
        for u in list(self._grads):
            self._grads.pop(u).release()
        self._on_device.clear()
        self._spilled.clear()
        self._has_grad.clear()
        self._norms.clear()
