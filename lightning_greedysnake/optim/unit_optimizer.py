"""Steps one unit's parameters with the user's own optimizer class over flat per-unit buffers.

Instead of re-implementing AdamW, each unit gets a *shadow* instance of the class returned by
``configure_optimizers``: its parameters are leaf tensors whose data and gradients are set, per step, to
views into the unit's flat master and gradient buffers, and its per-element state (Adam's moments, SGD's
momentum) to views into the unit's flat state buffers. So the numerics are torch's own, kernel for kernel
(``fused=True`` included), and every hyperparameter, param group and LR-schedule change on the user's
optimizer is copied over before each step.

Which pieces a shadow optimizer sees is the optimizer's contract (:mod:`~lightning_greedysnake.optim.
contract`): flat slices cut at any element for element-wise optimizers, or whole parameters viewed in
their own shapes (``whole_parameters``), the unit's split and the ranks' chunks then on parameter starts.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_greedysnake.layout import ParamSlot, UnitLayout, split_numel

__all__ = ["CallState", "FlatState", "PieceState", "UnitOptimizer", "UnsupportedOptimizerError", "construct_like",
           "discover_slots", "split_numel"]


class UnsupportedOptimizerError(ValueError):
    pass


PROBE_NUMEL = 1 << 16


_OPTIMIZER_INTERNALS = frozenset({"defaults", "state", "param_groups"})


def plain(value: Any) -> bool:
    """A configuration value copied between optimizer instances as it is (no tensor, no container that
    could hold one)."""
    return isinstance(value, (bool, int, float, str, type(None))) or (
        isinstance(value, tuple) and all(plain(v) for v in value))


def configuration(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's plain instance attributes (pytorch-optimizer's ``maximize``, ``n_sma_threshold``):
    configuration its constructor took and keeps outside the param groups."""
    return {k: v for k, v in vars(optimizer).items()
            if k not in _OPTIMIZER_INTERNALS and not k.startswith("_") and plain(v)}


