"""The optimizer contract: how the user's optimizer is stepped per unit, decided once per run, before
any work, from what the optimizer is and what a probe on the run's own parameter shapes shows.

greedysnake re-creates the user's optimizer class over pieces of each unit's flat buffers
(:class:`~lightning_greedysnake.optim.unit_optimizer.UnitOptimizer`). Two ways to cut them:

- **element-wise** (:attr:`StepPath.ELEMENT_WISE`): flat slices cut at any element, which the alpha split
  and the ranks' chunks (partitioned state) need at their own sizes. Exact only for an optimizer that
  computes every element from that element alone, so it is an allow-list (:data:`ELEMENT_WISE`), each
  member proven against Lightning by ``tests/integration/test_optimizer_contract.py``.
- **whole parameters** (:attr:`StepPath.WHOLE_PARAMETER`): each parameter whole, in its own shape; the
  split, the ranks' chunks and the gradients file's deferred ranges fall on parameter starts. For
  optimizers that look across a parameter's elements (Adafactor's factored second moment, Muon's
  orthogonalization, a LAMB-style trust ratio) but not across parameters: the known ones
  (:data:`WHOLE_PARAMETER`), and any other whose separability probe passes (stepping the run's
  parameter shapes together, state included, equals stepping each alone). State shaped like its
  parameter streams through the state tier; other state (Adafactor's row and column variances: a
  vector per matrix) stays in host memory beside the step counters.

Refused, naming the class and the fix: closures that re-evaluate the loss (LBFGS), sparse-gradient
optimizers (SparseAdam), any optimizer whose probe couples parameters. Never decided by a 1-D probe
alone: a 1-D probe only finds the slots of an optimizer already known to be element-wise.
"""

from __future__ import annotations

import collections
import copy
import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_greedysnake.optim.unit_optimizer import (
    CallState,
    UnsupportedOptimizerError,
    construct_like,
    discover_slots,
    plain,
)


class StepPath(str, enum.Enum):
    ELEMENT_WISE = "element_wise"
    WHOLE_PARAMETER = "whole_parameter"


ELEMENT_WISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD,
)
"""``torch.optim`` classes that compute each element from that element alone (their ``foreach`` and
``fused`` variants too): stepped on flat slices. Exactly these classes: a subclass may override
``step`` and goes through the probe instead."""

TORCHAO_ELEMENT_WISE = ("AdamW8bit", "AdamW4bit")
"""torchao's low-bit AdamW (``torchao.optim``): element-wise math over blocks of 256 (8-bit) or 128
(4-bit) elements; a unit is laid out and cut on block boundaries (:mod:`~lightning_greedysnake.optim.
subclass_state`). Named, so that torchao is not imported to check."""

WHOLE_PARAMETER: tuple[type[torch.optim.Optimizer], ...] = tuple(
    cls for cls in (getattr(torch.optim, "Adafactor", None), getattr(torch.optim, "Muon", None)) if cls is not None)
"""Known to look across a parameter's elements and never across parameters: stepped whole, no probe."""

REFUSED: dict[str, str] = {
    "LBFGS": "re-evaluates the loss through the closure several times a step, which greedysnake's one "
             "forward and backward per micro-batch cannot do. Fix: use AdamW, Adam or SGD.",
    "SparseAdam": "steps sparse gradients only, and greedysnake accumulates every gradient densely. Fix: use "
                  "torch.optim.Adam (or AdamW).",
}
"""``torch.optim`` classes no path can step, by name, with the reason and the fix."""

QUANTIZED_MIN_NUMEL = 4096
"""torchao's low-bit optimizers keep a parameter's state in fp32 below this many elements."""

PROBE_MAX_NUMEL = 1 << 14
"""The separability probe steps the run's parameter shapes, each scaled down to at most this many
elements with its rank and proportions kept (what a shape-dependent optimizer decides by)."""

PROBE_MAX_SHAPES = 6
"""Distinct shapes probed per param group (the largest first)."""

PROBE_STEPS = 3


