"""Collectives of data parallel with partitioned state (ZeRO-style): each rank steps its chunk of every
unit; these bring the chunks together, for the next forward (weights) and for checkpoints (state).

Every function here is collective: all ranks call it with the same arguments, in the same order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_greedysnake.layout import ParamSlot
from lightning_greedysnake.unit_state import UnitValues


def gather_chunks(flat: Tensor, bounds: list[tuple[int, int]], rank: int, group: Any = None) -> int:
    """Fill ``flat`` (one unit's flat tensor, complete only in ``bounds[rank]``) with every rank's chunk;
    returns the bytes this rank sent. The bits travel as int32 (gloo has no 16-bit types)."""
    chunk = max(b - a for a, b in bounds)
    if chunk == 0:
        return 0
    chunk += chunk % 2  # whole int32 words for 16-bit values
    lo, hi = bounds[rank]
    mine = torch.zeros(chunk, dtype=flat.dtype)
    mine[: hi - lo] = flat[lo:hi]
    words = mine.view(torch.int32) if flat.element_size() in (2, 4) else mine
    out = [torch.empty_like(words) for _ in bounds]
    dist.all_gather(out, words, group=group)
    for k, (a, b) in enumerate(bounds):
        if k != rank and b > a:
            flat[a:b] = out[k].view(flat.dtype)[: b - a]
    return chunk * flat.element_size()


class ShardedStateView:
    """The tensor manager as a checkpoint save sees it, with each unit's master weights and optimizer
    state assembled from every rank's chunk (masked to the chunk, then summed over the ranks). Every
    method that reads state is collective."""

    def __init__(self, manager: UnitValues, rank: int, world: int) -> None:
        self.manager = manager
        self.rank, self.world = rank, world
        self.group = manager.host_group
        """The process group for host tensors (gloo beside NCCL; None: the default group)."""
        self.num_units = manager.num_units
        self.layouts = manager.layouts
        self.params = manager.params
        self.optimizer = manager.optimizer
        self.drain = manager.drain

    def _masked(self, u: int, slot: ParamSlot, value: Tensor) -> Tensor:
        lo, hi = self.manager.bounds(u)
        start = slot.offset_numel
        a, b = max(0, lo - start), max(0, min(slot.numel, hi - start))
        out = torch.zeros_like(value).reshape(-1)
        if a < b:
            out[a:b] = value.reshape(-1)[a:b]
        return out.view(value.shape)

    def unit_master_weights(self, u: int) -> list[Tensor]:
        values = self.manager.unit_master_weights(u)
        out = []
        for slot, value in zip(self.manager.layouts[u].params, values, strict=True):
            full = self._masked(u, slot, value) if slot.group is not None else value.clone()
            if slot.group is not None:
                dist.all_reduce(full, group=self.group)  # frozen parameters are the same everywhere: kept
            out.append(full)
        return out

    def unit_optimizer_state(self, u: int) -> dict[int, dict[str, Any]]:
        local = self.manager.unit_optimizer_state(u)
        lay = self.manager.layouts[u]
        scalars = {i: {k: v for k, v in e.items() if not (isinstance(v, Tensor) and v.shape == lay.params[i].shape)}
                   for i, e in local.items()}
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, scalars, group=self.group)
        merged: dict[int, dict[str, Any]] = {}
        for part in everyone:
            for i, entry in part.items():
                merged.setdefault(i, entry)
        out: dict[int, dict[str, Any]] = {}
        for i, slot in enumerate(lay.params):
            if i not in merged:
                continue  # no rank has stepped it yet
            entry = dict(merged[i])
            for name in self.manager.slots:
                value = local.get(i, {}).get(name)
                full = self._masked(u, slot, value) if value is not None else torch.zeros(slot.shape)
                dist.all_reduce(full, group=self.group)
                entry[name] = full
            out[i] = entry
        return out


def join_save(view: ShardedStateView, with_optimizer: bool) -> None:
    """A rank other than 0 during a checkpoint save: take part in every gather rank 0 does, in the
    order :func:`save_streamed` does them, and write nothing."""
    view.drain()
    for u in range(view.num_units):
        view.unit_master_weights(u)
        if with_optimizer:
            view.unit_optimizer_state(u)
