"""The optimizer's state as checkpoints see it, in and out of the tensor manager, one unit at a time.

Per-element state (Adam's moments) lives in each unit's flat ``optimizer_states`` region, one slot after
another (fp32, or bf16 with ``offload.optimizer_state_dtype``, or the optimizer's own quantized format:
checkpoints always see fp32, so they load into any strategy, and loading narrows to nearest or
quantizes); scalar state (step counters) lives in the unit's :class:`UnitOptimizer`. These functions
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
from lightning_greedysnake.optim.subclass_state import SubclassCodec, SubclassState
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
    flat = held.view(dtype, lay.trained_numel, offset_bytes=state.slot_offset_bytes(u, k))
    return flat[slot.offset_numel : slot.offset_numel + slot.numel].view(slot.shape)


def _quantized(staging: Staging, codec: SubclassCodec | None, slots: tuple[str, ...], u: int,
               held: StagedBuffer | None) -> SubclassState | None:
    if codec is None or held is None:
        return None
    return SubclassState.over(codec, held, staging.state, u, slots)


def _read_quantized(access: SubclassState, opt: UnitOptimizer, j: int, name: str, slot: ParamSlot,
                    entry: dict[str, Any]) -> None:
    """Parameter j's slot ``name`` dequantized to fp32 into ``entry[name]``, piece by piece (a piece the
    optimizer keeps in fp32 from its host copy), and where every piece is quantized its components as
    they are (``entry["<name>.<component>"]``, whole blocks of the parameter: a resume reads them)."""
    out = torch.empty(slot.numel, dtype=torch.float32)
    raws: list[dict[str, Tensor] | None] = []
    for scalars, lo, hi, group in opt.pieces_of(j):
        value = scalars.get(name)
        raws.append(None if value is not None else access.raw(name, lo, hi, group))
        if value is None:
            value = access.read(name, lo, hi, group)
        out[lo - slot.offset_numel : hi - slot.offset_numel].copy_(value.reshape(-1))
    entry[name] = out.view(slot.shape)
    if raws and all(r is not None for r in raws):
        for c in access.codec.components:
            entry[f"{name}.{c.name}"] = torch.cat([r[c.name] for r in raws if r is not None])


def _write_quantized(access: SubclassState, opt: UnitOptimizer, j: int, name: str, slot: ParamSlot,
                     value: Tensor, raw: dict[str, Tensor]) -> None:
    flat = value.reshape(-1).to(torch.float32)
    for scalars, lo, hi, group in opt.pieces_of(j):
        a, b = lo - slot.offset_numel, hi - slot.offset_numel
        if raw and all(a % c.per == 0 and b % c.per == 0 for c in access.codec.components):
            piece_raw = {c.name: raw[c.name][a // c.per : -(-b // c.per)] for c in access.codec.components
                         if c.name in raw}
            if len(piece_raw) == len(access.codec.components) and access.write_raw(name, lo, hi, piece_raw, group):
                continue  # the saved codes and scales as they were
        if not access.write(name, lo, hi, flat[a:b], group):
            scalars[name] = flat[a:b].clone()  # kept in fp32 by the optimizer: on the host, as it would


def unit_optimizer_state(staging: Staging, opt: UnitOptimizer | None, slots: tuple[str, ...], u: int,
                         codec: SubclassCodec | None = None) -> Entries:
    """Unit ``u``'s optimizer state as new tensors (parameters not stepped yet are absent). ``codec``: the
    state is the optimizer's quantized subclass (checkpoints see it dequantized to fp32)."""
    if opt is None or not opt.has_trainable:
        return {}
    state = staging.state
    tindex = _trainable_index(state, u)
    if not any(opt.param_initialized(j) for j in tindex.values()):
        return {}
    held = staging.stage(TensorKind.OPTIMIZER_STATES, u, read=True) if slots else None
    quantized = _quantized(staging, codec, slots, u, held)
    try:
        entries: Entries = {}
        for i, j in tindex.items():
            if not opt.param_initialized(j):
                continue
            entry = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in opt.param_scalar_state(j).items()
                     if k not in slots}
            if held is not None:
                # a whole-parameter optimizer's streamed state differs by the parameter's shape (Adafactor: a
                # vector's variance streams, a matrix's row and column variances are host state)
                streamed = opt.param_streamed(j) if opt.whole_parameters else None
                for k, name in enumerate(slots):
                    if streamed is not None and name not in streamed:
                        continue
                    slot = state.units[u].params[i]
                    if quantized is not None:
                        _read_quantized(quantized, opt, j, name, slot, entry)
                    else:
                        entry[name] = _slot_view(held, state, u, k, slot).to(torch.float32, copy=True)
            entries[i] = entry
        return entries
    finally:
        if held is not None:
            held.release()


def load_unit_optimizer_state(staging: Staging, opt: UnitOptimizer | None, slots: tuple[str, ...], u: int,
                              entries: Entries, codec: SubclassCodec | None = None) -> None:
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
    quantized = _quantized(staging, codec, slots, u, held)
    try:
        for i, entry in entries.items():
            scalars, per_element, raw = {}, {}, {}
            for name, value in entry.items():
                if name in slots and isinstance(value, Tensor) and value.shape == lay.params[i].shape:
                    per_element[name] = value
                elif quantized is not None and name.partition(".")[0] in slots and isinstance(value, Tensor):
                    slot_name, _, component = name.partition(".")
                    raw.setdefault(slot_name, {})[component] = value  # (the quantized state as saved)
                else:
                    scalars[name] = value
            opt.set_param_scalar_state(tindex[i], scalars,
                                       streamed=tuple(per_element) if opt.whole_parameters else None)
            for name, value in per_element.items():
                assert held is not None
                if quantized is not None:
                    _write_quantized(quantized, opt, tindex[i], name, lay.params[i], value, raw.get(name, {}))
                else:
                    _slot_view(held, state, u, slots.index(name), lay.params[i]).copy_(value)
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