@dataclass(frozen=True)
class OptimizerContract:
    """How the run steps its optimizer (:func:`optimizer_contract`)."""

    path: StepPath
    slots: tuple[str, ...] = ()
    """Per-element state streamed through the state tier, one slot each (Adam: ``exp_avg``,
    ``exp_avg_sq``); a whole-parameter optimizer's state of another shape stays in host memory."""
    eager_state: bool = False
    """The optimizer makes a parameter's state when constructed (Adagrad), not at its first step."""
    probe_shape: tuple[int, ...] | None = None
    """The shape the optimizer's rate is measured on (:func:`~lightning_greedysnake.planner.measure.
    optimizer_rate`): the run's largest parameter's on the whole-parameter path (Muon's cost is not
    linear in the elements), None (flat) on the element-wise path."""
    reason: str = ""
    """Why this path, for the setup report."""

    min_piece_numel: int = 0
    """A cut through a parameter leaves at least this many of its elements on either side: torchao's
    low-bit AdamW quantizes a parameter's state only from 4096 elements on (:data:`QUANTIZED_MIN_NUMEL`),
    so a smaller slice of a quantized parameter would keep fp32 state and step differently."""

    calls: CallState = CallState()
    """State the optimizer keeps outside ``state[p]`` and changes alike at every ``step()`` (pytorch-
    optimizer's ``group['step']``), as the separability probe found it: kept per part, checkpointed in the
    param groups."""

    @property
    def whole_parameters(self) -> bool:
        """Each piece the optimizer steps is a whole parameter in its own shape."""
        return self.path is StepPath.WHOLE_PARAMETER


NO_OPTIMIZER = OptimizerContract(StepPath.ELEMENT_WISE, reason="no optimizer")


MODES = ("train", "eval")
"""Methods of an optimizer that keeps a second sequence of weights and swaps it into the parameters
(Schedule-Free's ``optimizer.train()`` / ``optimizer.eval()``, SPlus's EMA for evaluation)."""


def refusal(cls: type) -> str | None:
    """Why no path can step ``cls`` (None: one may)."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.optim") and klass.__name__ in REFUSED:
            return f"{cls.__name__} {REFUSED[klass.__name__]}"
    modes = [m for m in MODES if callable(getattr(cls, m, None)) and not hasattr(torch.optim.Optimizer, m)]
    if modes:
        return (f"{cls.__name__}, which keeps a second sequence of weights that optimizer.{'()/optimizer.'.join(modes)}() "
                "swap into the parameters (Schedule-Free, an EMA for evaluation): greedysnake steps per-unit copies "
                "of the optimizer, which hold that state, so those calls on yours would not reach it and evaluation "
                "would see other weights than Lightning's. Fix: strategy='auto' for this optimizer, or one without "
                "train/eval modes (AdamW).")
    return None


def element_wise_listed(cls: type) -> bool:
    """Whether ``cls`` itself (not a subclass) is on the element-wise list."""
    if cls in ELEMENT_WISE:
        return True
    return cls.__module__.startswith("torchao.optim") and cls.__name__ in TORCHAO_ELEMENT_WISE


def optimizer_contract(optimizer: torch.optim.Optimizer | None, path: str = "auto",
                       warn: Callable[[str, str], None] | None = None) -> OptimizerContract:
    """The run's contract for ``optimizer`` under ``optimizer_path=path``; raises
    :class:`UnsupportedOptimizerError` (a ``ValueError``) naming the class and the fix where no path
    steps it exactly, whatever goes wrong inside the probes (an optimizer's own exception is carried in
    the message, never raised raw). ``warn(key, message)``: told once when ``element_wise`` is forced on
    a class outside the list."""
    if optimizer is None:
        return NO_OPTIMIZER
    try:
        with torch.random.fork_rng(devices=[]):  # (an optimizer drawing random numbers leaves the run's stream as is)
            return _contract(optimizer, path, warn)
    except UnsupportedOptimizerError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the user's class, reported with its name
        shapes = sorted({tuple(p.shape) for g in optimizer.param_groups for p in g["params"]}, key=math.prod)[-3:]
        raise UnsupportedOptimizerError(
            f"greedysnake could not probe {type(optimizer).__name__} on this run's parameter shapes (largest: "
            f"{shapes}): {type(e).__name__}: {e}. It re-creates the optimizer class per unit from its param groups "
            "and steps those on probe parameters before training. Fix: use torch.optim.AdamW, or strategy='auto' "
            "for this optimizer.") from e


def _contract(optimizer: torch.optim.Optimizer, path: str, warn: Callable[[str, str], None] | None
              ) -> OptimizerContract:
    cls = type(optimizer)
    why = refusal(cls)
    if why is not None:
        raise UnsupportedOptimizerError(f"strategy='greedysnake' cannot step {why}")
    listed = element_wise_listed(cls)
    shapes = _shapes_by_group(optimizer)
    probed = not listed and cls not in WHOLE_PARAMETER
    calls = CallState()
    if probed:
        for gi, group_shapes in shapes.items():
            calls = _union(calls, _check_separable(optimizer, gi, group_shapes))
    if path == StepPath.ELEMENT_WISE.value or (path == "auto" and listed):
        if not listed and warn is not None:
            warn("optimizer_path", f"optimizer_path='element_wise' with {cls.__name__}, which is not on greedysnake's "
                 "list of element-wise optimizers: it is stepped on flat slices of parameters cut at any element, "
                 "exact only if it computes every element from that element alone. Fix: leave optimizer_path='auto' "
                 "(whole parameters, where the separability probe passes).")
        return OptimizerContract(StepPath.ELEMENT_WISE, discover_slots(optimizer), _eager(optimizer),
                                 reason="forced by optimizer_path" if not listed else "element-wise (listed)",
                                 min_piece_numel=QUANTIZED_MIN_NUMEL if cls.__module__.startswith("torchao.optim") else 0,
                                 calls=calls)
    slots = _whole_parameter_slots(optimizer, shapes)
    largest = max((s for group in shapes.values() for s in group), key=math.prod, default=None)
    reason = ("forced by optimizer_path" if path == StepPath.WHOLE_PARAMETER.value else
              "separability probe passed on this run's shapes" if probed else "whole parameters (listed)")
    return OptimizerContract(StepPath.WHOLE_PARAMETER, slots, _eager(optimizer), largest, reason, calls=calls)


def _union(a: CallState, b: CallState) -> CallState:
    return CallState(*(tuple(dict.fromkeys(x + y)) for x, y in zip(
        (a.group_keys, a.state_keys, a.attributes), (b.group_keys, b.state_keys, b.attributes), strict=True)))


# -- probes ---------------------------------------------------------------------------------------------
def _hyper(optimizer: torch.optim.Optimizer, gi: int) -> dict[str, Any]:
    """Group ``gi``'s hyperparameters, as copies (a group holding a cache the step fills, torch-optimizer's
    RAdam ``buffer``, would otherwise be shared by every probe optimizer and the user's)."""
    return {k: _snapshot(v) for k, v in optimizer.param_groups[gi].items() if k != "params"}


