"""Modules whose forward updates their buffers (BatchNorm's running statistics, say).

Lightning runs each such forward once per micro-batch, in micro-batch order. The engine runs a unit's
forward a second time to recompute it for backward, and the vertical order runs half its units' micro-batches
in descending order. So: a recomputation puts the buffers back as the forward left them (the in-line and
horizontal orders then equal Lightning, buffers included), and the vertical order is refused, before any
step, where it would run such a unit's micro-batches out of Lightning's order.

Found by what a forward does, not by module type: each unit's first training forward compares its buffers
before and after. Training thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_greedysnake.models import LayerChain, Unit
from lightning_greedysnake.schedule import OpKind, Plan


@dataclass(frozen=True)
class WrittenBuffer:
    module: nn.Module
    name: str
    label: str
    """As messages name it: where in the chain, the module's type and the buffer (``block 1 (BatchNorm1d)
    running_mean``)."""


def _places(chain: LayerChain) -> dict[int, str]:
    """Each top-level module of the chain as messages name it: ``block 3``, ``pre module 0``, ``post module 1``."""
    places = {id(m): f"pre module {i}" for i, m in enumerate(chain.pre_modules)}
    places.update({id(m): f"post module {i}" for i, m in enumerate(chain.post_modules)})
    places.update({id(m): f"block {i}" for i, m in enumerate(chain.blocks)})
    return places


def _same(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a, b) or torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    return bool(torch.equal(a, b))


class BufferWriters:
    """Which units' forwards update buffers, and what to put back after a recomputation."""

    def __init__(self, chain: LayerChain, units: list[Unit]) -> None:
        self._units = units
        self._places = _places(chain)
        self._found: dict[int, list[WrittenBuffer]] = {}
        """Per unit whose first forward ran: the buffers it changed (empty: none)."""

    @contextlib.contextmanager
    def first_forward(self, unit: int, plan: Plan) -> Iterator[None]:
        """Run the body (a training forward of ``unit``); the first time, find the buffers it changes, and
        refuse ``plan`` if it runs such a unit out of micro-batch order (at the first window: nothing
        stepped)."""
        if unit in self._found:
            yield
            return
        before = [(b, b.module._buffers[b.name], b.module._buffers[b.name].detach().clone())
                  for b in self._buffers_of(unit)]
        yield
        self._found[unit] = [b for b, tensor, copy in before
                             if b.module._buffers[b.name] is not tensor or not _same(tensor, copy)]
        self.check_order(plan)

    @contextlib.contextmanager
    def recomputing(self, unit: int) -> Iterator[None]:
        """Run the body (a recomputation of ``unit``'s forward) with copies of the buffers its forward updates,
        then put the originals back: untouched, neither in value nor in version (autograd saved them for the
        forward's own backward where the graph was kept, and BatchNorm's backward reads them)."""
        written = self._found.get(unit, [])
        if not written:
            yield
            return
        originals = [b.module._buffers[b.name] for b in written]
        for b, tensor in zip(written, originals):
            b.module._buffers[b.name] = tensor.detach().clone()
        try:
            yield
        finally:
            for b, tensor in zip(written, originals):
                b.module._buffers[b.name] = tensor

    def check_order(self, plan: Plan) -> None:
        """Refuse ``plan`` if it runs the forwards of a unit that updates buffers out of micro-batch order."""
        for unit, written in self._found.items():
            if not written:
                continue
            order = [op.microbatch for op in plan.ops if op.kind is OpKind.FORWARD and op.unit == unit]
            if order != sorted(order):
                raise ValueError(_out_of_order(unit, written, order))

    def _buffers_of(self, unit: int) -> list[WrittenBuffer]:
        u = self._units[unit]
        found: list[WrittenBuffer] = []
        seen: set[int] = set()
        for module in u.modules:
            place = self._places.get(id(module), f"a module of unit {unit}")
            for path, sub in module.named_modules():
                if id(sub) in seen:
                    continue
                seen.add(id(sub))
                where = f"{place}{'.' + path if path else ''} ({type(sub).__name__})"
                for name, tensor in sub._buffers.items():
                    if tensor is not None:
                        found.append(WrittenBuffer(sub, name, f"{where} {name}"))
        return found


def _out_of_order(unit: int, written: list[WrittenBuffer], order: list[int]) -> str:
    names = ", ".join(b.label for b in written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
    in_order = ", ".join(map(str, order))
    return (
        f"schedule='vertical' runs unit {unit}'s micro-batches in the order {in_order}, and that unit's "
        f"forward updates buffers ({names}): its running statistics would be updated in another order than "
        "Lightning's, which runs micro-batches 0, 1, 2, ... (nothing was stepped yet). Fix: "
        "GreedySnakeStrategy(schedule='horizontal') (Lightning's order; a recomputation does not update the "
        "buffers again), or track_running_stats=False on the module (BatchNorm), or accumulate_grad_batches=1."
    )
