"""The dtype optimizer state is kept in between steps, and the conversions around each step.

The user's optimizer always computes in fp32 (the kernels are torch's own). With
``offload.optimizer_state_dtype=float32`` the unit's staged state buffer is handed to it as is. With
``bfloat16`` the state lives in half the bytes: a step widens its part's range of every slot into fp32
scratch, runs the optimizer on the scratch, and narrows the result back into the staged buffer with
stochastic rounding before the buffer is written to its tier.

Why stochastic rounding: Adam's second moment decays by ``beta2 = 0.999`` per step, a relative change
of 0.1%, under half a bf16 ulp (0.2%): rounded to nearest, a moment that should decay never does, and
the effective learning rate shrinks for the rest of the run. Rounding up with probability equal to the
dropped fraction makes every narrowing unbiased, so the moments follow their fp32 values on average.

The random bits come from a fixed table: element ``e`` of a unit's slot at the optimizer's step ``n``
reads entry ``(offset(unit, slot, n) + e) mod 2**20``. So the rounding of an element depends on nothing
but (unit, slot, element, step): a resumed run rounds exactly as the uninterrupted one did (the step
number is the optimizer's own, which checkpoints keep), and how a unit is cut into parts (``alpha``) or
into ranks' chunks (partitioned state) changes nothing. The cost is one pass over the state (no
generator in the step's path).

Threads: the table is built once under a lock; everything else runs on the thread running the step,
over tensors it owns for the duration of the step; the fp32 scratch is that thread's own (thread-local),
reused by its next step.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.layout import StateLayout
from lightning_greedysnake.optim.subclass_state import SubclassCodec, SubclassState, subclass_codec
from lightning_greedysnake.optim.unit_optimizer import FlatState, PieceState

STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``offload.optimizer_state_dtype`` (canonical names, see :mod:`lightning_greedysnake.config`) -> dtype."""

_TABLE_NUMEL = 1 << 20
_table: Tensor | None = None
_table_lock = threading.Lock()


def _noise_table() -> Tensor:
    """``_TABLE_NUMEL`` uniform values in ``[0, 2**16)`` (int32), the same in every process, twice over
    (so a slice of up to ``_TABLE_NUMEL`` entries from any start below it reads the table cyclically)."""
    global _table
    with _table_lock:
        if _table is None:
            gen = torch.Generator().manual_seed(0x5EED_B16)
            _table = torch.randint(0, 1 << 16, (_TABLE_NUMEL,), dtype=torch.int32, generator=gen).repeat(2)
        return _table