def _eager(optimizer: torch.optim.Optimizer) -> bool:
    """Whether constructing the optimizer makes state (over a probe of its first parameter's shape)."""
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    probe = torch.zeros(_scaled(tuple(first.shape)) if first is not None else (4,), requires_grad=True)
    return bool(construct_like(optimizer, [{**_hyper(optimizer, 0), "params": [probe]}]).state)


def _scaled(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with at most :data:`PROBE_MAX_NUMEL` elements, its rank and proportions kept."""
    numel = math.prod(shape)
    if numel <= PROBE_MAX_NUMEL or not shape:
        return shape
    factor = (PROBE_MAX_NUMEL / numel) ** (1.0 / len(shape))
    return tuple(max(1, int(d * factor)) for d in shape)


def _shapes_by_group(optimizer: torch.optim.Optimizer) -> dict[int, list[tuple[int, ...]]]:
    """Per param group, the distinct shapes of its trainable parameters, the largest first (at most
    :data:`PROBE_MAX_SHAPES`)."""
    out: dict[int, list[tuple[int, ...]]] = {}
    for gi, group in enumerate(optimizer.param_groups):
        shapes = sorted({tuple(p.shape) for p in group["params"] if p.requires_grad}, key=lambda s: (-math.prod(s), s))
        if shapes:
            out[gi] = shapes[:PROBE_MAX_SHAPES]
    return out


@dataclass
class _Seen:
    """One probe optimizer after one step: its parameters with their state, its param group's entries and
    its attributes."""

    params: list[tuple[Tensor, dict[str, Any]]]
    group: dict[str, Any]
    attributes: dict[str, Any]
    """Its plain attributes, and its ``state`` entries under keys that are no parameter (``state:<key>``)."""
    closure_calls: int = 0


def _snapshot(value: Any) -> Any:
    """``value`` as it is now (a copy), or itself where it cannot be copied (a tensor subclass without
    ``new_empty``: the contract refuses such state by its kind, after the probe)."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001
        return value


def _holds_the_model(value: Any) -> bool:
    """An attribute referring to the model or the user's parameters (a wrapped optimizer, ``self.model``, a
    list of parameters): not the optimizer's own state, and never copied (it may be the whole model)."""
    if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.nn.Parameter)):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_the_model(v) for v in value[:8])
    return isinstance(value, dict) and any(_holds_the_model(v) for v in list(value.values())[:8])


