"""Runs one accumulation window's Plan on a layered model.

The engine is driven from outside in segments, because the fused ops belong to the caller (Lightning's
``training_step`` and ``backward``):

    begin_window(M, step)
    for m in 0..M-1:
        set_inputs(...) for every micro-batch in inputs_needed_until_fused(m)
        run_until_fused(m)          # F ops (and, horizontally, nothing else)
        out = fused_forward(m, ...)  # called from inside the user's training_step
        <caller back-propagates its loss through ``out``>
        fused_backward_done(m)      # B and O ops that follow, up to the next F or L op
    finish_window()

Synchronous on CPU; this is the only part that will know about time (threads, streams) once the
offloaded tiers arrive.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ContextManager

import torch
from torch import Tensor

from lightning_greedysnake.config import RunConfig, Tier
from lightning_greedysnake.models import LayerChain, Unit
from lightning_greedysnake.offload import TensorStore
from lightning_greedysnake.engine.buffers import BufferWriters
from lightning_greedysnake.engine.inputs import input_mismatch, same_inputs
from lightning_greedysnake.engine.saved import KeptGraph, SavedBytes
from lightning_greedysnake.engine.timing import ComputeTimer
from lightning_greedysnake.offload.device import named_sync
from lightning_greedysnake.rng import GeneratorState, MicrobatchStreams, TrainingRng
from lightning_greedysnake.schedule import Op, OpKind, Plan, build_plan


@dataclass
class _Microbatch:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    ctx: Any = None
    act_grad: Tensor | None = None
    """Gradient w.r.t. the output of the unit whose backward runs next for this micro-batch; None when
    the loss did not depend on it (then the earlier units get no gradient from this micro-batch)."""


@dataclass
class _Window:
    plan: Plan
    microbatches: list[_Microbatch | None]
    streams: MicrobatchStreams
    """Each micro-batch's RNG stream: every forward on micro-batch m runs on m's (:mod:`lightning_greedysnake.rng`)."""
    cursor: int = 0
    rng: dict[tuple[int, int], GeneratorState] = field(default_factory=dict)
    """recompute: the state F u.m's forward started from, which B u.m's recomputation replays."""
    graphs: dict[tuple[int, int], tuple[Tensor | None, Tensor, KeptGraph]] = field(default_factory=dict)
    """recompute=False: each unit's graph per micro-batch, from its forward to its backward: (the unit's input
    leaf, its output, the hooks that packed its saved tensors: with saved activations on SSD, the bytes of
    those are the store's saved activation of (unit, micro-batch) meanwhile)."""
    kept_inputs: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    """recompute=False: each unit's input per micro-batch, as the autograd leaf the next unit's graph
    starts from (the store's saved activations are copies, without the graph)."""
    fused_leaf: dict[int, Tensor | None] = field(default_factory=dict)
    fused_pending: int | None = None
    input_checks: list[tuple[int, Tensor]] = field(default_factory=list)
    """Device-side input comparisons not read yet (micro-batch, flag: True where the inputs differ),
    read once at the window's end (:meth:`WindowEngine.finish_window`)."""
    hinted: set[int] = field(default_factory=set)
    """Units whose step's read-ahead hint was taken in this window (its reads under way, or none to make):
    not asked again before every later op (it was, for every coming step: K x units squared calls a window)."""

    @property
    def next_op(self) -> Op | None:
        return self.plan.ops[self.cursor] if self.cursor < len(self.plan.ops) else None

    def steps_after(self, cursor: int) -> list[int]:
        """The units of the optimizer ops after the one at ``cursor``, in order (the steps whose reads may
        start while the ops before them run)."""
        return [self.plan.ops[i].unit for i in self._steps[bisect.bisect_right(self._steps, cursor):]]

    @functools.cached_property
    def _steps(self) -> list[int]:
        """Indices of the plan's optimizer ops."""
        return [i for i, op in enumerate(self.plan.ops) if op.kind is OpKind.OPTIMIZER]

    @functools.cached_property
    def last_step(self) -> tuple[int, int] | None:
        """(index of the next-to-last optimizer op, unit of the last): the window's last step is the one
        the next forward waits for; once the cursor is past the one before it, its reads may start."""
        steps = self._steps
        if not steps:
            return None
        return (steps[-2] if len(steps) > 1 else -1), self.plan.ops[steps[-1]].unit


