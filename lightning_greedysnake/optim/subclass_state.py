"""Optimizer state kept as a tensor subclass (torchao's 8-bit and 4-bit AdamW), streamed per unit.

torchao's low-bit optimizers keep each moment as a tensor subclass holding quantized ``codes`` (one or
half a byte per element), a per-block fp32 ``scale`` and a constant code book (``qmap``), and step it
with ``copy_`` (quantize into ``codes``/``scale`` in place) and ``float()`` (dequantize). Both are
what any PT2 tensor subclass exposes through ``__tensor_flatten__`` / ``__tensor_unflatten__``, so
greedysnake streams such state without knowing torchao:

- At setup a probe steps the optimizer on two parameter sizes and flattens the state it created: the
  inner tensors whose size follows the parameter's are *components* (``codes``: 1 element per entry,
  or 2 when packed; ``scale``: one entry per block), the others are constants kept once in memory. A
  unit's state region holds, per slot, each component's entries for the whole unit, one after another.
- A piece's first step lets the optimizer create its state, which is copied into the staged region and
  whose context (``__tensor_flatten__``'s metadata) is remembered per piece size. Every later step
  builds the piece's subclass tensor over views into the staged region (``__tensor_unflatten__``), so
  the optimizer's own ``copy_`` quantizes straight into the buffer that is written back to the tier:
  nothing is widened. Only loading a checkpoint before any step of a size probes that size (a
  transient zero parameter of it).
- A piece the optimizer keeps in plain fp32 (torchao: parameters under 4096 elements, or not a whole
  number of blocks) keeps it in host memory beside the step counter, as the optimizer itself would; its
  region bytes stay unused.

Threads: the per-size contexts are learned and probed under a lock (the optimizer lane steps, the
training thread loads checkpoints); a :class:`SubclassState` is the stepping thread's, over buffers it
holds for the duration of the step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.layout import StateLayout
from lightning_greedysnake.optim.unit_optimizer import construct_like


class UnstreamableStateError(ValueError):
    pass


_FIX = (" Fix: use torch.optim.AdamW (offload.optimizer_state_dtype=bfloat16 halves its state bytes) or "
        "torchao's AdamW8bit/AdamW4bit.")


@dataclass(frozen=True)
class Component:
    """One inner tensor of the state subclass that scales with the parameter: ``per`` elements of the
    parameter per entry (codes: 1, or 2 when packed; scales: the block size), entries of ``dtype``."""

    name: str
    per: int
    dtype: torch.dtype

    def entries(self, numel: int) -> int:
        return -(-numel // self.per)


def _flatten(value: Tensor) -> tuple[dict[str, Tensor], Any]:
    names, ctx = value.__tensor_flatten__()  # type: ignore[attr-defined]
    return {n: getattr(value, n) for n in names}, ctx


def _probe(optimizer: torch.optim.Optimizer, hyper: dict[str, Any], numel: int) -> dict[str, Tensor]:
    p = torch.zeros(numel, dtype=torch.float32, requires_grad=True)
    shadow = construct_like(optimizer, [{**hyper, "params": [p]}])
    p.grad = torch.zeros_like(p)
    shadow.step()
    return dict(shadow.state[p])


class SubclassCodec:
    """What a tensor-subclass optimizer state looks like, found by probing the user's optimizer."""

    PROBE_SIZES = (1 << 16, 1 << 17)

    def __init__(self, optimizer: torch.optim.Optimizer, slots: tuple[str, ...],
                 small: dict[str, Tensor]) -> None:
        """``small``: the state a probe step at ``PROBE_SIZES[0]`` created (the caller's)."""
        self.cls = type(optimizer)
        self._optimizer = optimizer
        self.slots = slots
        self.hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        large = _probe(optimizer, self.hyper[0], self.PROBE_SIZES[1])
        self.subclass: type[Tensor] | None = None
        comps: list[Component] | None = None
        self.constants: dict[str, dict[str, Tensor]] = {}
        """Per slot: the inner tensors that do not scale with the parameter (the code book)."""
        for name in slots:
            a, b = small[name], large[name]
            if type(a) is Tensor:
                raise UnstreamableStateError(
                    f"{self.cls.__name__} keeps state {name!r} as a plain tensor at {self.PROBE_SIZES[0]} "
                    "elements but another as a subclass: greedysnake streams one layout per optimizer." + _FIX)
            if not hasattr(a, "__tensor_flatten__") or self.subclass not in (None, type(a)):
                raise UnstreamableStateError(
                    f"{self.cls.__name__} keeps state {name!r} as a {type(a).__name__} without "
                    "__tensor_flatten__: greedysnake cannot see its layout to stream it per unit." + _FIX)
            self.subclass = type(a)
            (ia, _), (ib, _) = _flatten(a), _flatten(b)
            found, consts = [], {}
            for inner, ta in ia.items():
                tb = ib[inner]
                if ta.numel() == tb.numel():
                    consts[inner] = ta.clone()
                    continue
                per = self.PROBE_SIZES[0] // max(ta.numel(), 1)
                if tb.numel() != 2 * ta.numel() or per * ta.numel() != self.PROBE_SIZES[0] or ta.dtype != tb.dtype:
                    raise UnstreamableStateError(
                        f"{self.cls.__name__}'s state {name!r} has an inner tensor {inner!r} of "
                        f"{ta.numel()} entries for {self.PROBE_SIZES[0]} elements: not a whole number of "
                        "elements per entry, so greedysnake cannot lay it out per unit." + _FIX)
                found.append(Component(inner, per, ta.dtype))
            if comps is not None and comps != found:
                raise UnstreamableStateError(
                    f"{self.cls.__name__}'s state slots differ in layout ({comps} vs {found}): greedysnake lays "
                    "every slot out alike." + _FIX)
            comps = found
            self.constants[name] = consts
        self.components: tuple[Component, ...] = tuple(comps or ())
        self._pieces: dict[tuple[int, int], dict[str, Any]] = {}
        """Per (group, numel): :meth:`piece_format`'s answer."""
        self._lock = threading.Lock()
        self.probes = 0
        """Probe steps since setup, beyond the two of it (each a transient parameter of a piece's size)."""

    @property
    def layout(self) -> tuple[tuple[int, int], ...]:
        """``(per, itemsize)`` per component: what :class:`StateLayout` sizes the regions by."""
        return tuple((c.per, c.dtype.itemsize) for c in self.components)

    @property
    def align_numel(self) -> int:
        """Elements a piece boundary must fall on so that every component's entries split there."""
        return max(c.per for c in self.components)

    def _context(self, name: str, value: Tensor, numel: int) -> Any:
        """``value``'s context for ``__tensor_unflatten__`` (None: a plain tensor), checked against the
        layout."""
        if type(value) is Tensor:
            return None
        inner, ctx = _flatten(value)
        for c in self.components:
            if inner[c.name].numel() != c.entries(numel):
                raise UnstreamableStateError(
                    f"{self.cls.__name__} gives a {numel}-element parameter {inner[c.name].numel()} "
                    f"{c.name!r} entries where {c.entries(numel)} were laid out (its layout is not linear in the "
                    "parameter's size)." + _FIX)
        return ctx

    def learn(self, group: int, numel: int, state: dict[str, Tensor]) -> None:
        """Remember how the optimizer keeps a ``numel``-element piece (its first step created ``state``)."""
        with self._lock:
            contexts = self._pieces.setdefault((group, numel), {})
            for name, value in state.items():
                if name not in contexts:
                    contexts[name] = self._context(name, value, numel)

    def piece_format(self, group: int, numel: int) -> dict[str, Any]:
        """How the optimizer keeps a ``numel``-element piece's state, per slot the subclass's context
        (``None``: plain fp32, kept in host memory): as its first step of that size created it (:meth:`learn`),
        or, before one (loading a checkpoint), as a probe step creates it (a transient zero parameter,
        gradient and state of that size, once per size and group)."""
        key = (group, numel)
        with self._lock:
            found = self._pieces.get(key)
            if found is None or any(name not in found for name in self.slots):
                self.probes += 1
                state = _probe(self._optimizer, self.hyper[group], numel)
                found = self._pieces[key] = {name: self._context(name, state[name], numel)
                                             for name in self.slots}
            return found


