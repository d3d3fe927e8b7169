"""The tensor manager: each unit's weights, master weights, optimizer state, waiting gradients and
activation checkpoints on the tier the placement names, moved through a budgeted pool of aligned
buffers, with prefetch of the next unit's weights and write-behind of everything written.

Who owns what, and the orderings it guarantees:

- Parameters of the layered model stay the user's ``nn.Parameter`` objects (the user's optimizer and
  LR schedulers keep pointing at them). Between uses their ``data`` is a one-element NaN placeholder
  expanded to the right shape (``numel`` and shapes still answer correctly; any accidental compute on
  it is visibly NaN); ``acquire_unit`` binds them to views of the unit's compute-weights buffer.
- Gradients never stay in ``param.grad``: a post-accumulate hook adds each micro-batch's gradient into
  the unit's flat fp32 accumulator and clears ``param.grad``. A unit's accumulator lives from its first
  gradient to its optimizer step; if the unit is released before its gradient is complete (the
  horizontal order) the accumulator waits on the ``gradients`` tier.
- The optimizer step of a unit runs when the engine reports its gradient complete (or, when gradients
  must be clipped by their global norm, after the whole backward): read master weights and state,
  step with the user's optimizer class (:class:`UnitOptimizer`), write them back (write-behind), and
  refresh the compute weights. Every SSD region serializes its operations (:class:`SSDRegions`), so a
  later read of a region sees the earlier write; a prefetch issued before a unit's step is dropped.
- Buffers return to the pool when the last operation using them completes (I/O completion callbacks).

Synchronous compute on the calling thread; only I/O runs on threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_greedysnake.config import OffloadConfig, TensorKind, Tier
from lightning_greedysnake.io import AlignedBuffer, IOConfig, ThreadedIOEngine, align_up
from lightning_greedysnake.models import Unit
from lightning_greedysnake.offload.layout import ParamSlot, UnitLayout, build_unit_layout
from lightning_greedysnake.offload.pool import BufferBudgetError, BufferPool
from lightning_greedysnake.offload.stats import IOStats
from lightning_greedysnake.offload.tiers import HostRegions, SSDRegions, SSDScratch
from lightning_greedysnake.optim import UnitOptimizer, discover_slots, split_numel
from lightning_greedysnake.optim.unit_optimizer import shard_bounds
from lightning_greedysnake.optim.stepper import StepLane

def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


TRIM_MIN_BYTES = 4 << 20


def trim_heap(freed_bytes: int = TRIM_MIN_BYTES) -> None:
    """Give freed heap pages back to the OS. Backward allocates and frees unit-sized gradient tensors
    every micro-batch; glibc's adaptive mmap threshold moves such sizes onto the heap, whose free pages
    it keeps, and host memory would creep up by several units' worth. About a millisecond per call, so
    only worth it when the unit's tensors are large (``freed_bytes``)."""
    if _MALLOC_TRIM is not None and freed_bytes >= TRIM_MIN_BYTES:
        _MALLOC_TRIM(0)


FILE_NAMES = {
    TensorKind.WEIGHTS: "weights.bin",
    TensorKind.MASTER_WEIGHTS: "master_weights.bin",
    TensorKind.OPTIMIZER_STATES: "optimizer_states.bin",
    TensorKind.GRADIENTS: "gradients.bin",
    TensorKind.CHECKPOINTS: "checkpoints.bin",
}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class ClipPolicy:
    """How gradients are clipped, known at setup from the Trainer."""

    value: float | None = None
    """Clip each element to [-value, value], unit by unit as each gradient completes."""
    defer: bool = False
    """Hold every unit's step until the whole backward is done (global-norm clipping needs all
    gradients first; a custom ``configure_gradient_clipping`` may need them too)."""


@dataclass
class _Held:
    """A staging buffer and whether it belongs to the pool (host-tier regions do not)."""

    buf: AlignedBuffer
    pooled: bool
    pending: list[Future[None]] = field(default_factory=list)
    """Writes from this buffer still in flight (it goes back to the pool after them)."""
    reads: list[Future[None]] = field(default_factory=list)
    """Reads into this buffer not yet waited for (``_stage(..., wait=False)``)."""
    optional: bool = False
    """Taken ahead of need from the budget's slack (a prefetch): counted in ``_optional_bytes`` until
    the work it was read for takes it over (:meth:`TieredTensorStore._take_over`) or drops it."""


@dataclass
class _SSDCheckpoint:
    offset: int
    nbytes: int
    shape: torch.Size
    dtype: torch.dtype
    write: Future[None]
    loaded: _Held | None = None
    """The checkpoint's bytes in memory; with ``loaded.reads`` in flight while read ahead."""


