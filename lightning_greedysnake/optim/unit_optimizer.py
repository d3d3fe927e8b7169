"""Steps one unit's parameters with the user's own optimizer class over flat per-unit buffers.

Instead of re-implementing AdamW, each unit gets a *shadow* instance of the class returned by
``configure_optimizers``: its parameters are leaf tensors whose data and gradients are set, per step, to
views into the unit's flat master and gradient buffers, and its per-element state (Adam's moments, SGD's
momentum) to views into the unit's flat state buffers. So the numerics are torch's own, kernel for kernel
(``fused=True`` included), and every hyperparameter, param group and LR-schedule change on the user's
optimizer is copied over before each step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.offload.layout import ParamSlot, UnitLayout


class UnsupportedOptimizerError(ValueError):
    pass


def _construct(cls: type[torch.optim.Optimizer], groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    return cls(groups)


def discover_slots(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """Names of the optimizer's per-element state, found by stepping a probe parameter once per group.

    Per-element state (a tensor shaped like the parameter) is what streams through the state tier; scalar
    state (step counters) stays in host memory. Anything else (factored second moments, say) cannot be
    split per unit and is refused.
    """
    cls = type(optimizer)
    slots: list[str] = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        probe = torch.zeros(4, dtype=torch.float32, requires_grad=True)
        try:
            shadow = _construct(cls, [{**hyper, "params": [probe]}])
            eager_state = bool(shadow.state)
            probe.grad = torch.full_like(probe, 0.5)
            shadow.step()
        except Exception as e:  # noqa: BLE001 - reported with the optimizer's name
            raise UnsupportedOptimizerError(
                f"greedysnake could not step {cls.__name__} per unit ({type(e).__name__}: {e}). It re-creates "
                "the optimizer class per unit from its param groups. Fix: use torch.optim.AdamW, Adam or SGD."
            ) from e
        if eager_state:
            raise UnsupportedOptimizerError(
                f"{cls.__name__} creates its state when constructed rather than on its first step, which "
                "greedysnake's per-unit streaming does not support yet. Fix: use torch.optim.AdamW, Adam or SGD."
            )
        for name, value in shadow.state[probe].items():
            if isinstance(value, Tensor) and value.shape == probe.shape:
                if value.dtype != torch.float32:
                    raise UnsupportedOptimizerError(
                        f"{cls.__name__} keeps state {name!r} in {value.dtype}; greedysnake streams fp32 "
                        "per-element state. Fix: use torch.optim.AdamW, Adam or SGD."
                    )
                if name not in slots:
                    slots.append(name)
            elif isinstance(value, Tensor) and value.numel() > 1:
                raise UnsupportedOptimizerError(
                    f"{cls.__name__} keeps state {name!r} of shape {tuple(value.shape)} for a parameter of "
                    f"shape {tuple(probe.shape)}: not per-element, so it cannot be streamed per unit. Fix: use "
                    "torch.optim.AdamW, Adam or SGD."
                )
    return tuple(slots)


class UnitOptimizer:
    """The optimizer for one unit: ``step`` updates the flat master buffer and state buffers in place."""

    def __init__(self, optimizer: torch.optim.Optimizer, layout: UnitLayout, slots: tuple[str, ...]) -> None:
        self.user_optimizer = optimizer
        self.layout = layout
        self.slots = slots
        self.trainable: list[ParamSlot] = [p for p in layout.params if p.group is not None]
        self._shadow_params = [torch.zeros(1, requires_grad=True) for _ in self.trainable]
        self._group_index: list[int] = []
        groups: list[dict[str, Any]] = []
        for gi, group in enumerate(optimizer.param_groups):
            members = [sp for sp, slot in zip(self._shadow_params, self.trainable) if slot.group == gi]
            if members:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
                self._group_index.append(gi)
        self._shadow = _construct(type(optimizer), groups) if groups else None
        self.scalar_state: list[dict[str, Any]] = [{} for _ in self.trainable]
        """Non-per-element state (e.g. Adam's ``step`` tensor) per trainable parameter."""
        self.initialized: list[bool] = [False] * len(self.trainable)
        """Whether the optimizer has created the parameter's state (it does so on its first step)."""

    @property
    def has_trainable(self) -> bool:
        return self._shadow is not None

    def step(self, master: Tensor, grad: Tensor, state: dict[str, Tensor], has_grad: list[bool]) -> None:
        """One optimizer step of this unit.

        ``master``/``grad``: the unit's flat fp32 buffers (``layout.numel`` elements); ``state``: one flat
        fp32 buffer per slot; ``has_grad[i]``: whether trainable parameter i got a gradient in this window
        (torch skips parameters without one, and so do we).
        """
        shadow = self._shadow
        if shadow is None:
            return
        for shadow_group, gi in zip(shadow.param_groups, self._group_index):
            for key, value in self.user_optimizer.param_groups[gi].items():
                if key != "params":
                    shadow_group[key] = value  # the LR in force now, as the LR scheduler left it
        for i, (sp, slot) in enumerate(zip(self._shadow_params, self.trainable)):
            sp.data = self._view(master, slot)
            sp.grad = self._view(grad, slot) if has_grad[i] else None
            if self.initialized[i]:
                shadow.state[sp] = {
                    **self.scalar_state[i],
                    **{name: self._view(buf, slot) for name, buf in state.items()},
                }
        try:
            shadow.step()
            for i, (sp, slot) in enumerate(zip(self._shadow_params, self.trainable)):
                st = shadow.state.get(sp)
                if not st:
                    continue
                scalars = {}
                for name, value in st.items():
                    if name in state:
                        view = self._view(state[name], slot)
                        if value is not view:  # created on the first step, or replaced: keep it in our buffer
                            view.copy_(value)
                    else:
                        scalars[name] = value
                self.scalar_state[i] = scalars
                self.initialized[i] = True
        finally:
            # drop every reference into the caller's buffers: they go back to the pool after this
            shadow.state.clear()
            for sp in self._shadow_params:
                sp.grad = None
                sp.data = torch.zeros(1)

    @staticmethod
    def _view(flat: Tensor, slot: ParamSlot) -> Tensor:
        return flat[slot.offset_numel : slot.offset_numel + slot.numel].view(slot.shape)
