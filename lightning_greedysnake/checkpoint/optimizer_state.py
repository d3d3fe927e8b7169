"""The optimizer's state as checkpoints see it, in and out of the tensor manager, one unit at a time.

Per-element state (Adam's moments) lives in each unit's flat ``optimizer_states`` region, one slot after
another (fp32, or bf16 with ``offload.optimizer_state_dtype``: checkpoints always see fp32, so they load
into any strategy, and loading narrows to nearest); scalar state (step counters) lives in the unit's :class:`UnitOptimizer`. These functions
turn them into ``torch.optim``'s per-parameter entries and back; the caller drains pending steps first
(:meth:`TieredTensorStore.drain`), so nothing steps while they run (training thread).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.layout import ParamSlot, StateLayout
from lightning_greedysnake.optim.protocols import StagedBuffer, Staging
from lightning_greedysnake.optim.unit_optimizer import UnitOptimizer

Entries = dict[int, dict[str, Any]]
"""Per parameter of a unit, keyed by its index in the unit's layout: ``{state name: value}``."""


def _trainable_index(state: StateLayout, u: int) -> dict[int, int]:
    """Layout index of each trainable parameter -> its index among the unit's trainable ones."""
    index: dict[int, int] = {}
    for i, slot in enumerate(state.units[u].params):
        if slot.group is not None:
            index[i] = len(index)
    return index


def _slot_view(held: StagedBuffer, state: StateLayout, u: int, k: int, slot: ParamSlot) -> Tensor:
    lay = state.units[u]
    dtype = torch.float32 if state.state_itemsize == 4 else torch.bfloat16
    flat = held.view(dtype, lay.numel, offset_bytes=state.slot_offset_bytes(u, k))
    return flat[slot.offset_numel : slot.offset_numel + slot.numel].view(slot.shape)


def unit_optimizer_state(staging: Staging, opt: UnitOptimizer | None, slots: tuple[str, ...], u: int) -> Entries:
    """Unit ``u``'s optimizer state as new tensors (parameters not stepped yet are absent)."""
    if opt is None or not opt.has_trainable:
        return {}
    state = staging.state
    tindex = _trainable_index(state, u)
    if not any(opt.param_initialized(j) for j in tindex.values()):
        return {}
    held = staging.stage(TensorKind.OPTIMIZER_STATES, u, read=True) if slots else None
    try:
        entries: Entries = {}
        for i, j in tindex.items():
            if not opt.param_initialized(j):
                continue
            entry = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in opt.param_scalar_state(j).items()}
            if held is not None:
                for k, name in enumerate(slots):
                    view = _slot_view(held, state, u, k, state.units[u].params[i])
                    entry[name] = view.to(torch.float32, copy=True)
            entries[i] = entry
        return entries
    finally:
        if held is not None:
            held.release()


def load_unit_optimizer_state(staging: Staging, opt: UnitOptimizer | None, slots: tuple[str, ...], u: int,
                              entries: Entries) -> None:
    """Inverse of :func:`unit_optimizer_state`."""
    assert opt is not None
    state = staging.state
    lay = state.units[u]
    tindex = _trainable_index(state, u)
    for i in entries:
        if i not in tindex:
            raise ValueError(f"optimizer state for {lay.params[i].name} (unit {u}), which the optimizer "
                             "does not train")
    held = staging.stage(TensorKind.OPTIMIZER_STATES, u, read=True) if slots else None
    try:
        for i, entry in entries.items():
            scalars = {}
            for name, value in entry.items():
                if name in slots and isinstance(value, Tensor) and value.shape == lay.params[i].shape:
                    assert held is not None
                    _slot_view(held, state, u, slots.index(name), lay.params[i]).copy_(value)
                else:
                    scalars[name] = value
            opt.set_param_scalar_state(tindex[i], scalars)
    except BaseException:
        if held is not None:
            held.release()
        raise
    if held is not None:
        staging.put_back(TensorKind.OPTIMIZER_STATES, u, held, state.chunk_ranges(TensorKind.OPTIMIZER_STATES, u))


def optimizer_state(optimizer: torch.optim.Optimizer, where: dict[int, tuple[int, int]], num_units: int,
                    unit_state: Callable[[int], Entries]) -> dict[int, dict[str, Any]]:
    """The per-parameter state in ``torch.optim`` form, keyed by the parameter's position in
    ``optimizer`` (the ``state`` entry of ``optimizer.state_dict()``), from every unit's
    ``unit_state(u)``. Holds the whole state in memory: checkpoints stream it unit by unit instead."""
    order: list[nn.Parameter] = [p for g in optimizer.param_groups for p in g["params"]]
    per_unit = {u: unit_state(u) for u in range(num_units)}
    out: dict[int, dict[str, Any]] = {}
    for idx, p in enumerate(order):
        at = where.get(id(p))
        if at is not None and at[1] in per_unit.get(at[0], {}):
            out[idx] = per_unit[at[0]][at[1]]
    return out


def split_optimizer_state(optimizer: torch.optim.Optimizer, where: dict[int, tuple[int, int]],
                          state: dict[int, dict[str, Any]]) -> dict[int, Entries]:
    """Inverse of :func:`optimizer_state`: a ``torch.optim`` state split into per-unit entries."""
    order = [p for g in optimizer.param_groups for p in g["params"]]
    by_unit: dict[int, Entries] = {}
    for idx, entry in state.items():
        at = where.get(id(order[int(idx)]))
        if at is None:
            raise ValueError(f"optimizer state for parameter {idx}, which is outside the layered model")
        by_unit.setdefault(at[0], {})[at[1]] = entry
    return by_unit
