"""What autograd saves for a unit's backward: counted (:class:`SavedBytes`, what keeping a graph costs) and
packed (:class:`KeptGraph`, for ``recompute=False``): views of the unit's weights as references, and with saved
activations on SSD every other saved tensor as bytes in one blob per unit and micro-batch, which the store
writes and reads back.

Threads: the training thread only (the hooks run in its forward and backward); the blob's bytes are the
store's while it holds them (see :class:`KeptGraph`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import Tensor

from lightning_greedysnake.models import Unit


@dataclass(frozen=True)
class _WeightRef:
    """A saved tensor that views one of a unit's parameters, kept as (which parameter, how viewed)."""

    param: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _WeightViews:
    """Finds the saved tensors that view one of ``params``: by storage, so a lookup costs the same however
    many parameters the unit has (autograd saves dozens of tensors per block, every forward)."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self._by_storage: dict[tuple[int, torch.dtype], int] = {}
        for i, p in enumerate(params):
            d = p.data
            if d.layout is torch.strided and d.device.type != "meta":
                # (a unit's parameters share one flat buffer: the first one's offsets stand for all)
                self._by_storage.setdefault((d.untyped_storage().data_ptr(), d.dtype), i)

    def ref(self, t: Tensor) -> _WeightRef | None:
        """``t`` as a view of one of the parameters (None when it is not one)."""
        if t.layout is not torch.strided or t.device.type == "meta":
            return None
        ptr = t.untyped_storage().data_ptr()
        i = self._by_storage.get((ptr, t.dtype)) if ptr != 0 else None
        if i is None:
            return None
        d = self.params[i].data
        return _WeightRef(i, t.storage_offset() - d.storage_offset(), tuple(t.shape), tuple(t.stride()))


class SavedBytes:
    """Saved-tensor hooks that add up the bytes autograd keeps for a graph (the storages of every saved
    tensor that is not a view of one of ``params``): what ``recompute=False`` holds per micro-batch.
    The planner reads it."""

    def __init__(self, params: list[Tensor]) -> None:
        self._weights = _WeightViews(params)
        self.nbytes = 0
        self._seen: set[int] = set()

    def _pack(self, t: Tensor) -> Tensor:
        if t.layout is torch.strided and self._weights.ref(t) is None:
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._seen:
                self._seen.add(storage.data_ptr())
                self.nbytes += storage.nbytes()
        return t

    def hooks(self) -> ContextManager[Any]:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


@dataclass(frozen=True)
class _Part:
    """A saved tensor moved into its graph's blob: where its bytes lie there, and how it was viewed."""

    offset: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


BLOB_ALIGN = 64
"""Each saved tensor's bytes start on this boundary in its graph's blob (any dtype's itemsize divides it)."""


def _dense(t: Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive places of its storage from its offset (contiguous,
    or a permutation of that: a transpose), so its bytes move as one span and come back to the same view."""
    if (type(t) not in (Tensor, torch.nn.Parameter) or t.layout is not torch.strided or t.device.type == "meta"
            or t.numel() == 0 or t.is_conj() or t.is_neg()):
        return False  # (a subclass, a lazy conjugate or negation: kept as it is)
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class KeptGraph:
    """Saved-tensor hooks for a unit's forward whose graph is kept until its backward (``recompute=False``).

    Autograd saves views of the weights (``weight.t()`` for a matmul); those would pin the weights'
    buffer, which the tensor manager hands to the next unit once this one is released. Instead each
    such view is packed as a reference and rebuilt at backward from the parameter's current data,
    which by then holds the same values again (the unit is re-acquired before its backward, and its
    weights are not stepped before their backward is done).

    ``offload_on`` (saved activations on SSD: the compute device): every other saved tensor that lies densely in its storage
    (on the compute device) is kept only until the forward ends, when :meth:`seal` copies their bytes into one
    flat blob (each at a :data:`BLOB_ALIGN` boundary, a tensor saved twice once), which the engine hands
    to the store as the unit's saved activation for the micro-batch: written to SSD and read back, one op
    ahead, for the backward, where :meth:`unpack` views each tensor in the blob loaded (:attr:`blob`) with
    its own shape and strides: the same bytes in the same layout, so the backward computes exactly as on
    the graph held in memory. Ownership: the list of saved tensors is the forward's (training thread)
    until :meth:`seal`; the blob is the store's from ``save_activation`` to ``drop_activation``."""

    def __init__(self, unit: Unit, offload_on: torch.device | None) -> None:
        """``offload_on``: the compute device, whose saved tensors go into the blob (None: nothing offloaded)."""
        self._params = unit.parameters()
        self._weights = _WeightViews(self._params)
        self._device = offload_on
        self._saved: list[Tensor] = []
        """The tensors going into the blob, in the order of their parts (the forward's, until :meth:`seal`)."""
        self._index: dict[tuple[Any, ...], int] = {}
        self._parts: list[_Part] = []
        self.blob: Tensor | None = None
        """Offloaded: the bytes :meth:`seal` made, as loaded back for the backward (None meanwhile)."""

    def hooks(self) -> ContextManager[Any]:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    @property
    def has_blob(self) -> bool:
        """Whether :meth:`seal` made a blob (the backward loads it back first)."""
        return bool(self._parts)

    def pack(self, t: Tensor) -> Any:
        ref = self._weights.ref(t)
        if ref is not None:
            return ref
        # (kept as it is: not offloading; not dense; on another device, a host scalar beside a device graph)
        if self._device is None or t.device.type != self._device.type or not _dense(t):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        index = self._index.setdefault(key, len(self._saved))
        if index == len(self._saved):  # (a tensor saved twice goes in once)
            self._saved.append(t)
        return index

    def seal(self) -> Tensor | None:
        """The forward is done: its saved tensors' bytes as one blob (None where none was to move), the tensors
        themselves let go."""
        if not self._saved:
            return None
        offset = 0
        for t in self._saved:
            self._parts.append(_Part(offset, t.dtype, tuple(t.shape), tuple(t.stride())))
            offset += -(-t.numel() * t.element_size() // BLOB_ALIGN) * BLOB_ALIGN
        blob = torch.empty(offset, dtype=torch.uint8, device=self._device)
        for t, part in zip(self._saved, self._parts, strict=True):
            # its elements' span in storage order (``_dense``), byte for byte
            blob[part.offset:part.offset + t.numel() * t.element_size()].view(t.dtype).copy_(
                t.as_strided((t.numel(),), (1,), t.storage_offset()))
        self._saved, self._index = [], {}
        return blob

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, _WeightRef):
            d = self._params[packed.param].data
            return d.as_strided(packed.size, packed.stride, d.storage_offset() + packed.offset)
        if not isinstance(packed, int):
            return packed
        part, blob = self._parts[packed], self.blob
        assert blob is not None, "a kept graph's saved tensors were read before its blob was loaded"
        span = blob[part.offset:part.offset + math.prod(part.size) * part.dtype.itemsize].view(part.dtype)
        return span.as_strided(part.size, part.stride, span.storage_offset())