def _check_hidden(value: Any, where: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(
            f"{where} returned a {type(value).__name__}; greedysnake passes a single tensor between units. "
            "Fix: make each block return its hidden state as one tensor (put extras in the chain's ctx)."
        )
    return value


class WindowEngine:
    def __init__(
        self,
        chain: LayerChain,
        units: list[Unit],
        config: RunConfig,
        store: TensorStore,
        device: torch.device,
        forward_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
        timer: ComputeTimer | None = None,
        rng: TrainingRng | None = None,
    ) -> None:
        """``config``: the run's (:meth:`GreedySnakeConfig.resolved`: every setting in effect).
        ``forward_context``: entered around every forward the engine runs itself (the precision plugin's
        autocast), as Lightning enters it around ``training_step``. ``timer``: times every forward and
        backward op the engine runs, where the compute runs (the plan's compute times, telemetry).
        ``rng``: the run's RNG policy (each micro-batch's forwards on its own stream; None: one that says
        nothing, for a window driven without a Trainer)."""
        self.forward_context = forward_context
        self.timer = timer
        self.rng = rng if rng is not None else TrainingRng(device)
        self.chain = chain
        self.units = units
        self.buffer_writers = BufferWriters(chain, units)
        """The units whose forward updates buffers (found by their first forward): a recomputation puts
        them back, and a plan running such a unit out of micro-batch order is refused."""
        self._window: _Window | None = None
        self.replan(config)
        self.store = store
        self.device = device
        self._held_unit: int | None = None
        self.activation_bytes: dict[int, int] = {}
        """Per unit, the bytes its autograd graph holds for one micro-batch (measured at the first
        recompute of each unit): what keeping the graphs instead would cost."""

    def replan(self, config: RunConfig) -> None:
        """Run with ``config`` (resolved: the warm-step plan's) from the next window on."""
        assert self._window is None, "replan inside a window"
        if not isinstance(config, RunConfig):
            raise TypeError(f"the engine runs a run's configuration (built by GreedySnakeConfig.resolved), not {config}")
        self.config = config

    # -- window lifecycle ---------------------------------------------------------------------------
    @property
    def num_units(self) -> int:
        return len(self.units)

    @property
    def window_active(self) -> bool:
        return self._window is not None

    @property
    def plan(self) -> Plan | None:
        return self._window.plan if self._window is not None else None

    def begin_window(self, num_microbatches: int, step: int = 0) -> Plan:
        """Begin the window whose optimizer step is ``step`` (``trainer.global_step``: it seeds the
        micro-batches' RNG streams)."""
        assert self._window is None, "begin_window while another window is active"
        plan = build_plan(self.config.schedule, self.num_units, num_microbatches)
        self.buffer_writers.check_order(plan)
        self._window = _Window(plan, [None] * num_microbatches, self.rng.window(step))
        self.store.begin_window(num_microbatches)
        return plan

    def abort_window(self) -> None:
        """Forget the current window (nothing was stepped for it)."""
        self._end(completed=False)

    def finish_window(self) -> None:
        w = self._require_window()
        assert w.cursor == len(w.plan.ops), (
            f"window finished after {w.cursor} of {len(w.plan.ops)} ops; next is {w.next_op}"
        )
        if w.input_checks:
            # sync: the window's one host read of its device-side input comparisons (there only when
            # training_step handed the model other tensors than the look-ahead captured: a read-ahead
            # micro-batch's own transfer, on a GPU)
            with named_sync("window inputs equal"):
                differ = torch.stack([flag for _, flag in w.input_checks]).cpu().tolist()
            bad = sorted({m for (m, _), d in zip(w.input_checks, differ) if d})
            if bad:
                self._end(completed=True)  # (its units were stepped: the store ends it as it is)
                raise input_mismatch(bad)
        self._end(completed=True)

    def _end(self, completed: bool) -> None:
        self._release_held()
        self._window = None
        self.store.end_window(completed)

    # -- inputs ---------------------------------------------------------------------------------------
    def has_inputs(self, microbatch: int) -> bool:
        return self._require_window().microbatches[microbatch] is not None

    def set_inputs(self, microbatch: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        w = self._require_window()
        assert w.microbatches[microbatch] is None, f"inputs of micro-batch {microbatch} set twice"
        w.microbatches[microbatch] = _Microbatch(args, kwargs)

    def inputs_needed_until_fused(self, microbatch: int) -> list[int]:
        """Micro-batches whose model inputs the ops up to and including ``L.microbatch`` read."""
        w = self._require_window()
        needed: list[int] = []
        for op in w.plan.ops[w.cursor :]:
            if op.kind in (OpKind.FORWARD, OpKind.FUSED) and op.unit == 0 and op.microbatch not in needed:
                needed.append(op.microbatch)
            if op.kind is OpKind.FUSED and op.microbatch == microbatch:
                break
        return needed

    # -- driving ---------------------------------------------------------------------------------------
    def run_until_fused(self, microbatch: int) -> None:
        w = self._require_window()
        assert w.fused_pending is None, f"fused op of micro-batch {w.fused_pending} still awaits backward"
        while True:
            op = w.next_op
            assert op is not None, f"plan ended before L.{microbatch}"
            if op.kind is OpKind.FUSED:
                assert op.microbatch == microbatch, f"next fused op is {op}, caller is at micro-batch {microbatch}"
                return
            self._run(op)
            w.cursor += 1

    def fused_forward(self, microbatch: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The last unit, head and loss inputs for ``microbatch``, with autograd on."""
        w = self._require_window()
        op = w.next_op
        assert op is not None and op.kind is OpKind.FUSED and op.microbatch == microbatch
        if w.fused_pending is not None:
            raise RuntimeError(
                f"training_step called the layered model twice for micro-batch {microbatch}: strategy='greedysnake' "
                "runs its units ahead for the whole window and answers exactly one call per training_step, so a "
                "second call cannot be run. Fix: call the layered model once per training_step and reuse its "
                "output (e.g. `logits = self.model(x)`, then every loss term from `logits`); to run two inputs, "
                "concatenate them into one batch for that one call."
            )
        mb = self._inputs(microbatch)
        deferred: list[Tensor] = []
        if not same_inputs((args, kwargs), (mb.args, mb.kwargs), deferred):
            raise input_mismatch([microbatch])
        w.input_checks.extend((microbatch, flag) for flag in deferred)
        unit = self.units[op.unit]
        self._ensure_unit(op.unit)
        self._hint_next_step()  # (the fused unit's own step: its reads overlap the fused ops)
        self._hint_next_activation()  # (the op after it: its saved activation comes in during the fused ops)
        with w.streams.forward_of(microbatch), torch.enable_grad():
            hidden, leaf = self._unit_input(op.unit, mb, microbatch)
            hidden = self._blocks(unit, hidden, mb.ctx)
            out = self.chain.post(hidden, mb.ctx)
        w.fused_leaf[microbatch] = leaf
        w.fused_pending = microbatch
        return out

    def fused_backward_done(self, microbatch: int) -> None:
        """The caller's backward through ``fused_forward``'s output is done (or there was no loss): run the
        ops that follow up to the next forward-side op."""
        w = self._require_window()
        op = w.next_op
        assert op is not None and op.kind is OpKind.FUSED and op.microbatch == microbatch, (
            f"fused_backward_done({microbatch}) but the next op is {op}"
        )
        mb = self._inputs(microbatch)
        leaf = w.fused_leaf.pop(microbatch, None)
        mb.act_grad = leaf.grad if leaf is not None else None
        if op.unit > 0:
            self._drop_input(op.unit, microbatch)
        w.fused_pending = None
        w.cursor += 1
        while (nxt := w.next_op) is not None and nxt.kind in (OpKind.BACKWARD, OpKind.OPTIMIZER):
            self._run(nxt)
            w.cursor += 1

    @property
    def fused_pending(self) -> int | None:
        return self._window.fused_pending if self._window is not None else None

    # -- evaluation -------------------------------------------------------------------------------------
    def eval_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, unit by unit through the store (outside any training window's state)."""
        hidden: Any = None
        inputs = _Microbatch(args, kwargs)  # (outside any window: only ``pre``'s ctx is kept in it)
        # evaluation may come in the middle of a window (val_check_interval): give back the unit the
        # window holds; the window re-acquires it when it resumes
        self._release_held()
        for unit in self.units:
            self.store.acquire_unit(unit.index)
            if unit.index + 1 < self.num_units:
                self.store.prefetch(unit.index + 1)
            try:
                if unit.index == 0:
                    hidden, _ = self._unit_input(0, inputs)
                hidden = self._blocks(unit, hidden, inputs.ctx)
                if unit.index == self.num_units - 1:
                    hidden = self.chain.post(hidden, inputs.ctx)
            finally:
                self.store.release_unit(unit.index)
        return hidden

    def close(self) -> None:
        if self._window is not None:
            self.abort_window()
        self._release_held()

    # -- ops ----------------------------------------------------------------------------------------------
    def _run(self, op: Op) -> None:
        self._hint_next_activation()
        self._hint_next_unit()
        if op.kind is OpKind.OPTIMIZER:
            self.store.gradient_ready(op.unit)
            return
        if self.timer is not None and (op.kind is OpKind.FORWARD or self._inputs(op.microbatch).act_grad is not None):
            self._ensure_unit(op.unit)  # waiting for the weights is I/O, not this op's compute
        mark = self.timer.start() if self.timer is not None else None
        if op.kind is OpKind.FORWARD:
            self._forward(op.unit, op.microbatch)
        elif op.kind is OpKind.BACKWARD:
            self._backward(op.unit, op.microbatch)
        else:  # pragma: no cover - fused ops are run by the caller
            raise AssertionError(f"engine cannot run {op} itself")
        if self.timer is not None:
            self.timer.stop(mark, str(op))

    def _forward(self, u: int, m: int) -> None:
        w = self._require_window()
        mb = self._inputs(m)
        unit = self.units[u]
        self._ensure_unit(u)
        recompute = self.config.recompute
        # Recompute mode: no graph now, backward rebuilds it. Otherwise keep the graph until B u.m, with
        # its saved views of the unit's weights held as references (the weights leave memory meanwhile)
        # and, with saved activations on SSD, its other saved tensors there (KeptGraph).
        grad_mode = torch.no_grad() if recompute else torch.enable_grad()
        graph = None if recompute else KeptGraph(unit, self.device if self._graphs_offloaded else None)
        hooks = contextlib.nullcontext() if graph is None else graph.hooks()
        with w.streams.forward_of(m), self.buffer_writers.first_forward(u, w.plan):
            if recompute:
                w.rng[(u, m)] = GeneratorState.capture(self.device)
            with grad_mode, hooks, self.forward_context():
                hidden, leaf = self._unit_input(u, mb, m, for_grad=not recompute)
                out = self._blocks(unit, hidden, mb.ctx)
        if graph is None:
            self.store.save_activation(u + 1, m, out)
            if u > 0 and (u, m) not in w.kept_inputs:
                # read back again for backward: an offloading store frees it now (just in time)
                self.store.release_activation(u, m)
        else:
            blob = graph.seal()
            if blob is not None:
                # the unit's saved activation for m is its graph's bytes while the graph waits for B u.m (its
                # input stays kept beside it, as the next unit's input leaf); released at once: read back for B u.m
                self.store.save_activation(u, m, blob)
                self.store.release_activation(u, m)
            w.graphs[(u, m)] = (leaf, out, graph)
            w.kept_inputs[(u + 1, m)] = out.detach().requires_grad_(out.is_floating_point())

    @property
    def _graphs_offloaded(self) -> bool:
        """recompute=False with saved activations on SSD: each kept graph's saved tensors go there."""
        return not self.config.recompute and self.config.offload.activations is Tier.SSD

    def _unit_input(self, u: int, mb: _Microbatch, m: int | None = None, for_grad: bool = True,
                    keep_ctx: bool = True) -> tuple[Tensor, Tensor | None]:
        """Unit ``u``'s input, and again as the leaf whose gradient goes to the unit before (None for unit
        0). Unit 0 runs the chain's ``pre`` on ``mb``'s inputs, keeping its ctx in ``mb`` when ``keep_ctx``;
        any other unit reads micro-batch ``m``'s input in the window: the one kept with its graph, else its
        saved activation (an autograd leaf when ``for_grad``)."""
        if u == 0:
            hidden, ctx = self.chain.pre(*mb.args, **mb.kwargs)
            hidden = _check_hidden(hidden, "pre")
            if keep_ctx:
                mb.ctx = ctx
            return hidden, None
        assert m is not None, "a unit past the first reads its input from the window"
        leaf = self._require_window().kept_inputs.get((u, m))
        if leaf is None:
            stored = self.store.load_activation(u, m)
            leaf = stored.detach().requires_grad_(stored.is_floating_point()) if for_grad else stored
        return leaf, leaf

    def _drop_input(self, u: int, m: int) -> None:
        if self._require_window().kept_inputs.pop((u, m), None) is None:
            self.store.drop_activation(u, m)

    def _backward(self, u: int, m: int) -> None:
        w = self._require_window()
        mb = self._inputs(m)
        grad = mb.act_grad
        if grad is None:  # nothing flows back from this micro-batch: zero gradient, nothing to do
            w.rng.pop((u, m), None)
            graph = w.graphs.pop((u, m), None)
            if graph is not None and graph[2].has_blob:
                self.store.drop_activation(u, m)
            if u > 0:
                self._drop_input(u, m)
            return
        unit = self.units[u]
        self._ensure_unit(u)
        graph: KeptGraph | None = None
        if (u, m) in w.graphs:
            leaf, out, graph = w.graphs.pop((u, m))
            if graph.has_blob:
                graph.blob = self.store.load_activation(u, m)
        else:
            counter = SavedBytes(unit.parameters()) if u not in self.activation_bytes else None
            measure = counter.hooks() if counter is not None else contextlib.nullcontext()
            with w.rng.pop((u, m)).replay(), self.buffer_writers.recomputing(u), torch.enable_grad(), measure, \
                    self.forward_context():
                hidden, leaf = self._unit_input(u, mb, m, keep_ctx=False)  # (the forward's ctx stays)
                out = self._blocks(unit, hidden, mb.ctx)
            if counter is not None:
                self.activation_bytes[u] = counter.nbytes
        if out.requires_grad:
            torch.autograd.backward(out, grad)
        if graph is not None and graph.blob is not None:
            graph.blob = None
            self.store.drop_activation(u, m)
        mb.act_grad = leaf.grad if leaf is not None else None
        if u > 0:
            self._drop_input(u, m)

    def _blocks(self, unit: Unit, hidden: Tensor, ctx: Any) -> Tensor:
        for i in unit.block_indices:
            hidden = _check_hidden(self.chain.block_forward(self.chain.blocks[i], hidden, ctx), f"block {i}")
        return hidden

    # -- helpers ------------------------------------------------------------------------------------------
    def _ensure_unit(self, u: int) -> None:
        """Consecutive ops on one unit share one acquisition of its weights."""
        if self._held_unit == u:
            return
        self._release_held()
        self.store.acquire_unit(u)
        self._held_unit = u
        for nxt in self._next_units_after_cursor(u):
            self.store.prefetch(nxt)

    def _hint_next_activation(self) -> None:
        """The op after the current one reads a saved activation (any op on a unit past the first):
        let the store start bringing it in (its read, its copy to the device) while the current op
        computes: called before every op's compute is enqueued, the fused op's included."""
        w = self._window
        if w is None or w.cursor + 1 >= len(w.plan.ops):
            return
        nxt = w.plan.ops[w.cursor + 1]
        if nxt.kind is not OpKind.OPTIMIZER and (nxt.unit > 0 or self._graphs_offloaded):
            self.store.prefetch_activation(nxt.unit, nxt.microbatch)

    def _hint_next_unit(self) -> None:
        """Ask again for the next unit's weights before every op: the prefetch at acquisition may have
        found no spare budget (a background step was staging), and memory frees up as steps finish."""
        if self._held_unit is not None:
            for nxt in self._next_units_after_cursor(self._held_unit):
                self.store.prefetch(nxt)
        self._hint_next_step()

    def _hint_next_step(self) -> None:
        """Let the store read the coming optimizer steps' master weights and state while the ops before them
        run: the window's last step (which the next forward waits for) once the cursor is past the step
        before it; the others once past the forward phase (whose weight prefetches the slack is for), in
        their order, as many as the slack permits: a step whose reads cannot start holds back the hints
        for the steps after it, so the staging goes to the step the lane runs first."""
        w = self._require_window()
        if w.last_step is not None and w.cursor > w.last_step[0]:
            self.store.prefetch_step(w.last_step[1])
        elif w.next_op is not None and w.next_op.kind is not OpKind.FORWARD:
            for step in w.steps_after(w.cursor - 1):  # (the op at the cursor may be the step itself)
                if step in w.hinted:
                    continue
                if not self.store.prefetch_step(step, last=False):
                    break
                w.hinted.add(step)

    def _next_units_after_cursor(self, u: int) -> list[int]:
        """The next ``offload.prefetch_units`` different units the plan will need, in order (the
        prefetch targets; fewer at the window's end)."""
        depth = self.config.offload.prefetch_units
        w = self._require_window()
        found: list[int] = []
        for op in w.plan.ops[w.cursor :]:
            if len(found) >= depth:
                break
            if op.kind is not OpKind.OPTIMIZER and op.unit != u and op.unit not in found:
                found.append(op.unit)
        return found

    def _release_held(self) -> None:
        if self._held_unit is not None:
            self.store.release_unit(self._held_unit)
            self._held_unit = None

    def _inputs(self, m: int) -> _Microbatch:
        mb = self._require_window().microbatches[m]
        assert mb is not None, f"inputs of micro-batch {m} were never set"
        return mb

    def _require_window(self) -> _Window:
        assert self._window is not None, "no active window"
        return self._window