def _attributes(opt: torch.optim.Optimizer) -> dict[str, Any]:
    out = {k: _snapshot(v) for k, v in vars(opt).items()
           if k not in ("defaults", "state", "param_groups") and not k.startswith("_") and not callable(v)
           and not _holds_the_model(v)}
    out.update({f"state:{k}": _snapshot(v) for k, v in opt.state.items() if isinstance(k, str)})
    return out


def _run(optimizer: torch.optim.Optimizer, gi: int, params: list[Tensor], grads: list[list[Tensor]],
         together: bool, shapes: list[tuple[int, ...]], loss: float | None = None
         ) -> tuple[list[_Seen], list[list[_Seen]]]:
    """``params`` (probe leaves) stepped with ``grads`` (per step, per parameter) by optimizers built as the
    user's group ``gi`` is, one over all of them or one each (persistent over the steps), each step given a
    closure returning ``loss`` (None: no closure, as greedysnake steps). Returns what each optimizer held
    before its first step, and after every step. A failure is reported with the optimizer's name and the
    run's parameter ``shapes`` it scaled."""
    cls = type(optimizer)
    hyper = _hyper(optimizer, gi)
    try:
        optimizers = ([construct_like(optimizer, [{**hyper, "params": params}])] if together else
                      [construct_like(optimizer, [{**hyper, "params": [p]}]) for p in params])

        def seen(opt: torch.optim.Optimizer) -> _Seen:
            return _Seen([(p.detach().clone(), {k: _snapshot(v) for k, v in opt.state.get(p, {}).items()})
                          for p in opt.param_groups[0]["params"]],
                         _snapshot({k: v for k, v in opt.param_groups[0].items() if k != "params"}), _attributes(opt))

        before = [seen(opt) for opt in optimizers]
        after: list[list[_Seen]] = []
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            row = []
            for opt in optimizers:
                calls = [0]

                def closure(calls: list[int] = calls) -> Tensor:
                    calls[0] += 1
                    return torch.tensor(loss)

                opt.step() if loss is None else opt.step(closure)
                row.append(seen(opt))
                row[-1].closure_calls = calls[0]
            after.append(row)
        return before, after
    except Exception as e:  # noqa: BLE001 - reported with the optimizer's name
        raise UnsupportedOptimizerError(
            f"greedysnake could not step {cls.__name__} on this run's parameter shapes {shapes} "
            f"({type(e).__name__}: {e}). It re-creates the optimizer class per unit from its param groups. "
            "Fix: freeze or regroup the parameters it cannot take, or use torch.optim.AdamW.") from e