class SubclassState:
    """The state of one part of one unit as the optimizer sees it: per piece, a subclass tensor over
    views into the staged state region (or the piece's host fp32 tensor, which the caller holds)."""

    def __init__(self, codec: SubclassCodec, views: dict[str, list[Tensor]]) -> None:
        """``views``: per slot, each component's entries for the whole unit."""
        self.codec = codec
        self.views = views
        self.names = tuple(views)

    @classmethod
    def over(cls, codec: SubclassCodec, held: Any, state: StateLayout, unit: int,
             slots: tuple[str, ...]) -> SubclassState:
        """Views of unit ``unit``'s staged state region ``held`` (a :class:`StagedBuffer`)."""
        numel = state.units[unit].trained_numel
        return cls(codec, {
            name: [held.view(c.dtype, c.entries(numel), offset_bytes=state.component_offset_bytes(unit, k, ci))
                   for ci, c in enumerate(codec.components)]
            for k, name in enumerate(slots)})

    def _inner(self, name: str, lo: int, hi: int) -> dict[str, Tensor]:
        inner = dict(self.codec.constants[name])
        for c, view in zip(self.codec.components, self.views[name]):
            start = lo // c.per
            inner[c.name] = view[start : start + c.entries(hi - lo)]
        return inner

    def piece(self, name: str, lo: int, hi: int, group: int = 0) -> Tensor | None:
        """Elements ``[lo, hi)`` (a piece of a parameter of param group ``group``) of slot ``name`` as the
        optimizer keeps them; None where it keeps them in plain fp32 (host memory, not here)."""
        ctx = self.codec.piece_format(group, hi - lo)[name]
        if ctx is None:
            return None
        n = hi - lo
        return self.codec.subclass.__tensor_unflatten__(  # type: ignore[union-attr]
            self._inner(name, lo, hi), ctx, torch.Size([n]), (1,))

    def keep(self, name: str, lo: int, hi: int, value: Tensor, group: int = 0) -> bool:
        """Store a stepped piece's state here (False: a plain tensor, which the caller keeps)."""
        self.codec.learn(group, hi - lo, {name: value})
        if type(value) is Tensor:
            return False
        target = self._inner(name, lo, hi)
        for c in self.codec.components:
            src = getattr(value, c.name)
            if src.data_ptr() != target[c.name].data_ptr():  # created by the optimizer on its first step
                target[c.name].copy_(src)
        return True

    def read(self, name: str, lo: int, hi: int, group: int = 0) -> Tensor | None:
        """Elements ``[lo, hi)`` dequantized into a new fp32 tensor (checkpoints); None: kept in fp32."""
        piece = self.piece(name, lo, hi, group)
        return None if piece is None else torch.empty(hi - lo, dtype=torch.float32).copy_(piece)

    def raw(self, name: str, lo: int, hi: int, group: int = 0) -> dict[str, Tensor] | None:
        """Elements ``[lo, hi)``'s components as new tensors (None: kept in fp32): what checkpoints keep
        beside the dequantized values, so a resume continues bit for bit (quantizing dequantized values
        again may move a code)."""
        if self.piece(name, lo, hi, group) is None:
            return None
        inner = self._inner(name, lo, hi)
        return {c.name: inner[c.name].clone() for c in self.codec.components}

    def write_raw(self, name: str, lo: int, hi: int, raw: dict[str, Tensor], group: int = 0) -> bool:
        """Inverse of :meth:`raw` (False where this piece is kept in fp32, or ``raw`` does not fit it)."""
        if self.piece(name, lo, hi, group) is None:
            return False
        inner = self._inner(name, lo, hi)
        if any(raw[c.name].shape != inner[c.name].shape or raw[c.name].dtype != inner[c.name].dtype
               for c in self.codec.components):
            return False
        for c in self.codec.components:
            inner[c.name].copy_(raw[c.name])
        return True

    def write(self, name: str, lo: int, hi: int, value: Tensor, group: int = 0) -> bool:
        """Quantize fp32 ``value`` into elements ``[lo, hi)`` (loading a checkpoint); False where the
        optimizer keeps this piece in fp32 (the caller keeps it)."""
        piece = self.piece(name, lo, hi, group)
        if piece is None:
            return False
        piece.copy_(value.reshape(-1).to(torch.float32))
        return True


def subclass_codec(optimizer: torch.optim.Optimizer, slots: tuple[str, ...]) -> SubclassCodec | None:
    """The codec of ``optimizer``'s state where it keeps it as a tensor subclass (None: plain tensors)."""
    if not slots:
        return None
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    state = _probe(optimizer, hyper, SubclassCodec.PROBE_SIZES[0])
    if all(type(state[name]) is Tensor for name in slots):
        return None
    return SubclassCodec(optimizer, slots, small=state)
