"""A unit's whole values in and out of its tiers, outside any window (setup, checkpoints, the end of a
run): compute weights and, under a 16-bit compute dtype, the fp32 master weights. Training thread,
with no step of the unit in flight."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.offload.residency import slot_view
from lightning_greedysnake.offload.staging import StagingArena


def write_unit(arena: StagingArena, u: int, values: list[Tensor], compute_dtype: torch.dtype) -> None:
    """Set unit ``u``'s weights (and master weights) from full-precision tensors in layout order."""
    state = arena.state
    lay = state.units[u]
    weights = arena.stage(TensorKind.WEIGHTS, u, read=False)
    flat = weights.view(compute_dtype, lay.numel)
    for slot, value in zip(lay.params, values, strict=True):
        slot_view(flat, slot).copy_(value.detach())
    arena.put_back(TensorKind.WEIGHTS, u, weights)
    if state.region_bytes(TensorKind.MASTER_WEIGHTS, u):
        master = arena.stage(TensorKind.MASTER_WEIGHTS, u, read=False)
        mflat = master.view(torch.float32, lay.numel)
        for slot, value in zip(lay.params, values, strict=True):
            if slot.group is not None:
                slot_view(mflat, slot).copy_(value.detach())
        arena.put_back(TensorKind.MASTER_WEIGHTS, u, master, state.chunk_ranges(TensorKind.MASTER_WEIGHTS, u))


def read_unit(arena: StagingArena, u: int, compute_dtype: torch.dtype) -> list[Tensor]:
    """Unit ``u``'s full-precision weights as new tensors in layout order."""
    state = arena.state
    lay = state.units[u]
    has_master = bool(state.region_bytes(TensorKind.MASTER_WEIGHTS, u))
    weights = arena.stage(TensorKind.WEIGHTS, u, read=True)
    try:
        flat = weights.view(compute_dtype, lay.numel)
        dtype = torch.float32 if state.separate_master else compute_dtype
        # (a trained parameter's value comes from the master weights below: no copy of it made here)
        out = [torch.empty(0) if has_master and slot.group is not None else slot_view(flat, slot).to(dtype, copy=True)
               for slot in lay.params]
    finally:
        weights.release()
    if has_master:
        master = arena.stage(TensorKind.MASTER_WEIGHTS, u, read=True)
        try:
            mflat = master.view(torch.float32, lay.numel)
            for k, slot in enumerate(lay.params):
                if slot.group is not None:
                    out[k] = slot_view(mflat, slot).clone()
        finally:
            master.release()
    return out