def _check_separable(optimizer: torch.optim.Optimizer, gi: int, shapes: list[tuple[int, ...]]) -> CallState:
    """Raise unless stepping group ``gi``'s shapes together equals stepping each alone after every probe
    step: each parameter, its state, and every param-group entry and attribute the optimizer's ``step()``
    changes. An entry or attribute a step changes alike either way is per-call state (a step counter):
    returned, to be kept per part; one that differs is state over all parameters together (a global
    estimate): coupled, refused naming it."""
    cls = type(optimizer)
    probe_shapes = [_scaled(s) for s in shapes]
    if len(probe_shapes) == 1:
        probe_shapes.append(probe_shapes[0])  # two parameters, even of one shape
    gen = torch.Generator().manual_seed(0x5E9A)
    start = [torch.randn(s, generator=gen) for s in probe_shapes]
    grads = [[torch.randn(s, generator=gen) * (k + 1) for k, s in enumerate(probe_shapes)] for _ in range(PROBE_STEPS)]
    t_before, together = _run(optimizer, gi, [t.clone().requires_grad_() for t in start], grads, True, shapes)
    _, again = _run(optimizer, gi, [t.clone().requires_grad_() for t in start], grads, True, shapes)
    for step, ((got,), (ref,)) in enumerate(zip(again, together, strict=True), start=1):
        if not _same_seen(got, ref):
            raise UnsupportedOptimizerError(
                f"{cls.__name__} draws random numbers in its step (two runs of the same probe differ at step {step}): "
                "stepped unit by unit, each unit would draw them in another order than your optimizer does, so the "
                "result would not be exact. Fix: use a deterministic optimizer (AdamW, say), or strategy='auto' for "
                "this one.")
    a_before, alone = _run(optimizer, gi, [t.clone().requires_grad_() for t in start], grads, False, shapes)

    def changed(before: list[_Seen], steps: list[list[_Seen]], field: str) -> set[str]:
        """The names in ``field`` (group entries or attributes) some step changed, in any optimizer."""
        names: set[str] = set()
        for row in (before, *steps):
            for prev, now in zip(before, row, strict=True):
                old, new = getattr(prev, field), getattr(now, field)
                names |= {k for k in set(old) | set(new) if not _same(old.get(k, _MISSING), new.get(k, _MISSING))}
        return names

    _check_closure(optimizer, gi, shapes, start, grads, together)
    group_keys = changed(t_before, together, "group") | changed(a_before, alone, "group")
    attributes = changed(t_before, together, "attributes") | changed(a_before, alone, "attributes")
    for step, (t_row, a_row) in enumerate(zip(together, alone, strict=True), start=1):
        (t,) = t_row
        differs: list[str] = []
        for k, ((pa, sa), a) in enumerate(zip(t.params, a_row, strict=True)):
            pb, sb = a.params[0]
            differs += [f"its state {name!r}" for name in sorted(set(sa) | set(sb))
                        if not _same(sa.get(name, _MISSING), sb.get(name, _MISSING))]
            if not _same(pa - start[k], pb - start[k]):  # (the update: a coupling of lr's size shows)
                differs.insert(0, f"the parameter of shape {probe_shapes[k]}")
            differs += [f"param_groups[{gi}][{key!r}]" for key in sorted(group_keys)
                        if not _same(t.group.get(key, _MISSING), a.group.get(key, _MISSING))]
            differs += [f"its attribute {name!r}" for name in sorted(attributes)
                        if not _same(t.attributes.get(name, _MISSING), a.attributes.get(name, _MISSING))]
        if differs:
            raise UnsupportedOptimizerError(
                f"{cls.__name__} couples parameters: stepping them together rather than each alone changes "
                f"{', '.join(dict.fromkeys(differs))} after probe step {step} (greedysnake's separability probe on "
                f"this run's shapes, param group {gi}), so stepping it unit by unit would not be exact. Fix: use an "
                "optimizer that updates each parameter from its own gradient and state (AdamW, Adafactor, Muon), or "
                "move the cross-parameter part (a global norm, say) into gradient clipping: "
                "Trainer(gradient_clip_val=...); strategy='auto' steps it as it is.")
    kept = [name for name in sorted(attributes) if not _keepable(together[-1][0].attributes.get(name))]
    if kept:
        raise UnsupportedOptimizerError(
            f"{cls.__name__} changes its attribute(s) {kept} at every step, of a kind greedysnake cannot keep per "
            "unit (a plain number, string or tensor it can). Fix: use torch.optim.AdamW, or strategy='auto' for this "
            "optimizer.")
    return CallState(tuple(sorted(group_keys)), tuple(sorted(a.removeprefix("state:") for a in attributes
                                                             if a.startswith("state:"))),
                     tuple(sorted(a for a in attributes if not a.startswith("state:"))))


def _check_closure(optimizer: torch.optim.Optimizer, gi: int, shapes: list[tuple[int, ...]], start: list[Tensor],
                   grads: list[list[Tensor]], without: list[list[_Seen]]) -> None:
    """Raise where the optimizer needs the closure Lightning gives its ``step()``: one that calls it more
    than once a step (re-evaluates the loss, as LBFGS or SAM do), or whose step depends on the loss it
    returns (greedysnake's per-unit steps get no closure: stepped with two different losses, and without
    one, it must do the same)."""
    cls = type(optimizer)
    for loss in (1.0, 3.0):
        _, steps = _run(optimizer, gi, [t.clone().requires_grad_() for t in start], grads, True, shapes, loss)
        for step, ((got,), (ref,)) in enumerate(zip(steps, without, strict=True), start=1):
            if got.closure_calls > 1:
                raise UnsupportedOptimizerError(
                    f"{cls.__name__} calls the closure {got.closure_calls} times a step (it re-evaluates the loss), "
                    "which greedysnake's one forward and backward per micro-batch cannot do. Fix: use an optimizer "
                    "that steps from the gradients alone (AdamW, say), or strategy='auto' for this one.")
            if not _same_seen(got, ref):
                raise UnsupportedOptimizerError(
                    f"{cls.__name__} reads the loss the closure returns (its step {step} differs with the loss "
                    "value), which greedysnake's per-unit steps cannot give it: they run after the window's "
                    "backward, without a closure. Fix: use an optimizer that steps from the gradients alone "
                    "(AdamW, say), or strategy='auto' for this one.")