def mix(*values: int) -> int:
    """A 64-bit integer hash of ``values`` (splitmix64 steps): seeds the table offsets."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h


def stochastic_round_(src: Tensor, dst: Tensor, seed: int, start: int = 0) -> None:
    """``dst`` (bf16) = ``src`` (contiguous fp32) rounded stochastically: to the next bf16 value away from
    zero with probability equal to the fraction of an ulp that rounding to zero would drop. ``src`` is
    used as scratch (its low bits are overwritten). Deterministic in ``seed`` and each element's index
    ``start + i`` (so a range rounds as it would inside a longer one)."""
    assert src.dtype == torch.float32 and dst.dtype == torch.bfloat16 and src.is_contiguous()
    assert src.numel() == dst.numel()
    table = _noise_table()
    bits = src.view(torch.int32)
    n = bits.numel()
    offset = mix(seed) % _TABLE_NUMEL
    for s in range(0, n, _TABLE_NUMEL):
        e = min(n, s + _TABLE_NUMEL)
        at = (offset + start + s) % _TABLE_NUMEL  # (the table repeats once: a chunk reads it cyclically)
        # the sign is the top bit, so adding to the magnitude's bits rounds |x| up (carrying into the
        # exponent where the mantissa overflows): the same for both signs
        bits[s:e].add_(table[at : at + e - s])
    bits.bitwise_and_(-65536)  # keep sign, exponent and bf16's 7 mantissa bits: now exact in bf16
    dst.copy_(src)


def state_format_for(optimizer: torch.optim.Optimizer | None, slots: tuple[str, ...], dtype_name: str,
                     shard: tuple[int, int] | None = None, whole_parameters: bool = False) -> StateFormat:
    """The state format for ``optimizer`` (its per-element ``slots`` known) under
    ``offload.optimizer_state_dtype=dtype_name``: plain or narrowed tensors, or the optimizer's own
    quantized subclass (stepped element-wise only: ``whole_parameters`` state is plain, as the contract's
    probe found it). Raises a clear error for the combinations that cannot work."""
    codec = subclass_codec(optimizer, slots) if optimizer is not None and not whole_parameters else None
    if codec is not None:
        name = type(optimizer).__name__
        if dtype_name != "float32":
            raise ValueError(
                f"offload.optimizer_state_dtype={dtype_name!r} with {name}, which keeps its state quantized "
                f"already ({codec.subclass.__name__ if codec.subclass else 'a tensor subclass'}). Fix: leave "
                "offload.optimizer_state_dtype at float32 (the state is streamed in the optimizer's own format).")
        if shard is not None:
            raise ValueError(
                f"shard_state=True (partitioned optimizer state) with {name}, whose quantized state greedysnake "
                "streams only whole per rank. Fix: set shard_state=False, or use torch.optim.AdamW.")
    return StateFormat(STATE_DTYPES[dtype_name], codec)


class StateFormat:
    """How one unit's state views are given to its optimizer and taken back (the thread running a step)."""

    def __init__(self, dtype: torch.dtype, codec: SubclassCodec | None = None) -> None:
        """``codec``: the optimizer keeps its state as a tensor subclass (torchao's quantized state),
        streamed as is (``dtype`` is then float32: nothing is narrowed)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"optimizer state dtype {dtype} is not supported (float32 or bfloat16)")
        self.dtype = dtype
        self.codec = codec
        self._scratch = threading.local()
        """Per stepping thread: the fp32 scratch its last step widened into, kept for the next step (a
        fresh allocation of this size costs a page fault per 4 KiB, more than the conversion itself).
        Owned by that thread: a step's ``wide`` tensors are views into it until :meth:`narrow`."""

    @property
    def narrowed(self) -> bool:
        return self.dtype != torch.float32

    def open(self, held: Any, state: StateLayout, unit: int, slots: tuple[str, ...], lo: int,
             hi: int) -> PieceState:
        """The state of elements ``[lo, hi)`` of ``unit`` as :meth:`UnitOptimizer.step` takes it, over the
        staged state region ``held`` (None: no per-element state). Give it to :meth:`close` after."""
        if held is None:
            return FlatState({})
        if self.codec is not None:
            return SubclassState.over(self.codec, held, state, unit, slots)
        numel = state.units[unit].trained_numel
        views = {name: held.view(self.dtype, numel, offset_bytes=state.slot_offset_bytes(unit, k))
                 for k, name in enumerate(slots)}
        wide, base = self.widen(views, lo, hi)  # (bf16 state: fp32 scratch of the range)
        return _Widened(wide, base, views, lo, hi)

    def close(self, access: PieceState, seed: int) -> None:
        """After the step: narrow widened state back into its staged views (``seed``: the unit's and the
        step's), or nothing where the optimizer stepped the staged buffer itself."""
        if isinstance(access, _Widened):
            self.narrow(access.buffers, access.views, access.lo, access.hi, seed)
            access.buffers = {}

    def widen(self, views: dict[str, Tensor], lo: int, hi: int) -> tuple[dict[str, Tensor], int]:
        """fp32 tensors covering elements ``[lo, hi)`` of each slot, and the element they start at. fp32
        state: the views themselves (the optimizer updates the staged buffer in place); bf16: new fp32
        copies of the range (the caller owns them until :meth:`narrow`)."""
        if not self.narrowed:
            return views, 0
        n = hi - lo
        scratch = self._buffer(n * len(views))
        wide = {}
        for k, (name, view) in enumerate(views.items()):
            wide[name] = scratch[k * n : (k + 1) * n]
            wide[name].copy_(view[lo:hi])
        return wide, lo

    def _buffer(self, numel: int) -> Tensor:
        held = getattr(self._scratch, "buffer", None)
        if held is None or held.numel() < numel:
            self._scratch.buffer = None  # (the old one goes before the new one is allocated)
            self._scratch.buffer = held = torch.empty(numel, dtype=torch.float32)
        return held[:numel]

    def release_scratch(self) -> None:
        """Give back the calling thread's scratch (a lane thread's goes when the thread ends)."""
        self._scratch.buffer = None

    def narrow(self, wide: dict[str, Tensor], views: dict[str, Tensor], lo: int, hi: int, seed: int) -> None:
        """Write the stepped fp32 ``wide`` state (elements ``[lo, hi)``) back into ``views`` (a no-op for
        fp32 state, whose views were stepped in place). ``seed``: the unit's and the step's (not the
        range's). ``wide`` is consumed."""
        if not self.narrowed:
            return
        for k, (name, view) in enumerate(views.items()):
            stochastic_round_(wide[name], view[lo:hi], mix(seed, k), start=lo)


class _Widened(FlatState):
    """fp32 scratch of a range of narrowed state, with the staged views it is narrowed back into."""

    def __init__(self, buffers: dict[str, Tensor], base: int, views: dict[str, Tensor], lo: int, hi: int) -> None:
        super().__init__(buffers, base)
        self.views, self.lo, self.hi = views, lo, hi