class TieredTensorStore:
    """The SSD/host tensor manager behind the :class:`TensorStore` protocol, plus the optimizer step."""

    owns_optimizer_step = True

    def __init__(
        self,
        units: list[Unit],
        param_names: dict[int, str],
        optimizer: torch.optim.Optimizer | None,
        config: OffloadConfig,
        compute_dtype: torch.dtype = torch.float32,
        clip: ClipPolicy | None = None,
        alpha: float = 0.0,
        lag: int = 0,
        shard: tuple[int, int] | None = None,
    ) -> None:
        """Lays the units out; touches no file (see :meth:`open`), so sizes are known for preflight.

        ``alpha``: the fraction of each unit's update deferred into the next iteration's forward;
        ``lag``: how many units the background optimizer may trail backward by (0: synchronous);
        ``shard``: ``(rank, world)`` of data parallel with partitioned state: this process steps only its
        chunk of every unit, and :attr:`weights_gatherer` brings the other chunks' new weights."""
        self.shard = shard
        self.alpha = alpha
        self.lag = lag
        self.config = config
        self.compute_dtype = compute_dtype
        self.clip = clip or ClipPolicy()
        self.stats = IOStats()
        self.offload_dir: Path | None = None
        self.optimizer = optimizer
        self._closed = False
        self.weight_loads: dict[int, int] = {u.index: 0 for u in units}
        """Times each unit's compute weights were acquired, since construction."""

        group_of: dict[int, int] = {}
        if optimizer is not None:
            for gi, group in enumerate(optimizer.param_groups):
                for p in group["params"]:
                    group_of[id(p)] = gi
        self.params: list[list[nn.Parameter]] = []
        self.layouts: list[UnitLayout] = []
        for unit in units:
            ps = unit.parameters()
            self.params.append(ps)
            entries = [
                (param_names.get(id(p), f"unit{unit.index}.{i}"), tuple(p.shape),
                 group_of.get(id(p)) if p.requires_grad else None)
                for i, p in enumerate(ps)
            ]
            self.layouts.append(build_unit_layout(unit.index, entries))
        self.num_units = len(units)
        self.slots: tuple[str, ...] = discover_slots(optimizer) if optimizer is not None else ()
        self.separate_master = compute_dtype != torch.float32
        trainable = [lay.trainable_numel > 0 for lay in self.layouts]

        # -- regions per kind ------------------------------------------------------------------------
        csize = _itemsize(compute_dtype)
        self._region_bytes = {
            TensorKind.WEIGHTS: [lay.nbytes(csize) for lay in self.layouts],
            TensorKind.MASTER_WEIGHTS: [
                lay.nbytes(4) if (self.separate_master and t) else 0 for lay, t in zip(self.layouts, trainable)
            ],
            TensorKind.OPTIMIZER_STATES: [
                lay.nbytes(4) * len(self.slots) if t else 0 for lay, t in zip(self.layouts, trainable)
            ],
            TensorKind.GRADIENTS: [lay.nbytes(4) if t else 0 for lay, t in zip(self.layouts, trainable)],
        }
        self.engine: ThreadedIOEngine | None = None
        self._regions: dict[TensorKind, HostRegions | SSDRegions] = {}
        self._scratch: SSDScratch | None = None
        self.files: list[Path] = []

        self.unit_optimizers = [
            UnitOptimizer(optimizer, lay, self.slots, split_numel(lay, self._alpha_of(u), self.bounds(u)),
                          self.bounds(u))
            if optimizer is not None else None
            for u, lay in enumerate(self.layouts)
        ]
        self._updated = [threading.Event() for _ in self.layouts]
        """Set when the unit's last optimizer step is complete: its weights may be read."""
        for event in self._updated:
            event.set()
        self.lane = StepLane(lag, on_busy=lambda a, b: self.stats.lanes.add("optimizer", a, b))
        self.grad_reducer: Callable[[Tensor], None] | None = None
        """Data parallel: averages a unit's complete fp32 gradient over the ranks, in place, before its
        step (called on the optimizer lane, in unit order on every rank)."""
        self.weights_gatherer: Callable[[Tensor, list[tuple[int, int]]], None] | None = None
        """Partitioned state: fills a unit's flat compute weights with every rank's chunk (given every
        rank's bounds), after this rank stepped its own (on the lane, in unit order on every rank)."""
        self._donated: set[int] = set()
        """Units whose acquired weights buffer a step job took over (it gives the buffer back)."""
        self._alpha_pending: list[tuple[int, list[dict[str, Any]], list[bool]]] = []
        """Forward parts to step after this window's backward: (unit, hyperparameters, has_grad)."""
        self._where: dict[int, tuple[int, int]] = {}
        for u, ps in enumerate(self.params):
            for i, p in enumerate(ps):
                self._where[id(p)] = (u, i)
        self._dtypes = [[p.dtype for p in ps] for ps in self.params]
        """The parameters' own dtypes, given back at :meth:`restore_parameters`."""
        self._placeholders = [
            [torch.full((1,), math.nan, dtype=compute_dtype).expand(p.shape) for p in ps] for ps in self.params
        ]
        self._weights: dict[int, _Held] = {}
        self._prefetched: dict[int, tuple[_Held, Future[None]]] = {}
        self._optional_bytes = 0
        """Bytes of staging held by prefetches: they never exceed the budget's slack over
        :attr:`min_budget_bytes`, so the work that must run can always get its buffers."""
        self._optional_lock = threading.Lock()
        self._staging_pending = 0
        """Bytes that submitted steps have yet to stage (their master and state buffers): with what is
        in use, the most the steps can still take before anything comes back (guarded by
        ``_optional_lock``)."""
        self._grad_scratch: Tensor | None = None
        """fp32 room for one parameter's 16-bit gradient on its way into the accumulator."""
        self._largest_param = max((slot.numel for lay in self.layouts for slot in lay.params), default=1)
        self._step_ahead: dict[int, tuple[_Held | None, _Held | None]] = {}
        """Master weights and optimizer state read ahead for a unit's coming step (its first part):
        (master, states), each None where not staged ahead."""
        self._grads: dict[int, _Held] = {}
        self._grad_spilled: set[int] = set()
        self._has_grad: dict[int, list[bool]] = {}
        self._grad_complete: list[int] = []
        """Units whose gradient is complete and whose step waits (deferred mode)."""
        self._norms: dict[int, list[Tensor | None]] = {}
        self._host_checkpoints: dict[tuple[int, int], Tensor] = {}
        self._ssd_checkpoints: dict[tuple[int, int], _SSDCheckpoint] = {}
        self._hooks: list[Any] = []
        self._clip_coef: Tensor | None = None
        self._value_clips: list[float] = []
        self.steps_taken = 0
        self.checkpoint_bytes = 0
        """The largest activation checkpoint seen (one unit input of one micro-batch), for planning."""
        self.checkpoint_prefetches = 0
        """SSD checkpoint reads started ahead of need, since construction."""
        self.steps_read_ahead = 0
        """Steps that found their master weights and state read ahead (:meth:`prefetch_step`)."""
        self.min_budget_bytes = self._min_budget()
        budget = config.buffer_budget_bytes
        if budget is None:
            # the working set of one unit, room to prefetch the next unit's weights, and a little slack
            # for checkpoints in flight
            prefetch = max(self._region_bytes[TensorKind.WEIGHTS]) if config.weights is Tier.SSD else 0
            budget = self.min_budget_bytes + prefetch + (16 << 20)
        elif budget < self.min_budget_bytes:
            raise BufferBudgetError(
                f"offload.buffer_budget_bytes={budget} is below the {self.min_budget_bytes} bytes one unit's "
                "weights, gradient, master weights and optimizer state need at once. Fix: raise it to at "
                f"least {self.min_budget_bytes}, lower layers_per_unit, or leave it None (automatic)."
            )
        self.pool = BufferPool(budget)
        self.pool.others_active = lambda: not self.lane.idle

    def open(self, offload_dir: Path | None) -> None:
        """Create the host regions and the preallocated offload files (after preflight)."""
        config = self.config
        self.offload_dir = offload_dir
        if config.uses_ssd:
            assert offload_dir is not None, "an SSD tier needs an offload directory"
            self.engine = ThreadedIOEngine(IOConfig(config.io_threads, config.io_chunk_bytes, config.direct_io))
        try:
            for kind, sizes in self._region_bytes.items():
                if sum(sizes) == 0:
                    continue
                if config.tier(kind) is Tier.SSD:
                    assert self.engine is not None and offload_dir is not None
                    path = offload_dir / FILE_NAMES[kind]
                    self.files.append(path)
                    self._regions[kind] = SSDRegions(kind.value, sizes, self.engine, path, self.stats,
                                                     sparse=self._sharded_kind(kind))
                else:
                    self._regions[kind] = HostRegions(kind.value, sizes)
            if config.checkpoints is Tier.SSD:
                assert self.engine is not None and offload_dir is not None
                path = offload_dir / FILE_NAMES[TensorKind.CHECKPOINTS]
                self.files.append(path)
                self._scratch = SSDScratch(TensorKind.CHECKPOINTS.value, self.engine, path, self.stats)
        except BaseException:
            self._close_regions()
            raise

    # -- sizes -------------------------------------------------------------------------------------
    def _min_budget(self) -> int:
        """Staging bytes needed at once. Synchronous: one unit's working set (weights, gradient, master,
        state on SSD). With a background optimizer (``lag`` > 0) the training thread holds one unit's
        weights and gradient, up to ``lag`` queued steps hold theirs, and the running step stages its
        master and state. A prefetch of the next unit only uses spare budget."""
        need = 0
        for u in range(self.num_units):
            per = {kind: (sizes[u] if self.config.tier(kind) is Tier.SSD else 0)
                   for kind, sizes in self._region_bytes.items()}
            working = sum(per.values())
            held = per[TensorKind.WEIGHTS] + per[TensorKind.GRADIENTS]
            # the training thread's unit and up to ``lag`` queued steps each hold weights and gradient;
            # the running step adds its master and state ranges
            need = max(need, working if self.lag == 0 else (self.lag + 1) * held + working - held)
        return max(need, 4096)

    def ssd_bytes(self) -> dict[str, int]:
        """Bytes each SSD-resident kind keeps in the offload directory (for preflight; partitioned state:
        this rank's chunks, the rest of those files is never written)."""
        out = {}
        for kind, sizes in self._region_bytes.items():
            if self.config.tier(kind) is Tier.SSD and sum(sizes):
                if self._sharded_kind(kind):
                    out[kind.value] = sum(sum(b - a for a, b in self._chunk_ranges(kind, u))
                                          for u in range(self.num_units))
                else:
                    out[kind.value] = sum(sizes)
        return out

    def _sharded_kind(self, kind: TensorKind) -> bool:
        """Kinds of which this rank keeps only its chunks (partitioned state)."""
        return self.shard is not None and kind in (TensorKind.MASTER_WEIGHTS, TensorKind.OPTIMIZER_STATES)

    def _chunk_ranges(self, kind: TensorKind, u: int) -> list[tuple[int, int]] | None:
        """Byte ranges of unit ``u``'s region that this rank writes (None: all of it)."""
        if not self._sharded_kind(kind):
            return None
        lo, hi = self.bounds(u)
        return self._byte_ranges(kind, u, lo, hi) if lo < hi else []

    # -- setup ----------------------------------------------------------------------------------------
    def initialize_from_parameters(self) -> None:
        """Copy the parameters' current values into their tiers, then detach the parameters' memory.

        Called once, after the model exists (and after a checkpoint's weights were loaded into it)."""
        for u in range(self.num_units):
            self.load_unit_weights(u, [p.data for p in self.params[u]])
            for i, p in enumerate(self.params[u]):
                p.data = self._placeholders[u][i]
        self.flush()
        self._register_hooks()

    def _register_hooks(self) -> None:
        for ps in self.params:
            for p in ps:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def initialize_unit_by_unit(self, init_unit: Callable[[int], None]) -> None:
        """For a model created on the meta device: give unit u's parameters real (uninitialized) memory,
        let ``init_unit(u)`` fill them in place, store them in their tiers and free the memory again,
        one unit at a time, so the whole model never exists in RAM at once."""
        for u in range(self.num_units):
            for p, dtype in zip(self.params[u], self._dtypes[u]):
                p.data = torch.empty(p.shape, dtype=dtype)
            init_unit(u)
            self.load_unit_weights(u, [p.data for p in self.params[u]])
            for i, p in enumerate(self.params[u]):
                p.data = self._placeholders[u][i]
            trim_heap(self.layouts[u].numel * 4)
        self.flush()
        self._register_hooks()

    def load_unit_weights(self, u: int, values: list[Tensor]) -> None:
        """Set unit ``u``'s weights (and master weights) from full-precision tensors in layout order."""
        self._drop_step_ahead(u)  # read before these new values
        lay = self.layouts[u]
        weights = self._stage(TensorKind.WEIGHTS, u, read=False)
        flat = weights.buf.view(self.compute_dtype, lay.numel)
        for slot, value in zip(lay.params, values):
            _view(flat, slot).copy_(value.detach())
        self._put_back(TensorKind.WEIGHTS, u, weights)
        if self.separate_master and self._region_bytes[TensorKind.MASTER_WEIGHTS][u]:
            master = self._stage(TensorKind.MASTER_WEIGHTS, u, read=False)
            mflat = master.buf.view(torch.float32, lay.numel)
            for slot, value in zip(lay.params, values):
                if slot.group is not None:
                    _view(mflat, slot).copy_(value.detach())
            self._put_back(TensorKind.MASTER_WEIGHTS, u, master,
                           self._chunk_ranges(TensorKind.MASTER_WEIGHTS, u))

    def unit_master_weights(self, u: int) -> list[Tensor]:
        """Unit ``u``'s full-precision weights as new tensors in layout order (for state dicts)."""
        self.drain()
        lay = self.layouts[u]
        out: list[Tensor] = []
        weights = self._stage(TensorKind.WEIGHTS, u, read=True)
        try:
            flat = weights.buf.view(self.compute_dtype, lay.numel)
            out = [_view(flat, slot).to(torch.float32 if self.separate_master else self.compute_dtype, copy=True)
                   for slot in lay.params]
        finally:
            self._done_with(weights)
        if self.separate_master and self._region_bytes[TensorKind.MASTER_WEIGHTS][u]:
            master = self._stage(TensorKind.MASTER_WEIGHTS, u, read=True)
            try:
                mflat = master.buf.view(torch.float32, lay.numel)
                for k, slot in enumerate(lay.params):
                    if slot.group is not None:
                        out[k] = _view(mflat, slot).clone()
            finally:
                self._done_with(master)
        return out

    def reconfigure(self, alpha: float, lag: int, buffer_budget_bytes: int) -> None:
        """Change alpha, lag and the staging budget between steps (the planner's choice): drains every
        pending step, re-splits each unit's optimizer keeping its state, resizes the lane and the pool."""
        self.drain()
        for u in list(self._step_ahead):
            self._drop_step_ahead(u)  # read for the old split
        assert self.optimizer is not None
        self.alpha, self.lag = alpha, lag
        for u, old in enumerate(self.unit_optimizers):
            if old is None:
                continue
            new = UnitOptimizer(self.optimizer, self.layouts[u], self.slots,
                                split_numel(self.layouts[u], self._alpha_of(u), self.bounds(u)), self.bounds(u))
            for j in range(len(old.trainable)):
                if old.param_initialized(j):
                    new.set_param_scalar_state(j, old.param_scalar_state(j))
            self.unit_optimizers[u] = new
        self.lane.close()
        self.lane = StepLane(lag, on_busy=lambda a, b: self.stats.lanes.add("optimizer", a, b))
        self.min_budget_bytes = self._min_budget()
        self.pool.budget_bytes = max(buffer_budget_bytes, self.min_budget_bytes)

    def restore_parameters(self, master: Callable[[int], list[Tensor]] | None = None) -> None:
        """Give the parameters real memory again, holding the trained weights (end of a run).
        ``master``: where unit u's full-precision weights come from (partitioned state: gathered)."""
        for u in range(self.num_units):
            values = (master or self.unit_master_weights)(u)
            for p, value, dtype in zip(self.params[u], values, self._dtypes[u]):
                p.data = value.to(dtype) if value.dtype != dtype else value

    def bounds(self, u: int, rank: int | None = None) -> tuple[int, int]:
        """The element range of unit ``u`` that ``rank`` (default: this process) steps."""
        if self.shard is None:
            return 0, self.layouts[u].numel
        return shard_bounds(self.layouts[u], self.shard[0] if rank is None else rank, self.shard[1])

    def _alpha_of(self, unit: int) -> float:
        """The deferred fraction of ``unit``'s update. Never of unit 0's: its step ends the window and the
        next forward starts with it, so a deferred part would run right away anyway, only adding its
        gradient's trip to the SSD and back."""
        return 0.0 if unit == 0 else self.alpha

    def _defers(self, unit: int) -> bool:
        """Whether ``unit`` has a deferred (alpha) part on any rank: every rank must make the same
        decision, since the weights gather follows the unit's last part."""
        ranks = range(self.shard[1]) if self.shard is not None else [None]
        for r in ranks:
            lo, hi = self.bounds(unit, r)
            if split_numel(self.layouts[unit], self._alpha_of(unit), (lo, hi)) < hi:
                return True
        return False

    def _gather_weights(self, unit: int) -> None:
        """Partitioned state: after this rank's chunk of ``unit`` is stepped, bring every other chunk's new
        compute weights into the weights tier (all ranks call this in the same unit order)."""
        if self.shard is None:
            return
        assert self.weights_gatherer is not None, "partitioned state needs a weights gatherer"
        held = self._stage(TensorKind.WEIGHTS, unit, read=True)
        flat = held.buf.view(self.compute_dtype, self.layouts[unit].numel)
        self.weights_gatherer(flat, [self.bounds(unit, r) for r in range(self.shard[1])])
        self._put_back(TensorKind.WEIGHTS, unit, held)

    # -- optimizer state (checkpoints) ---------------------------------------------------------------
    def _trainable_index(self, u: int) -> dict[int, int]:
        """Layout index of each trainable parameter -> its index among the unit's trainable ones."""
        index = {}
        for i, slot in enumerate(self.layouts[u].params):
            if slot.group is not None:
                index[i] = len(index)
        return index

    def _slot_view(self, states: _Held, u: int, k: int, slot: ParamSlot) -> Tensor:
        lay = self.layouts[u]
        flat = states.buf.view(torch.float32, lay.numel, offset_bytes=k * lay.nbytes(4))
        return _view(flat, slot)

    def unit_optimizer_state(self, u: int) -> dict[int, dict[str, Any]]:
        """Unit ``u``'s optimizer state as new tensors, keyed by the parameter's index in the unit's
        layout (parameters the optimizer has not stepped yet are absent). Drains pending steps first."""
        assert self.optimizer is not None
        self.drain()
        self._drop_step_ahead(u)  # read before this new state
        opt = self.unit_optimizers[u]
        if opt is None or not opt.has_trainable:
            return {}
        tindex = self._trainable_index(u)
        if not any(opt.param_initialized(j) for j in tindex.values()):
            return {}
        states = self._stage(TensorKind.OPTIMIZER_STATES, u, read=True) if self.slots else None
        try:
            entries: dict[int, dict[str, Any]] = {}
            for i, j in tindex.items():
                if not opt.param_initialized(j):
                    continue
                entry = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in opt.param_scalar_state(j).items()}
                if states is not None:
                    for k, name in enumerate(self.slots):
                        entry[name] = self._slot_view(states, u, k, self.layouts[u].params[i]).clone()
                entries[i] = entry
            return entries
        finally:
            if states is not None:
                self._done_with(states)

    def load_unit_optimizer_state(self, u: int, entries: dict[int, dict[str, Any]]) -> None:
        """Inverse of :meth:`unit_optimizer_state` (entries keyed by layout index)."""
        assert self.optimizer is not None
        self.drain()
        self._drop_step_ahead(u)  # read before this new state
        opt = self.unit_optimizers[u]
        assert opt is not None
        lay = self.layouts[u]
        tindex = self._trainable_index(u)
        states = self._stage(TensorKind.OPTIMIZER_STATES, u, read=True) if self.slots else None
        for i, entry in entries.items():
            if i not in tindex:
                raise ValueError(f"optimizer state for {lay.params[i].name} (unit {u}), which the optimizer "
                                 "does not train")
            scalars = {}
            for name, value in entry.items():
                if name in self.slots and isinstance(value, Tensor) and value.shape == lay.params[i].shape:
                    assert states is not None
                    self._slot_view(states, u, self.slots.index(name), lay.params[i]).copy_(value)
                else:
                    scalars[name] = value
            opt.set_param_scalar_state(tindex[i], scalars)
        if states is not None:
            self._put_back(TensorKind.OPTIMIZER_STATES, u, states,
                           self._chunk_ranges(TensorKind.OPTIMIZER_STATES, u))

    def optimizer_state(self) -> dict[int, dict[str, Any]]:
        """The optimizer's per-parameter state in ``torch.optim`` form, keyed by the parameter's index
        in the user's optimizer (the ``state`` entry of ``optimizer.state_dict()``). Drains pending
        steps first. Holds the whole state in memory: checkpoints stream it unit by unit instead."""
        assert self.optimizer is not None
        order = [p for g in self.optimizer.param_groups for p in g["params"]]
        per_unit = {u: self.unit_optimizer_state(u) for u in range(self.num_units)}
        out: dict[int, dict[str, Any]] = {}
        for idx, p in enumerate(order):
            where = self._where.get(id(p))
            if where is not None and where[1] in per_unit.get(where[0], {}):
                out[idx] = per_unit[where[0]][where[1]]
        return out

    def load_optimizer_state(self, state: dict[int, dict[str, Any]]) -> None:
        """Inverse of :meth:`optimizer_state`: scatter a ``torch.optim`` state into the units."""
        assert self.optimizer is not None
        self.drain()
        order = [p for g in self.optimizer.param_groups for p in g["params"]]
        by_unit: dict[int, dict[int, dict[str, Any]]] = {}
        for idx, entry in state.items():
            p = order[int(idx)]
            where = self._where.get(id(p))
            if where is None:
                raise ValueError(f"optimizer state for parameter {idx}, which is outside the layered model")
            by_unit.setdefault(where[0], {})[where[1]] = entry
        for u, entries in by_unit.items():
            self.load_unit_optimizer_state(u, entries)
        self.flush()

    # -- staging ----------------------------------------------------------------------------------------
    def _stage(
        self,
        kind: TensorKind,
        u: int,
        *,
        read: bool,
        label: str | None = None,
        ranges: list[tuple[int, int]] | None = None,
        wait: bool = True,
    ) -> _Held:
        """A buffer holding unit ``u``'s region of ``kind``: the region itself on the host tier; a pool
        buffer on the SSD tier, filled from the SSD when ``read`` (only ``ranges``, byte ranges of the
        region, if given; counted under ``label`` if given). ``wait=False``: return with the reads in
        flight; :meth:`_await` them (so several regions load at once)."""
        regions = self._regions[kind]
        host = regions.host_buffer(u)
        if host is not None:
            return _Held(host, pooled=False)
        assert isinstance(regions, SSDRegions)
        buf = self.pool.acquire(regions.region_bytes(u), what=f"unit {u} {kind.value}")
        assert buf is not None
        held = _Held(buf, pooled=True)
        if read:
            try:
                held.reads = [regions.submit_read(u, buf, label, r) for r in (ranges or [None])]  # type: ignore[list-item]
            except BaseException:
                self.pool.release(buf)
                raise
            if wait:
                self._await(held, label=label or kind.value)
        return held

    def _await(self, *helds: _Held | None, label: str = "optimizer") -> None:
        """Wait for the reads of ``helds``; on a failure give every staged buffer back and raise."""
        t0 = time.perf_counter()
        try:
            for held in helds:
                if held is not None:
                    for f in held.reads:
                        f.result()
                    held.reads = []
        except BaseException:
            for held in helds:
                if held is not None and held.pooled:
                    for f in held.reads:
                        f.exception()  # let the other reads finish before the buffer is reused
                    held.reads = []
                    self.pool.release(held.buf)
            raise
        if threading.current_thread() is threading.main_thread():
            self.stats.record_wait(label, "ssd", time.perf_counter() - t0)

    def _put_back(
        self, kind: TensorKind, u: int, held: _Held, ranges: list[tuple[int, int]] | None = None, *,
        release: bool = True, label: str | None = None,
    ) -> None:
        """Write ``held`` (or its byte ``ranges``) to unit ``u``'s region of ``kind`` (write-behind) and,
        with ``release``, give the buffer back once written. Host-tier regions were modified in place."""
        if not held.pooled:
            return
        regions = self._regions[kind]
        assert isinstance(regions, SSDRegions)
        for r in ranges if ranges is not None else [None]:  # type: ignore[list-item]
            held.pending.append(regions.submit_write(u, held.buf, label, r))
        if release:
            self._release_when_done(held)

    def _byte_ranges(self, kind: TensorKind, u: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """Byte ranges of elements ``[lo, hi)`` of unit ``u`` in ``kind``'s region (one per state slot)."""
        lay = self.layouts[u]
        if kind is TensorKind.OPTIMIZER_STATES:
            region, isz, copies = lay.nbytes(4), 4, len(self.slots)
        else:
            isz = _itemsize(self.compute_dtype) if kind is TensorKind.WEIGHTS else 4
            region, copies = lay.nbytes(isz), 1
        end = region if hi >= lay.numel else hi * isz
        return [(k * region + lo * isz, k * region + end) for k in range(copies)]

    def _done_with(self, held: _Held) -> None:
        if held.pooled:
            self._release_when_done(held)

    def _release_when_done(self, held: _Held) -> None:
        pending = [f for f in held.pending if not f.done()]
        if not pending:
            self.pool.release(held.buf)
            return
        remaining = [len(pending)]
        gate = threading.Lock()
        self.pool.will_return()

        def one_done(_: Future[None]) -> None:
            with gate:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                self.pool.release(held.buf, returning=True)

        for f in pending:
            f.add_done_callback(one_done)

    # -- the TensorStore protocol: weights --------------------------------------------------------------
    def acquire_unit(self, unit: int) -> None:
        assert unit not in self._weights, f"unit {unit} acquired twice"
        # the unit's last optimizer step (perhaps running in the background, perhaps its deferred alpha
        # part) must be complete: no forward ever reads a stale or half-updated weight
        self.lane.wait_for(self._updated[unit])
        self.weight_loads[unit] += 1
        pre = self._prefetched.pop(unit, None)
        if pre is not None:
            held, fut = pre
            self._take_over(held)
            t0 = time.perf_counter()
            fut.result()
            self.stats.record_wait(TensorKind.WEIGHTS.value, "ssd", time.perf_counter() - t0)
        else:
            held = self._stage(TensorKind.WEIGHTS, unit, read=True)
        self._weights[unit] = held
        flat = held.buf.view(self.compute_dtype, self.layouts[unit].numel)
        for p, slot in zip(self.params[unit], self.layouts[unit].params):
            p.data = _view(flat, slot)

    def release_unit(self, unit: int) -> None:
        held = self._weights.pop(unit)
        for p, ph in zip(self.params[unit], self._placeholders[unit]):
            p.data = ph
        if unit in self._donated:
            self._donated.discard(unit)  # the step job owns the buffer now and gives it back
        else:
            self._done_with(held)
        if unit in self._grads:
            # an incomplete gradient (the horizontal order) or one waiting for the global norm goes to
            # its tier: host memory never holds more than the units in use
            self._spill_grad(unit)

    def prefetch(self, unit: int) -> None:
        """Start reading ``unit``'s weights now if they live on SSD and spare budget allows."""
        regions = self._regions[TensorKind.WEIGHTS]
        if not isinstance(regions, SSDRegions) or unit in self._weights or unit in self._prefetched:
            return
        if not self._updated[unit].is_set():
            return  # its step is still running: the weights on SSD are about to change
        held = self._acquire_optional(regions.region_bytes(unit), f"unit {unit} weights prefetch")
        if held is None:
            return
        self._prefetched[unit] = (held, regions.submit_read(unit, held.buf))

    def _acquire_optional(self, nbytes: int, what: str, within_slack: bool = True) -> _Held | None:
        """A buffer for work ahead of need, or ``None``. The work that must run (a unit in use, its
        gradient, the running steps' staging) never needs more than :attr:`min_budget_bytes` at once, so
        prefetches may hold up to the rest of the budget between them: then a must-run acquisition only
        ever waits for write-behind, never for a prefetch to be used. ``within_slack=False``: the
        caller has made sure otherwise (:meth:`prefetch_step`); it still counts against the slack, so
        other prefetches wait until it is taken over."""
        size = align_up(nbytes)
        with self._optional_lock:
            if within_slack and not self._slack_allows(size):
                return None
            buf = self.pool.acquire(size, block=False, what=what)
            if buf is None:
                return None
            self._optional_bytes += buf.nbytes
        return _Held(buf, pooled=True, optional=True)

    def _slack_allows(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more of prefetch fit in the budget's slack over the minimum (call with
        ``_optional_lock`` held)."""
        return self.min_budget_bytes + self._optional_bytes + nbytes <= self.pool.budget_bytes

    def _keep_as_prefetch(self, unit: int, held: _Held) -> bool:
        """After ``unit``'s complete step: keep its updated compute weights in memory as the prefetch of
        its next acquisition, if the slack allows. Worth it for unit 0 only: the last unit of every
        backward is the first of the next forward, which would otherwise wait for the write of these
        very bytes and read them back."""
        if not held.pooled:
            return False  # host-tier weights: nothing to read back anyway
        size = held.buf.nbytes
        with self._optional_lock:
            if unit in self._prefetched or not self._slack_allows(size):
                return False
            self._optional_bytes += size
        held.optional = True
        held.pending = [f for f in held.pending if not f.done()]  # the same buffer comes back every window
        done: Future[None] = Future()
        done.set_result(None)
        self._prefetched[unit] = (held, done)
        return True

    def _take_over(self, held: _Held) -> None:
        """The work a prefetch was read for now owns its buffer (or it is given back): it stops counting
        against the slack."""
        if held.optional:
            with self._optional_lock:
                self._optional_bytes -= held.buf.nbytes
            held.optional = False

    def prefetch_step(self, unit: int) -> None:
        """Read ``unit``'s master weights and optimizer state for its coming step (the first part's
        range) into spare budget, so the step the next forward waits for starts computing at once."""
        opt = self.unit_optimizers[unit] if 0 <= unit < self.num_units else None
        if opt is None or unit in self._step_ahead or self.clip.defer or not self._updated[unit].is_set():
            return
        lo, hi = opt.part_range(0)
        if lo >= hi or opt.parts[0].shadow is None:
            return
        wanted: list[tuple[TensorKind, list[tuple[int, int]]]] = []
        if self.separate_master:
            wanted.append((TensorKind.MASTER_WEIGHTS, self._byte_ranges(TensorKind.MASTER_WEIGHTS, unit, lo, hi)))
        if self.slots and opt.part_initialized(0):
            wanted.append((TensorKind.OPTIMIZER_STATES,
                           self._byte_ranges(TensorKind.OPTIMIZER_STATES, unit, lo, hi)))
        wanted = [(kind, ranges) for kind, ranges in wanted if isinstance(self._regions[kind], SSDRegions)]
        if not wanted:
            return
        # all or nothing: half a read-ahead would still leave the step waiting for reads
        total = sum(align_up(self._regions[kind].region_bytes(unit)) for kind, _ in wanted)
        with self._optional_lock:
            budget = self.pool.budget_bytes
            from_slack = self._slack_allows(total)
            # Or from what the minimum reserves but this moment cannot use: this is the window's last
            # step, every other step is submitted, so until it runs the work can only still take the
            # staging those steps have not taken yet and this unit's weights and gradient. If that
            # fits beside everything held now and the read-ahead, nobody ever waits for it. (Not with
            # partitioned state, whose weights gather stages more.)
            ahead_of_need = self.shard is None and (
                self.pool.in_use_bytes + total + self._staging_pending + self._unit_need_bytes(unit) <= budget
            )
            if not (from_slack or ahead_of_need):
                return
        staged: dict[TensorKind, _Held] = {}
        for kind, ranges in wanted:
            regions = self._regions[kind]
            assert isinstance(regions, SSDRegions)
            held = self._acquire_optional(regions.region_bytes(unit), f"unit {unit} {kind.value} read-ahead",
                                          within_slack=False)
            if held is None:
                for other in staged.values():
                    self._take_over(other)
                    self._done_with(other)
                return
            held.reads = [regions.submit_read(unit, held.buf, kind.value, r) for r in ranges]
            staged[kind] = held
        self._step_ahead[unit] = (staged.get(TensorKind.MASTER_WEIGHTS), staged.get(TensorKind.OPTIMIZER_STATES))

    def _step_staging_bytes(self, unit: int, weights_held: bool) -> int:
        """Pool bytes a step of ``unit`` stages (its first part's buffers are whole regions), as
        :meth:`_step_part` does: master weights (or the weights region as master under 32-true, when
        not held), optimizer state, and under bf16-mixed the compute weights when not held."""
        def ssd(kind: TensorKind) -> int:
            regions = self._regions.get(kind)
            return align_up(regions.region_bytes(unit)) if isinstance(regions, SSDRegions) else 0

        need = ssd(TensorKind.OPTIMIZER_STATES) if self.slots else 0
        if self.separate_master:
            need += ssd(TensorKind.MASTER_WEIGHTS) + (0 if weights_held else ssd(TensorKind.WEIGHTS))
        elif not weights_held:
            need += ssd(TensorKind.WEIGHTS)
        return need

    def _unit_need_bytes(self, unit: int) -> int:
        """Pool bytes the training thread may still take for ``unit``'s backward: its weights if neither
        held nor prefetched, its gradient accumulator if not started."""
        need = 0
        weights = self._regions.get(TensorKind.WEIGHTS)
        if isinstance(weights, SSDRegions) and unit not in self._weights and unit not in self._prefetched:
            need += align_up(weights.region_bytes(unit))
        grads = self._regions.get(TensorKind.GRADIENTS)
        if isinstance(grads, SSDRegions) and unit not in self._grads:
            need += align_up(grads.region_bytes(unit))
        return need

    def _drop_step_ahead(self, unit: int) -> None:
        for held in self._step_ahead.pop(unit, (None, None)):
            if held is not None:
                self._take_over(held)
                held.pending.extend(held.reads)
                held.reads = []
                self._release_when_done(held)

    def _drop_prefetch(self, unit: int) -> None:
        pre = self._prefetched.pop(unit, None)
        if pre is not None:
            held, fut = pre
            self._take_over(held)
            held.pending.append(fut)
            self._release_when_done(held)

    # -- checkpoints ------------------------------------------------------------------------------------
    def save_checkpoint(self, unit: int, microbatch: int, hidden: Tensor) -> None:
        key = (unit, microbatch)
        self.checkpoint_bytes = max(self.checkpoint_bytes, hidden.numel() * hidden.element_size())
        assert key not in self._host_checkpoints and key not in self._ssd_checkpoints, f"checkpoint {key} twice"
        if self._scratch is None:
            self._host_checkpoints[key] = hidden
            return
        nbytes = hidden.numel() * hidden.element_size()
        buf = self.pool.acquire(nbytes, what=f"checkpoint of unit {unit}")
        assert buf is not None
        buf.view(hidden.dtype, hidden.numel()).copy_(hidden.reshape(-1))
        offset = self._scratch.allocate(nbytes)
        fut = self._scratch.submit("write", offset, buf, nbytes)
        held = _Held(buf, pooled=True, pending=[fut])
        self._release_when_done(held)
        self._ssd_checkpoints[key] = _SSDCheckpoint(offset, nbytes, hidden.shape, hidden.dtype, fut)

    def load_checkpoint(self, unit: int, microbatch: int) -> Tensor:
        key = (unit, microbatch)
        if self._scratch is None:
            return self._host_checkpoints[key]
        ck = self._ssd_checkpoints[key]
        if ck.loaded is None:
            ck.write.result()  # the read must see the completed write
            buf = self.pool.acquire(ck.nbytes, what=f"checkpoint of unit {unit}")
            assert buf is not None
            ck.loaded = _Held(buf, pooled=True, reads=[self._scratch.submit("read", ck.offset, buf, ck.nbytes)])
        self._take_over(ck.loaded)
        if ck.loaded.reads:
            held = ck.loaded
            try:
                self._await(held, label=TensorKind.CHECKPOINTS.value)
            except BaseException:
                ck.loaded = None  # _await gave the buffer back
                raise
        numel = ck.shape.numel()
        return ck.loaded.buf.view(ck.dtype, numel).view(ck.shape)

    def prefetch_checkpoint(self, unit: int, microbatch: int) -> None:
        """Start reading an SSD-resident checkpoint the engine will need next (from spare budget, and
        only once its write is complete: a read never races the write)."""
        ck = self._ssd_checkpoints.get((unit, microbatch))
        if ck is None or ck.loaded is not None or not ck.write.done() or self._scratch is None:
            return
        held = self._acquire_optional(ck.nbytes, f"checkpoint of unit {unit} read-ahead")
        if held is None:
            return
        held.reads = [self._scratch.submit("read", ck.offset, held.buf, ck.nbytes)]
        ck.loaded = held
        self.checkpoint_prefetches += 1

    def drop_checkpoint(self, unit: int, microbatch: int) -> None:
        key = (unit, microbatch)
        self._host_checkpoints.pop(key, None)
        ck = self._ssd_checkpoints.pop(key, None)
        if ck is not None and ck.loaded is not None:
            held = ck.loaded  # a read-ahead may still be filling it: give it back once that is done
            self._take_over(held)
            held.pending.extend(held.reads)
            held.reads = []
            self._release_when_done(held)

    @property
    def num_checkpoints(self) -> int:
        return len(self._host_checkpoints) + len(self._ssd_checkpoints)

    # -- gradients ----------------------------------------------------------------------------------------
    def _grad_flat(self, u: int) -> Tensor:
        held = self._grads.get(u)
        if held is None:
            if u in self._grad_spilled:
                self._grad_spilled.discard(u)
                held = self._stage(TensorKind.GRADIENTS, u, read=True)
            else:
                held = self._stage(TensorKind.GRADIENTS, u, read=False)
                held.buf.view(torch.float32, self.layouts[u].numel).zero_()
                self._has_grad[u] = [False] * len(self.layouts[u].params)
            self._grads[u] = held
        return held.buf.view(torch.float32, self.layouts[u].numel)

    def _on_grad(self, p: Tensor) -> None:
        """Post-accumulate hook: move this micro-batch's gradient into the unit's fp32 accumulator."""
        u, i = self._where[id(p)]
        grad = p.grad
        if grad is None:
            return
        if self.layouts[u].params[i].group is None:
            p.grad = None  # trainable but not in the optimizer: Lightning would never step it either
            return
        flat = self._grad_flat(u)
        view = _view(flat, self.layouts[u].params[i])
        if not self._has_grad[u][i]:
            view.copy_(grad)  # the accumulator is still zero: the first micro-batch's gradient is the sum
        elif grad.dtype == view.dtype:
            view.add_(grad)
        else:
            # fp32 += bf16 through torch's type promotion allocates an fp32 temporary per call, and every
            # large one is fresh memory to fault in: ~15x slower than a copy into a kept buffer and an
            # fp32 add (the same sum, bit for bit)
            if self._grad_scratch is None or self._grad_scratch.numel() < grad.numel():
                self._grad_scratch = torch.empty(max(grad.numel(), self._largest_param), dtype=view.dtype)
            scratch = self._grad_scratch[: grad.numel()].view(grad.shape)
            scratch.copy_(grad)
            view.add_(scratch)
        self._has_grad[u][i] = True
        p.grad = None

    def _spill_grad(self, u: int) -> None:
        held = self._grads.pop(u)
        if held.pooled:
            self._put_back(TensorKind.GRADIENTS, u, held)
        self._grad_spilled.add(u)

    def _hyper(self) -> list[dict[str, Any]]:
        """The user's param-group hyperparameters now (the LR Lightning's step would use), as a snapshot:
        a deferred part must not see the LR scheduler's next value."""
        assert self.optimizer is not None
        return [
            {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]

    def _trainable_has_grad(self, unit: int) -> list[bool]:
        has = self._has_grad.pop(unit, None) or [False] * len(self.layouts[unit].params)
        return [h for h, slot in zip(has, self.layouts[unit].params) if slot.group is not None]

    def gradient_ready(self, unit: int) -> None:
        """``unit``'s gradient for this window is complete: hand its step to the optimizer lane (in the
        background when ``lag`` > 0), or (deferred mode) record its norms and let the gradient wait on
        its tier until :meth:`finish_step`."""
        self.lane.check()
        if self.unit_optimizers[unit] is None or not self.layouts[unit].trainable_numel:
            return
        if unit not in self._grads and unit not in self._grad_spilled:
            return  # no gradient reached this unit in this window: torch skips such parameters too
        if self.clip.defer:
            flat = self._grad_flat(unit)
            if self.grad_reducer is not None:
                self.grad_reducer(flat)  # the norm is of the averaged gradient (nothing else on the lane now)
            lay = self.layouts[unit]
            views = [_view(flat, s) for s, has in zip(lay.params, self._has_grad[unit]) if has]
            norms = iter(torch._foreach_norm(views, 2.0) if views else [])
            self._norms[unit] = [next(norms) if has else None for has in self._has_grad[unit]]
            self._grad_complete.append(unit)
            if unit not in self._weights:
                self._spill_grad(unit)  # wait on the gradients tier until finish_step (else: at release)
            return
        self._ensure_grad_in_memory(unit)
        grad_held = self._grads.pop(unit)
        weights_held = self._weights.get(unit)
        if weights_held is not None:
            self._donated.add(unit)  # released by the engine soon; the job gives the buffer back
        hyper, has_grad = self._hyper(), self._trainable_has_grad(unit)
        self._drop_prefetch(unit)
        self._updated[unit].clear()
        opt = self.unit_optimizers[unit]
        assert opt is not None
        deferred = self._defers(unit)
        if deferred:
            self._alpha_pending.append((unit, hyper, has_grad))
        value = self.clip.value
        staging = self._step_staging_bytes(unit, weights_held is not None)
        with self._optional_lock:
            self._staging_pending += staging

        def backward_part() -> None:
            stepped = False
            try:
                grad = grad_held.buf.view(torch.float32, self.layouts[unit].numel)
                if self.grad_reducer is not None:
                    self.grad_reducer(grad)  # data parallel: the ranks' gradients averaged, as DDP does
                if value is not None:
                    grad.clamp_(-value, value)
                try:
                    self._step_part(unit, 0, grad, weights_held, hyper, has_grad)
                finally:
                    with self._optional_lock:
                        self._staging_pending -= staging
                lo, hi = opt.part_range(1)
                if deferred and lo < hi:
                    # the forward part's gradient waits on its tier until the forward-part step
                    self._put_back(TensorKind.GRADIENTS, unit, grad_held,
                                   self._byte_ranges(TensorKind.GRADIENTS, unit, lo, hi))
                else:
                    self._done_with(grad_held)
                stepped = True
            finally:
                if weights_held is not None and not (
                    stepped and not deferred and unit == 0 and self.shard is None
                    and self._keep_as_prefetch(unit, weights_held)
                ):
                    self._done_with(weights_held)
            if not deferred:
                self._gather_weights(unit)
                self._updated[unit].set()

        self.lane.submit(backward_part, heavy=True)

    def _ensure_grad_in_memory(self, unit: int) -> None:
        """Make sure ``unit``'s gradient accumulator is in memory (read back if it was spilled)."""
        if unit not in self._grads:
            self._grad_flat(unit)

    def _submit_forward_parts(self) -> None:
        """After a window's backward: the deferred (alpha) part of every stepped unit, in the order the
        next forward needs them; each unit's forward waits for its own."""
        pending, self._alpha_pending = sorted(self._alpha_pending, key=lambda e: e[0]), []
        for unit, hyper, has_grad in pending:

            def forward_part(unit: int = unit, hyper: list = hyper, has_grad: list = has_grad) -> None:
                opt = self.unit_optimizers[unit]
                assert opt is not None
                lo, hi = opt.part_range(1)
                if lo < hi:  # (a rank's chunk may end before the split: nothing deferred on this rank)
                    grad_held = self._stage(TensorKind.GRADIENTS, unit, read=True,
                                            ranges=self._byte_ranges(TensorKind.GRADIENTS, unit, lo, hi))
                    try:
                        grad = grad_held.buf.view(torch.float32, self.layouts[unit].numel)
                        self._step_part(unit, 1, grad, None, hyper, has_grad)
                    finally:
                        self._done_with(grad_held)
                self._gather_weights(unit)
                self._updated[unit].set()

            self.lane.submit(forward_part, heavy=False)

    def global_grad_norm(self, order: Iterable[nn.Parameter]) -> Tensor:
        """The 2-norm over every waiting gradient, combined in ``order`` (the optimizer's parameter order,
        as ``torch.nn.utils.clip_grad_norm_`` combines them)."""
        norms = []
        for p in order:
            where = self._where.get(id(p))
            if where is None:
                continue
            u, i = where
            per_unit = self._norms.get(u)
            if per_unit is not None and per_unit[i] is not None:
                norms.append(per_unit[i])
        if not norms:
            return torch.tensor(0.0)
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def clip_by_norm(self, max_norm: float, order: Iterable[nn.Parameter]) -> Tensor:
        """Deferred mode: scale every waiting gradient as ``clip_grad_norm_`` would (applied at step)."""
        total = self.global_grad_norm(order)
        coef = max_norm / (total + 1e-6)
        self._clip_coef = torch.clamp(coef, max=1.0)
        return total

    def clip_by_value(self, value: float) -> None:
        if not self.clip.defer:
            if self.clip.value is None or float(value) != float(self.clip.value):
                raise ValueError(
                    f"gradient clipping by value {value} was requested at step time, but greedysnake already "
                    f"stepped units with clip value {self.clip.value}. Fix: set Trainer(gradient_clip_val=...) "
                    "to the value you pass to clip_gradients."
                )
            return
        self._value_clips.append(float(value))

    def finish_step(self) -> None:
        """After clipping (Lightning's order): hand the forward parts of this window's steps to the lane
        (they overlap the next forward); in deferred mode, every unit's whole step, in unit order."""
        self.lane.check()
        if not self.clip.defer:
            self._submit_forward_parts()
            return
        values, coef = list(self._value_clips), self._clip_coef
        self._value_clips, self._clip_coef = [], None
        for unit in sorted(self._grad_complete):
            grad_held = self._grads.pop(unit, None)
            self._grad_spilled.discard(unit)
            hyper, has_grad = self._hyper(), self._trainable_has_grad(unit)
            self._drop_prefetch(unit)
            self._updated[unit].clear()

            def whole_step(unit: int = unit, grad_held: _Held | None = grad_held, hyper: list = hyper,
                           has_grad: list = has_grad) -> None:
                held = grad_held if grad_held is not None else self._stage(TensorKind.GRADIENTS, unit, read=True)
                try:
                    grad = held.buf.view(torch.float32, self.layouts[unit].numel)
                    for v in values:
                        grad.clamp_(-v, v)
                    if coef is not None:
                        grad.mul_(coef)
                    self._step_part(unit, 0, grad, None, hyper, has_grad)
                    self._step_part(unit, 1, grad, None, hyper, has_grad)
                finally:
                    self._done_with(held)
                self._gather_weights(unit)
                self._updated[unit].set()

            self.lane.submit(whole_step, heavy=False)
        self._grad_complete.clear()
        self._norms.clear()

    def _step_part(
        self, unit: int, part: int, grad: Tensor, weights_held: _Held | None, hyper: list[dict[str, Any]],
        has_grad: list[bool],
    ) -> None:
        """One part (element range) of one unit's optimizer step, on whichever thread runs it: read the
        range's master weights and state, step, write them back, refresh the compute weights.
        ``weights_held``: the unit's compute weights still in memory (the acquired buffer), if any."""
        opt = self.unit_optimizers[unit]
        assert opt is not None
        lo, hi = opt.part_range(part)
        if lo >= hi or opt.parts[part].shadow is None:
            return
        lay = self.layouts[unit]
        w_ranges = self._byte_ranges(TensorKind.WEIGHTS, unit, lo, hi)
        ahead_master, ahead_states = self._step_ahead.pop(unit, (None, None)) if part == 0 else (None, None)
        for held in (ahead_master, ahead_states):
            if held is not None:
                self._take_over(held)
        if ahead_master is not None or ahead_states is not None:
            self.steps_read_ahead += 1
        # every read this part needs goes out at once, then one wait
        if ahead_master is not None:
            master = ahead_master
        elif self.separate_master:
            master = self._stage(TensorKind.MASTER_WEIGHTS, unit, read=True, wait=False,
                                 ranges=self._byte_ranges(TensorKind.MASTER_WEIGHTS, unit, lo, hi))
        elif weights_held is not None:
            master = weights_held  # fp32: the compute weights in memory are the master copy
        else:
            master = self._stage(TensorKind.WEIGHTS, unit, read=True, label=TensorKind.MASTER_WEIGHTS.value,
                                 ranges=w_ranges, wait=False)
        states = ahead_states
        if self.slots and states is None:
            states = self._stage(TensorKind.OPTIMIZER_STATES, unit, read=opt.part_initialized(part), wait=False,
                                 ranges=self._byte_ranges(TensorKind.OPTIMIZER_STATES, unit, lo, hi))
        compute = None
        if self.separate_master:
            compute = weights_held if weights_held is not None else self._stage(
                TensorKind.WEIGHTS, unit, read=True, ranges=w_ranges, wait=False)
        # (the acquired weights are the caller's to give back, even if a read fails)
        self._await(*(held for held in (master, states, compute) if held is not weights_held))
        mflat = master.buf.view(torch.float32, lay.numel)
        state_views = {
            name: states.buf.view(torch.float32, lay.numel, offset_bytes=k * lay.nbytes(4))
            for k, name in enumerate(self.slots)
        } if states is not None else {}
        opt.step(mflat, grad, state_views, has_grad, part, hyper)
        self.steps_taken += 1
        step_bytes = (hi - lo) * 4
        if states is not None:
            self._put_back(TensorKind.OPTIMIZER_STATES, unit, states,
                           self._byte_ranges(TensorKind.OPTIMIZER_STATES, unit, lo, hi))
        if self.separate_master:
            assert compute is not None
            cflat = compute.buf.view(self.compute_dtype, lay.numel)
            for slot in lay.params:
                a, b = max(lo, slot.offset_numel), min(hi, slot.offset_numel + slot.numel)
                if slot.group is not None and a < b:
                    cflat[a:b].copy_(mflat[a:b])
            # only now may the master buffer go back: once its write completes the pool can hand it to
            # the training thread (a gradient accumulator of the same size is zeroed at once), so reading
            # it for the cast after _put_back raced with that (found by benchmarks/stress_bf16_lane.py)
            self._put_back(TensorKind.MASTER_WEIGHTS, unit, master,
                           self._byte_ranges(TensorKind.MASTER_WEIGHTS, unit, lo, hi))
            self._put_back(TensorKind.WEIGHTS, unit, compute, w_ranges, release=weights_held is None)
        else:
            # the updated fp32 weights are the new compute weights; an acquired buffer is given back by
            # its owner once this write is done
            self._put_back(TensorKind.WEIGHTS, unit, master, w_ranges, release=weights_held is None)
        trim_heap(step_bytes)

    # -- window and lifetime --------------------------------------------------------------------------
    def end_window(self, completed: bool = True) -> None:
        """Forget the window's checkpoints; an abandoned window (``completed=False``) also loses its
        gradients, as Lightning's own ``zero_grad`` would drop them. A completed window's gradients are
        all stepped already, or (deferred mode) wait for :meth:`finish_step`."""
        for key in list(self._ssd_checkpoints):
            ck = self._ssd_checkpoints[key]
            self.drop_checkpoint(*key)
            ck.write.result()  # the scratch space is reused by the next window
        self._host_checkpoints.clear()
        if self._scratch is not None:
            self._scratch.reset()
        if not completed:
            self.discard_gradients()

    def discard_gradients(self) -> None:
        self._alpha_pending.clear()
        for u in list(self._step_ahead):
            self._drop_step_ahead(u)
        for u in list(self._grads):
            held = self._grads.pop(u)
            self._done_with(held)
        self._grad_spilled.clear()
        self._grad_complete.clear()
        self._has_grad.clear()
        self._norms.clear()

    def drain(self) -> None:
        """Complete every pending optimizer step, deferred forward parts included (before reading the
        weights or optimizer state from outside a window: checkpoints, evaluation, the end of the run)."""
        if self._alpha_pending:
            self._submit_forward_parts()
        self.lane.drain()
        self.flush()

    def flush(self) -> None:
        """Wait for every write in flight (raises the first I/O error)."""
        for regions in self._regions.values():
            if isinstance(regions, SSDRegions):
                regions.wait_all()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _close_regions(self) -> None:
        for regions in self._regions.values():
            regions.close()
        if self._scratch is not None:
            self._scratch.close()
        if self.engine is not None:
            self.engine.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for writes, stop the I/O threads, close files and buffers, remove hooks. Idempotent.
        The parameters keep their placeholders: the state lives in the tiers (and in checkpoints)."""
        if self._closed:
            return
        self._closed = True
        self.remove_hooks()
        try:
            self.lane.close()  # runs what is queued (a failed lane runs nothing more)
            for u in list(self._weights):
                self.release_unit(u)
            for u in list(self._prefetched):
                self._drop_prefetch(u)
            for u in list(self._step_ahead):
                self._drop_step_ahead(u)
            if self.lane.failed:
                # the error already reached the training thread; finish cleaning up regardless
                with contextlib.suppress(OSError):
                    self.flush()
            else:
                self.flush()
        finally:
            self._close_regions()
            self.pool.close()


def _view(flat: Tensor, slot: ParamSlot) -> Tensor:
    return flat[slot.offset_numel : slot.offset_numel + slot.numel].view(slot.shape)