def _same_seen(a: _Seen, b: _Seen) -> bool:
    """Two probe optimizers over the same parameters hold the same after a step: weights, state, group and
    attributes."""
    return (all(_same(x, y) and _same(sx, sy) for (x, sx), (y, sy) in zip(a.params, b.params, strict=True))
            and _same(a.group, b.group) and _same(a.attributes, b.attributes))


def _keepable(value: Any) -> bool:
    return plain(value) or type(value) is Tensor


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    """Equal up to rounding: tensors, numbers and containers of them, compared member by member."""
    if isinstance(a, Tensor) and isinstance(b, Tensor) and (type(a) is not Tensor or type(b) is not Tensor):
        try:
            return _same(a.dequantize() if hasattr(a, "dequantize") else torch.as_tensor(a).as_subclass(Tensor),
                         b.dequantize() if hasattr(b, "dequantize") else torch.as_tensor(b).as_subclass(Tensor))
        except Exception:  # noqa: BLE001 - a subclass that cannot be read as values: its kind decides (refused)
            return True
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.shape != b.shape:
            return False
        if a.is_floating_point() or b.is_floating_point() or a.is_complex() or b.is_complex():
            x = a.to(torch.complex64 if a.is_complex() else torch.float32)
            y = b.to(torch.complex64 if b.is_complex() else torch.float32)
            # rounding is relative to the values' size: D-Adaptation's estimates start near 1e-9
            scale = float(torch.maximum(x.abs().max(), y.abs().max()).nan_to_num(0.0)) if x.numel() else 0.0
            return bool(torch.allclose(x, y, rtol=1e-5, atol=1e-7 * scale, equal_nan=True))
        return bool(torch.equal(a, b))
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return False
    if isinstance(a, (list, tuple, collections.deque)) and isinstance(b, (list, tuple, collections.deque)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type) and not callable(a):
        return _same(vars(a), vars(b))  # (state kept in objects: Shampoo's preconditioners, by their fields)
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an object that cannot say: taken as different
        return False


def _whole_parameter_slots(optimizer: torch.optim.Optimizer, shapes: dict[int, list[tuple[int, ...]]]) -> tuple[str, ...]:
    """The state names shaped like their parameter (fp32) on the run's shapes: the slots that stream."""
    cls = type(optimizer)
    slots: list[str] = []
    for gi, group_shapes in shapes.items():
        probe_shapes = [_scaled(s) for s in group_shapes]
        params = [torch.zeros(s, requires_grad=True) for s in probe_shapes]
        grads = [[torch.full(s, 0.5) for s in probe_shapes]] * 2
        _, after = _run(optimizer, gi, params, grads, True, group_shapes)
        for p, state in after[-1][0].params:
            for name, value in state.items():
                if not isinstance(value, Tensor) or value.shape != p.shape or value.dim() == 0:
                    continue  # kept in host memory with the step counters (Adafactor's row/column variances)
                if type(value) is not Tensor:
                    kind = type(value).__name__
                    raise UnsupportedOptimizerError(
                        f"{cls.__name__} keeps state {name!r} as a {kind}, a tensor subclass greedysnake cannot flatten "
                        "per element, so it cannot be streamed per unit. Fix: use torch.optim.AdamW (offload."
                        "optimizer_state_dtype=bfloat16 halves the state bytes) or torchao's AdamW8bit/AdamW4bit."
                        if not hasattr(value, "__tensor_flatten__") else
                        f"{cls.__name__} keeps state {name!r} as a {kind}, a tensor subclass greedysnake streams only "
                        f"for the element-wise optimizers it lists, and {cls.__name__} is not one. Fix: use "
                        "torch.optim.AdamW (offload.optimizer_state_dtype=bfloat16 halves the state bytes), torchao's "
                        f"AdamW8bit/AdamW4bit, or optimizer_path='element_wise' if {cls.__name__} computes every "
                        "element from that element alone.")
                if value.dtype != torch.float32:
                    raise UnsupportedOptimizerError(
                        f"{cls.__name__} keeps state {name!r} in {value.dtype}; greedysnake streams fp32 per-element "
                        "state. Fix: use torch.optim.AdamW, or an optimizer keeping fp32 state.")
                if name not in slots:
                    slots.append(name)
    return tuple(slots)