def construct_like(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """A new instance of ``optimizer``'s class over ``groups``, configured as ``optimizer`` is.

    The constructor is also given, by name, the first group's hyperparameters and the optimizer's plain
    attributes it accepts: a constructor that requires its ``lr`` (came-pytorch's CAME asserts ``lr > 0``)
    or validates a keyword, and state made at construction (Adagrad's ``initial_accumulator_value``), see
    the user's values, not the defaults. Any plain attribute that still differs (configuration the
    constructor took under another name) is then copied over."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    attributes = configuration(optimizer)
    kwargs: dict[str, Any] = {}
    for name, parameter in list(accepted.items())[1:]:  # (self)
        if name == "params" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name in groups[0]:
            kwargs[name] = groups[0][name]
        elif name in attributes:
            kwargs[name] = attributes[name]
    made = cls(groups, **kwargs)
    for name, value in attributes.items():
        if getattr(made, name, None) != value:
            setattr(made, name, value)
    return made


@dataclass(frozen=True)
class CallState:
    """What an optimizer keeps outside ``state[p]`` and changes at every ``step()`` the same way whatever
    parameters it steps (a per-call counter, as the contract's probe shows): entries of its param groups
    (pytorch-optimizer's ``group['step']``), entries of its ``state`` under keys that are not parameters
    (MADGRAD's ``state['k']``) and plain attributes. Each part keeps its own copy, given to its shadow optimizer
    before every step and taken back after it, so every part counts what the user's optimizer would;
    checkpoints save the group entries in the param groups and the state entries beside the state, as
    ``torch.optim`` does."""

    group_keys: tuple[str, ...] = ()
    state_keys: tuple[str, ...] = ()
    attributes: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.group_keys or self.state_keys or self.attributes)


_STATE = "state:"


def _copied(value: Any) -> Any:
    """A copy that shares nothing another part could change in place (a tensor, or a container of state)."""
    if isinstance(value, Tensor):
        return value.clone()
    return copy.deepcopy(value) if isinstance(value, (list, dict, set)) else value


def discover_slots(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """Names of the optimizer's per-element state, found by stepping a probe parameter once per group.

    Per-element state (a tensor shaped like the parameter, or a tensor subclass of that shape that
    flattens into inner tensors, as torchao's quantized state does: see
    :mod:`~lightning_greedysnake.optim.subclass_state`) is what streams through the state tier; scalar
    state (step counters) stays in host memory. Anything else cannot be cut per element and is refused.
    A 1-D probe: it finds the slots of an optimizer already known to work element by element, never
    whether it does (:func:`~lightning_greedysnake.optim.contract.optimizer_contract` decides that).
    """
    cls = type(optimizer)
    slots: list[str] = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        # large enough that optimizers quantizing only large parameters (torchao's low-bit AdamW) show it
        probe = torch.zeros(PROBE_NUMEL, dtype=torch.float32, requires_grad=True)
        try:
            shadow = construct_like(optimizer, [{**hyper, "params": [probe]}])
            probe.grad = torch.full_like(probe, 0.5)
            shadow.step()
        except Exception as e:  # noqa: BLE001 - reported with the optimizer's name
            raise UnsupportedOptimizerError(
                f"greedysnake could not step {cls.__name__} per unit ({type(e).__name__}: {e}). It re-creates "
                "the optimizer class per unit from its param groups. Fix: use torch.optim.AdamW, Adam or SGD."
            ) from e
        for name, value in shadow.state[probe].items():
            if isinstance(value, Tensor) and type(value) is not Tensor:
                if value.shape == probe.shape and hasattr(value, "__tensor_flatten__"):
                    if name not in slots:
                        slots.append(name)  # quantized state (torchao): streamed by its components
                    continue
                raise UnsupportedOptimizerError(
                    f"{cls.__name__} keeps state {name!r} as a {type(value).__name__} of shape "
                    f"{tuple(value.shape)}, a tensor subclass greedysnake cannot flatten per element, so it "
                    "cannot be streamed per unit. Fix: use torch.optim.AdamW (offload.optimizer_state_dtype="
                    "bfloat16 halves the state bytes) or torchao's AdamW8bit/AdamW4bit."
                )
            if isinstance(value, Tensor) and value.shape == probe.shape:
                if value.dtype != torch.float32:
                    raise UnsupportedOptimizerError(
                        f"{cls.__name__} keeps state {name!r} in {value.dtype}; greedysnake streams fp32 "
                        "per-element state. Fix: use torch.optim.AdamW, Adam or SGD."
                    )
                if name not in slots:
                    slots.append(name)
            elif isinstance(value, Tensor) and value.numel() > 1:
                raise UnsupportedOptimizerError(
                    f"{cls.__name__} keeps state {name!r} of shape {tuple(value.shape)} for a parameter of "
                    f"shape {tuple(probe.shape)}: not per-element, so it cannot be streamed per unit. Fix: use "
                    "torch.optim.AdamW, Adam or SGD."
                )
    return tuple(slots)


def _stand_in(shape: tuple[int, ...]) -> Tensor:
    """A leaf of ``shape`` over one element (stride 0): what a shadow optimizer is built over, so a class
    that checks its parameters' shapes at construction (Muon: 2-D only) sees the real ones, for no memory;
    each step points its ``.data`` at the real values."""
    return torch.zeros(1).as_strided(shape, (0,) * len(shape)).requires_grad_()


class _Part:
    """One element range of a unit with its own shadow optimizer over the pieces of parameters in it.

    Each piece is a flat slice of one parameter (element-wise optimizers: Adam, AdamW, SGD compute on a
    slice exactly what they compute on the whole parameter, and every piece of a parameter is stepped
    once per iteration, so their step counters agree), or with ``whole_parameters`` one whole parameter,
    stepped in its own shape."""

    def __init__(self, optimizer: torch.optim.Optimizer, pieces: list[tuple[int, ParamSlot, int, int]],
                 whole_parameters: bool = False, calls: CallState = CallState()) -> None:
        self.pieces = pieces  # (trainable index, slot, flat start, flat end)
        self.shadow_params = [_stand_in(slot.shape if whole_parameters else (1,)) for _, slot, _, _ in pieces]
        self.group_index: list[int] = []
        groups: list[dict[str, Any]] = []
        for gi, group in enumerate(optimizer.param_groups):
            members = [sp for sp, (_, slot, _, _) in zip(self.shadow_params, pieces) if slot.group == gi]
            if members:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
                self.group_index.append(gi)
        self.shadow = construct_like(optimizer, groups) if groups else None
        if self.shadow is not None:
            self.shadow.state.clear()  # (state made at construction, Adagrad's, is the stand-ins': a piece's is made at its first step)
        self.scalar_state: list[dict[str, Any]] = [{} for _ in pieces]
        self.streamed: list[tuple[str, ...] | None] = [None] * len(pieces)
        """Per piece, the state names its step keeps in the streamed state buffers (None: every slot);
        the rest of its state is in ``scalar_state``."""
        self.initialized: list[bool] = [False] * len(pieces)
        self.steps = 0
        """Steps of this part in this process (the step number where the optimizer keeps none)."""
        self.calls = calls
        self.group_calls: dict[int, dict[str, Any]] = {}
        """Per user param group in this part, its per-call entries (:class:`CallState`) as this part's last
        step left them (a key absent: not made yet; the optimizer makes it at its first step)."""
        self.attribute_calls: dict[str, Any] = {}
        """The per-call attributes, and state entries under the keys that are not parameters, as this part's
        last step left them (state entries keyed ``state:<key>``)."""
        self.load_calls(optimizer)

    def load_calls(self, source: torch.optim.Optimizer) -> None:
        """Take the per-call entries and attributes from ``source`` (the user's optimizer: as constructed,
        or as a checkpoint loaded it)."""
        groups = source.param_groups
        self.group_calls = {gi: {k: _copied(groups[gi][k]) for k in self.calls.group_keys if k in groups[gi]}
                            for gi in self.group_index}
        self.attribute_calls = {a: _copied(getattr(source, a)) for a in self.calls.attributes if hasattr(source, a)}
        self.attribute_calls.update({_STATE + k: _copied(source.state[k]) for k in self.calls.state_keys
                                     if k in source.state})

    def enter_calls(self) -> None:
        """The shadow optimizer's per-call entries set to this part's, before one ``step()``."""
        assert self.shadow is not None
        for group, gi in zip(self.shadow.param_groups, self.group_index):
            for key in self.calls.group_keys:
                if key in self.group_calls[gi]:
                    group[key] = _copied(self.group_calls[gi][key])
                else:
                    group.pop(key, None)
        for key in self.calls.state_keys:
            self.shadow.state.pop(key, None)
        for name, value in self.attribute_calls.items():
            if name.startswith(_STATE):
                self.shadow.state[name.removeprefix(_STATE)] = _copied(value)
            else:
                setattr(self.shadow, name, _copied(value))

    def leave_calls(self) -> None:
        """This part's per-call entries taken from the shadow optimizer after its step."""
        assert self.shadow is not None
        for group, gi in zip(self.shadow.param_groups, self.group_index):
            self.group_calls[gi] = {k: _copied(group[k]) for k in self.calls.group_keys if k in group}
        self.attribute_calls = {a: _copied(getattr(self.shadow, a)) for a in self.calls.attributes
                                if hasattr(self.shadow, a)}
        self.attribute_calls.update({_STATE + k: _copied(self.shadow.state[k]) for k in self.calls.state_keys
                                     if k in self.shadow.state})


class UnitOptimizer:
    """The optimizer for one unit: ``step`` updates the flat master buffer and state buffers in place,
    one part (element range) at a time."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, layout: UnitLayout, slots: tuple[str, ...], split: int | None = None,
        bounds: tuple[int, int] | None = None, *, whole_parameters: bool = False, eager_state: bool = False,
        calls: CallState = CallState(),
    ) -> None:
        """``whole_parameters``: every piece is a whole parameter (``split`` and ``bounds`` on parameter
        starts), given to the optimizer in its own shape; ``eager_state``: the optimizer makes a
        parameter's state when constructed (Adagrad's ``initial_accumulator_value``), so a piece's first
        step starts from the state a construction over it makes; ``calls``: the per-call state it keeps
        outside ``state[p]`` (:class:`CallState`), kept per part."""
        self.user_optimizer = optimizer
        self.whole_parameters = whole_parameters
        self.eager_state = eager_state
        self.calls = calls
        self.layout = layout
        self.slots = slots
        self.trainable: list[ParamSlot] = [p for p in layout.params if p.group is not None]
        self.bounds = bounds if bounds is not None else (0, layout.trained_numel)
        """The element range this process steps (data parallel with sharded state: its chunk)."""
        self.split = self.bounds[1] if split is None else split
        ranges = [(self.bounds[0], self.split), (self.split, self.bounds[1])]
        self.parts: list[_Part] = []
        for lo, hi in ranges:
            pieces = []
            for j, slot in enumerate(self.trainable):
                start, end = max(lo, slot.offset_numel), min(hi, slot.offset_numel + slot.numel)
                if start < end:
                    assert not whole_parameters or (start, end) == (slot.offset_numel, slot.offset_numel + slot.numel), (
                        f"{slot.name} cut at [{start}, {end}) for an optimizer stepped on whole parameters")
                    pieces.append((j, slot, start, end))
            self.parts.append(_Part(optimizer, pieces, whole_parameters, calls))

    @property
    def has_trainable(self) -> bool:
        return any(part.shadow is not None for part in self.parts)

    def part_range(self, part: int) -> tuple[int, int]:
        return (self.bounds[0], self.split) if part == 0 else (self.split, self.bounds[1])

    def part_initialized(self, part: int) -> bool:
        return any(self.parts[part].initialized)

    def step_number(self, part: int) -> int:
        """The optimizer's own step count of part ``part`` (Adam's ``step``), which checkpoints keep, or
        where it has none the steps taken in this process: seeds the state's stochastic rounding."""
        for scalars in self.parts[part].scalar_state:
            step = scalars.get("step")
            if step is not None:
                return int(step)
        return self.parts[part].steps

    # -- per-parameter view of the state (checkpoints) ----------------------------------------------
    def param_initialized(self, j: int) -> bool:
        return any(init for part in self.parts for (pj, *_), init in zip(part.pieces, part.initialized) if pj == j)

    def param_scalar_state(self, j: int) -> dict[str, Any]:
        for part in self.parts:
            for (pj, *_), init, scalars in zip(part.pieces, part.initialized, part.scalar_state):
                if pj == j and init:
                    return scalars
        return {}

    def pieces_of(self, j: int) -> list[tuple[dict[str, Any], int, int, int]]:
        """Trainable parameter j's pieces: (its scalar state, unit element range ``[lo, hi)``, group)."""
        return [(part.scalar_state[k], lo, hi, slot.group or 0)
                for part in self.parts for k, (pj, slot, lo, hi) in enumerate(part.pieces) if pj == j]

    def param_streamed(self, j: int) -> tuple[str, ...] | None:
        """The state names trainable parameter j keeps in the streamed buffers (None: every slot)."""
        for part in self.parts:
            for (pj, *_), init, streamed in zip(part.pieces, part.initialized, part.streamed):
                if pj == j and init:
                    return streamed
        return None

    def set_param_scalar_state(self, j: int, scalars: dict[str, Any], streamed: tuple[str, ...] | None = None) -> None:
        """Parameter j's state kept here (``streamed``: the names it keeps in the streamed buffers)."""
        for part in self.parts:
            for k, (pj, *_) in enumerate(part.pieces):
                if pj == j:
                    part.scalar_state[k] = {n: (v.clone() if isinstance(v, Tensor) else v) for n, v in scalars.items()}
                    part.streamed[k] = streamed
                    part.initialized[k] = True

    def snapshot(self) -> list[tuple[Any, ...]]:
        """The scalar state of every part (step counters, per-call state), for :meth:`restore` (speculative
        steps)."""
        return [([{k: _copied(v) for k, v in sc.items()} for sc in p.scalar_state], list(p.initialized),
                 list(p.streamed), p.steps, {gi: {k: _copied(v) for k, v in e.items()} for gi, e in p.group_calls.items()},
                 {k: _copied(v) for k, v in p.attribute_calls.items()}) for p in self.parts]

    def restore(self, snapshot: list[tuple[Any, ...]]) -> None:
        for part, (scalars, initialized, streamed, steps, group_calls, attribute_calls) in zip(
                self.parts, snapshot, strict=True):
            part.scalar_state, part.initialized, part.streamed, part.steps = scalars, initialized, streamed, steps
            part.group_calls, part.attribute_calls = group_calls, attribute_calls

    # -- per-call state (:class:`CallState`) ----------------------------------------------------------------
    def call_state(self) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        """The per-call entries, per user param group, and attributes, as this unit's parts left them (every
        part of a unit steps once a window, so they agree: the first part holding a group's is taken), as
        copies: the user's optimizer they are published into changes its own in place (MADGRAD's
        ``state['k'] += 1`` in the step Lightning calls)."""
        groups: dict[int, dict[str, Any]] = {}
        attributes: dict[str, Any] = {}
        for part in self.parts:
            if part.shadow is None:
                continue
            for gi, entries in part.group_calls.items():
                groups.setdefault(gi, {k: _copied(v) for k, v in entries.items()})
            for name, value in part.attribute_calls.items():
                attributes.setdefault(name, _copied(value))
        return groups, attributes

    def load_calls(self, source: torch.optim.Optimizer) -> None:
        """Every part's per-call state from ``source`` (:meth:`_Part.load_calls`)."""
        for part in self.parts:
            part.load_calls(source)

    def set_calls(self, groups: dict[int, dict[str, Any]], attributes: dict[str, Any]) -> None:
        """Every part's per-call state as :meth:`call_state` gave it (a re-split keeps it)."""
        for part in self.parts:
            part.group_calls = {gi: {k: _copied(v) for k, v in groups.get(gi, {}).items()} for gi in part.group_index}
            part.attribute_calls = {k: _copied(v) for k, v in attributes.items()}

    # -- stepping -----------------------------------------------------------------------------------
    def step(
        self,
        master: Tensor,
        grad: Tensor,
        state: PieceState,
        has_grad: list[bool],
        part: int = 0,
        hyper: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Step part ``part`` of this unit.

        ``master``/``grad``: the unit's flat fp32 buffers (``layout.numel`` elements; only the part's
        range is read); ``state``: the part's per-element state, piece by piece; ``has_grad[j]``: whether
        trainable parameter j got a gradient in this window (torch skips parameters without one, and so
        do we); ``hyper``: the user's param-group hyperparameters as they were when Lightning would have
        stepped (default: as they are now). Returns whether the step created state (a piece's first):
        new tensors, copied into ``state`` and freed.
        """
        p = self.parts[part]
        shadow = p.shadow
        if shadow is None:
            return False
        groups = hyper if hyper is not None else [
            {k: v for k, v in g.items() if k != "params"} for g in self.user_optimizer.param_groups
        ]
        keys = self.calls.group_keys
        for shadow_group, gi in zip(shadow.param_groups, p.group_index):
            # the LR in force at this step, as the LR scheduler left it; the per-call entries are the part's own
            shadow_group.update({k: v for k, v in groups[gi].items() if k not in keys})
        shaped = self._shaped
        for k, (sp, (j, slot, lo, hi)) in enumerate(zip(p.shadow_params, p.pieces)):
            sp.data = shaped(master[lo:hi], slot)
            if p.initialized[k]:
                kept = p.scalar_state[k]  # (and a slot the optimizer keeps in plain fp32 for this piece)
                names = p.streamed[k] if p.streamed[k] is not None else state.names
                pieces = {name: state.piece(name, lo, hi, slot.group) for name in names if name not in kept}
                shadow.state[sp] = {**kept, **{name: shaped(v, slot) for name, v in pieces.items() if v is not None}}
        # a piece's first step creates its state as new tensors, copied into our buffers after it: stepped
        # one piece at a time, so no more than one parameter's new state exists beside the buffers at once
        # (an optimizer on the contract's list computes each piece alike either way)
        stepped = [k for k, (j, *_) in enumerate(p.pieces) if has_grad[j]]
        fresh = [k for k in stepped if not p.initialized[k]]
        batches = [batch for batch in [[k for k in stepped if p.initialized[k]], *([k] for k in fresh)] if batch]
        if not batches and self.calls:
            batches = [[]]  # the user's optimizer is stepped every window, and counts the call without gradients
        try:
            for batch in batches:
                if self.calls:
                    p.enter_calls()  # each batch is one call of the user's step: the count from before it
                members = set(batch)
                for k, (sp, (_, slot, lo, hi)) in enumerate(zip(p.shadow_params, p.pieces)):
                    sp.grad = shaped(grad[lo:hi], slot) if k in members else None
                    if k in members and not p.initialized[k] and self.eager_state:
                        # the state its construction makes (Adagrad's sum at initial_accumulator_value)
                        made = construct_like(self.user_optimizer, [{**groups[slot.group or 0], "params": [sp]}])
                        shadow.state[sp] = dict(made.state.get(sp, {}))
                shadow.step()
                for k in batch:
                    self._keep(p, k, state)
            if self.calls:
                p.leave_calls()
        finally:
            # drop every reference into the caller's buffers: they go back to the pool after this
            shadow.state.clear()
            for sp in p.shadow_params:
                sp.grad = None
                sp.data = torch.zeros(1)
        p.steps += 1
        return bool(fresh)

    def _shaped(self, flat: Tensor, slot: ParamSlot) -> Tensor:
        """A piece's flat view as the optimizer sees it: in its parameter's shape on the whole-parameter
        path (the piece is the whole parameter), else as it is."""
        return flat.view(slot.shape) if self.whole_parameters else flat

    def _keep(self, p: _Part, k: int, state: PieceState) -> None:
        """Piece ``k``'s state after its step into our buffers (what does not fit there, such as
        Adafactor's row and column variances, is kept here in host memory), and out of the shadow
        optimizer (a first step's new tensors are freed once copied)."""
        sp, (_, slot, lo, hi) = p.shadow_params[k], p.pieces[k]
        assert p.shadow is not None
        st = p.shadow.state.pop(sp, None)
        if not st:
            return
        scalars, streamed = {}, []
        for name, value in st.items():
            # created on the first step, or replaced: keep it in our buffer where it fits there (shaped
            # like its parameter: per element)
            fits = not self.whole_parameters or (isinstance(value, Tensor) and value.shape == slot.shape)
            flat = value.reshape(-1) if self.whole_parameters and fits else value
            if name in state.names and fits and state.keep(name, lo, hi, flat, slot.group):
                streamed.append(name)
            else:
                scalars[name] = value
        p.scalar_state[k] = scalars
        p.streamed[k] = tuple(streamed)
        p.initialized[k] = True


class PieceState(Protocol):
    """One part's per-element optimizer state as :meth:`UnitOptimizer.step` reads and keeps it, piece by
    piece (``[lo, hi)``: unit elements of one parameter of param group ``group``)."""

    names: tuple[str, ...]

    def piece(self, name: str, lo: int, hi: int, group: int = 0) -> Tensor | None:
        """The state the optimizer is given (None: it keeps this piece's ``name`` itself, on the host)."""
        ...

    def keep(self, name: str, lo: int, hi: int, value: Tensor, group: int = 0) -> bool:
        """Store the stepped ``value`` (False: it does not belong here; the caller keeps it)."""
        ...


class FlatState:
    """fp32 state in flat per-slot buffers starting at unit element ``base``: a piece is a slice."""

    def __init__(self, buffers: dict[str, Tensor], base: int = 0) -> None:
        self.buffers = buffers
        self.base = base
        self.names = tuple(buffers)

    def piece(self, name: str, lo: int, hi: int, group: int = 0) -> Tensor:
        return self.buffers[name][lo - self.base : hi - self.base]

    def keep(self, name: str, lo: int, hi: int, value: Tensor, group: int = 0) -> bool:
        view = self.piece(name, lo, hi)
        if value.data_ptr() != view.data_ptr():  # created on the first step, or replaced by the optimizer
            view.copy_(value)
        return True
