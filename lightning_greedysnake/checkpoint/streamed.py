"""Lightning checkpoints of state that lives in the tensor manager, moved one unit at a time.

Saving: the strategy hands Lightning's checkpoint dict placeholders for every unit's parameters and
optimizer state (:class:`StreamedTensor`, :data:`STREAMED_STATE`); :func:`save_streamed` then writes each
unit's weights and optimizer state straight from the tensor manager into its own file, so no more than
one unit is ever gathered in memory. Loading (after the strategy's setup, when the tensor manager
exists) goes the other way, matching parameters by name, so a checkpoint loads into a different
``layers_per_unit`` or placement, and a plain Lightning checkpoint file (from ``strategy="auto"``) loads too.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_greedysnake.checkpoint.format import (
    TRAINER_STATE,
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    save_error,
)
from lightning_greedysnake.layout import UnitLayout

UnitEntries = dict[int, dict[str, Any]]
"""A unit's optimizer state per parameter, keyed by the parameter's index in the unit's layout."""


class StateSource(Protocol):
    """What a save streams from: the tensor manager, or a view of it that gathers partitioned state."""

    @property
    def num_units(self) -> int: ...

    @property
    def layouts(self) -> Sequence[UnitLayout]: ...

    @property
    def params(self) -> list[list[nn.Parameter]]: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    def drain(self) -> None:
        """Complete every pending update first."""

    def unit_master_weights(self, u: int) -> list[Tensor]: ...

    def unit_optimizer_state(self, u: int) -> UnitEntries: ...


class StateSink(Protocol):
    """What a load streams into: the tensor manager."""

    @property
    def num_units(self) -> int: ...

    @property
    def layouts(self) -> Sequence[UnitLayout]: ...

    def load_unit_weights(self, u: int, values: list[Tensor]) -> None: ...

    def load_unit_optimizer_state(self, u: int, entries: UnitEntries) -> None: ...

    def load_optimizer_state(self, state: dict[int, dict[str, Any]]) -> None: ...

    def load_calls(self) -> None: ...

    def flush(self) -> None: ...

STATE_DICT = "state_dict"
OPTIMIZER_STATES = "optimizer_states"
OPTIMIZER_LEVEL_STATE = "greedysnake_optimizer_level_state"
"""An optimizer state dict's entries of ``state`` under keys that are no parameter (MADGRAD's ``k``), kept
beside the streamed per-parameter state."""


@dataclass(frozen=True)
class StreamedTensor:
    """A parameter whose value the tensor manager holds; the checkpoint save streams it from there."""

    unit: int
    index: int
    shape: tuple[int, ...]


class _StreamedState:
    """The ``state`` of an optimizer's state dict, streamed from the tensor manager at save."""

    def __repr__(self) -> str:
        return "<optimizer state streamed unit by unit by greedysnake>"


STREAMED_STATE = _StreamedState()


class StreamedStateDict(dict):  # type: ignore[type-arg]
    """A loaded checkpoint's state dict: its small entries (buffers) in memory, the parameters read
    unit by unit when the strategy loads them."""

    def __init__(self, reader: CheckpointReader, small: Mapping[str, Tensor]) -> None:
        super().__init__(small)
        self.reader = reader


class StreamedOptimizerState(dict):  # type: ignore[type-arg]
    """A loaded checkpoint's optimizer ``state``, read unit by unit when the strategy loads it."""

    def __init__(self, reader: CheckpointReader) -> None:
        super().__init__()
        self.reader = reader


def parameter_aliases(module: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """The other names under which ``module``'s state dict holds a parameter it names first in ``names``, each
    with that first name (GPT-2's head tied to its embedding: ``lm_head.weight`` -> ``transformer.wte.weight``).
    A checkpoint stores such a parameter once and lists its aliases; a load sets it once, by its first name."""
    first = {id(p): n for n, p in module.named_parameters()}
    wanted = set(names)
    return {n: first[id(p)] for n, p in module.named_parameters(remove_duplicate=False)
            if first[id(p)] != n and first[id(p)] in wanted}


def model_file(u: int) -> str:
    return f"model/unit_{u:05d}.safetensors"


def optimizer_file(u: int) -> str:
    return f"optimizer/unit_{u:05d}.safetensors"


EXTRA_FILE = "model/extra.safetensors"
_SEP = "::"


def optimizer_entries(tensors: Mapping[str, Tensor], meta: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """An optimizer file's state per parameter name (as :func:`_save_unit` writes it): its tensors (keys
    ``name::slot``), then its scalars (JSON in the metadata)."""
    entries: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        name, _, slot = key.rpartition(_SEP)
        entries.setdefault(name, {})[slot] = value
    for name, scalars in json.loads(meta.get("scalars", "{}")).items():
        entries.setdefault(name, {}).update(scalars)
    for name, keys in json.loads(meta.get("objects", "{}")).items():
        for key in keys:
            raw = entries[name][key].numpy().tobytes()
            entries[name][key] = torch.load(io.BytesIO(raw), weights_only=True)
    return entries


def _json_ready(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _as_bytes(value: Any) -> Tensor:
    """State kept in containers of tensors (SOAP's and Shampoo's lists of matrices), in torch's own
    serialization, as a byte tensor (read back with ``weights_only``: tensors and containers only)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:  # noqa: BLE001 - said before a checkpoint holds what no load could read
        raise CheckpointError(
            f"the optimizer keeps state of type {type(value).__name__} that a checkpoint cannot hold for a safe load "
            f"(torch.load(weights_only=True): {e}). Fix: ModelCheckpoint(save_weights_only=True), or an optimizer "
            "whose state is tensors and numbers.") from e
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


@dataclass(frozen=True)
class SavedState:
    """What a save wrote, to reuse its files for the next save of the same state (Lightning's
    ``save_last`` saves the state a top-k checkpoint has just saved again, under another name)."""

    path: str
    payload: str
    version: Any
    files: dict[str, dict[str, Any]]


def _reusable(previous: SavedState | None, version: Any) -> CheckpointReader | None:
    if previous is None or version is None or previous.version != version:
        return None
    try:
        reader = CheckpointReader(previous.path)
    except CheckpointError:
        return None
    return reader if str(reader.payload) == previous.payload else None


def save_streamed(manager: StateSource, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                  layered_prefix: str, precision: str, version: Any = None,
                  previous: SavedState | None = None) -> SavedState:
    """Write Lightning's ``checkpoint`` dict to ``path`` in the checkpoint format, streaming every unit's
    weights and optimizer state from ``manager`` (drained first: deferred updates are applied).

    ``version`` identifies the state (e.g. the optimizer step); when ``previous`` saved the same
    version and its payload is still published, its unit files are hard-linked instead of written
    again."""
    manager.drain()
    writer = CheckpointWriter(path)
    reuse = _reusable(previous, version)
    try:
        state_dict = checkpoint.get(STATE_DICT, {})
        small = {n: v for n, v in state_dict.items() if isinstance(v, Tensor)}
        # (a parameter under a second name, a tied head: stored once, by its unit's name, and listed)
        aliases = {n: manager.layouts[v.unit].params[v.index].name for n, v in state_dict.items()
                   if isinstance(v, StreamedTensor) and manager.layouts[v.unit].params[v.index].name != n}
        optimizer_states = checkpoint.get(OPTIMIZER_STATES)
        params: dict[str, dict[str, Any]] = {}
        with_optimizer = optimizer_states is not None and manager.optimizer is not None
        for u in range(manager.num_units):
            names = [slot.name for slot in manager.layouts[u].params]
            wanted = [model_file(u)] + ([optimizer_file(u)] if with_optimizer else [])
            if reuse is not None and all(rel in reuse.files for rel in wanted) and all(
                    writer.link_from(reuse.payload, rel, reuse.files[rel]) for rel in wanted):
                for name in names:
                    params[name] = reuse.manifest["params"][name]
                continue
            params.update(_save_unit(manager, writer, u, names, with_optimizer))
        if small:
            writer.write_tensors(EXTRA_FILE, small)
        rest = {k: v for k, v in checkpoint.items() if k not in (STATE_DICT, OPTIMIZER_STATES)}
        if optimizer_states is not None:
            rest[OPTIMIZER_STATES] = [{k: v for k, v in s.items() if k != "state"} for s in optimizer_states]
        writer.write_object(TRAINER_STATE, rest)
        writer.publish({
            "params": params, "extra": sorted(small), "aliases": aliases, "num_units": manager.num_units,
            "optimizer": with_optimizer,
            "layered_prefix": layered_prefix, "precision": precision,
            # the optimizer's parameter order (its state dict keys are positions in it): what it takes
            # to rebuild a plain torch.optim state dict (export --lightning)
            "optimizer_params": _optimizer_param_names(manager) if with_optimizer else [],
        })
    except OSError as e:
        writer.abort()
        wrapped = save_error(writer.path, writer.payload, e)
        if wrapped is e:
            raise
        raise wrapped from e
    except BaseException:
        writer.abort()
        raise
    return SavedState(str(path), str(writer.payload), version, dict(writer.files))


def _optimizer_param_names(manager: StateSource) -> list[str | None]:
    assert manager.optimizer is not None
    names = {id(p): slot.name for u in range(manager.num_units)
             for p, slot in zip(manager.params[u], manager.layouts[u].params, strict=True)}
    return [names.get(id(p)) for g in manager.optimizer.param_groups for p in g["params"]]


def _save_unit(manager: StateSource, writer: CheckpointWriter, u: int, names: list[str], with_optimizer: bool
               ) -> dict[str, dict[str, Any]]:
    """Write unit ``u``'s files; its tensors are dropped on return (one unit in memory at a time)."""
    values = manager.unit_master_weights(u)
    writer.write_tensors(model_file(u), dict(zip(names, values)))
    index = {name: {"unit": u, "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
             for name, v in zip(names, values)}
    del values
    if with_optimizer:
        tensors: dict[str, Tensor] = {}
        scalars: dict[str, dict[str, Any]] = {}
        objects: dict[str, list[str]] = {}
        for i, entry in manager.unit_optimizer_state(u).items():
            for key, value in entry.items():
                if isinstance(value, Tensor):
                    tensors[f"{names[i]}{_SEP}{key}"] = value
                elif _json_ready(value):
                    scalars.setdefault(names[i], {})[key] = value
                else:
                    tensors[f"{names[i]}{_SEP}{key}"] = _as_bytes(value)
                    objects.setdefault(names[i], []).append(key)
        writer.write_tensors(optimizer_file(u), tensors, {"scalars": json.dumps(scalars), "objects": json.dumps(objects)})
    return index


def load_streamed(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Lightning's checkpoint dict from ``path``, with the model and optimizer state left on disk (the
    strategy's ``load_model_state_dict`` / ``load_optimizer_state_dict`` stream them in)."""
    reader = CheckpointReader(path)
    checkpoint = reader.read_object(TRAINER_STATE)
    small = reader.read_tensors(EXTRA_FILE) if EXTRA_FILE in reader.files else {}
    checkpoint[STATE_DICT] = StreamedStateDict(reader, small)
    if reader.manifest.get("optimizer"):
        for state in checkpoint.get(OPTIMIZER_STATES, []):
            state["state"] = StreamedOptimizerState(reader)
    return checkpoint


class _UnitFiles:
    """Reads a checkpoint's per-unit files by parameter name, one file at a time in the caller's hands,
    the next one (of ``order``) read and checksummed ahead on a background thread. Units are read in
    order, so with the same unit split every file is read exactly once. Use as a context manager."""

    def __init__(self, reader: CheckpointReader, order: list[str]) -> None:
        self.reader = reader
        self._order = [rel for rel in dict.fromkeys(order) if rel in reader.files]
        self._rel: str | None = None
        self._tensors: dict[str, Tensor] = {}
        self._meta: dict[str, str] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="greedysnake-checkpoint")
        self._ahead: dict[str, Future[tuple[dict[str, Tensor], dict[str, str]]]] = {}
        self._read_ahead(0)

    def _read_ahead(self, index: int) -> None:
        if index < len(self._order) and self._order[index] not in self._ahead:
            rel = self._order[index]
            self._ahead[rel] = self._pool.submit(self.reader.read_tensors_and_metadata, rel)

    def open(self, rel: str) -> tuple[dict[str, Tensor], dict[str, str]]:
        if rel != self._rel:
            self._tensors, self._meta = {}, {}
            future = self._ahead.pop(rel, None)
            if rel in self._order:
                self._read_ahead(self._order.index(rel) + 1)
            self._tensors, self._meta = future.result() if future is not None else \
                self.reader.read_tensors_and_metadata(rel)
            self._rel = rel
        return self._tensors, self._meta

    def __enter__(self) -> _UnitFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for future in self._ahead.values():
            future.cancel()
        self._pool.shutdown(wait=True)
        self._ahead.clear()


def _names_check(path: Any, expected: list[str], found: set[str], strict: bool) -> None:
    missing = [n for n in expected if n not in found]
    unexpected = sorted(found - set(expected))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint {path} does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}. "
            "Fix: load it into the model it was saved from, or pass strict_loading=False on the LightningModule."
        )


def shapes_check(path: Any, expected: Mapping[str, Sequence[int]], found: Mapping[str, Sequence[int]]) -> None:
    """Refuse a checkpoint (at ``path``) whose parameters have other shapes (``found``) than the model's of
    the same names (``expected``; names in only one of them are :func:`_names_check`'s), before anything
    is loaded: a wider or narrower model, never a bare size mismatch halfway through the load."""
    wrong = [(n, tuple(found[n]), tuple(shape)) for n, shape in expected.items()
             if n in found and tuple(found[n]) != tuple(shape)]
    if not wrong:
        return
    first, saved, model = wrong[0]
    others = f" (and {len(wrong) - 1} more: {[n for n, _, _ in wrong[1:8]]})" if len(wrong) > 1 else ""
    raise CheckpointError(
        f"checkpoint {path} does not fit the model: parameter {first} has shape {list(saved)} in the checkpoint "
        f"but {list(model)} in the model{others}: it was saved from a model of another size. Fix: build "
        "the model with the configuration the checkpoint was saved with (its hyperparameters), or load another "
        "checkpoint; to start a differently shaped model from it, convert its weights yourself."
    )


def load_model_into(manager: StateSink, module: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool,
                    source: Any = None) -> None:
    """Put a checkpoint's weights into the tensor manager unit by unit (and the rest, buffers and any
    parameter outside the units, into the module). ``source``: where an in-memory ``state_dict`` was read
    from, for messages (a checkpoint directory names itself)."""
    unit_names = [slot.name for u in range(manager.num_units) for slot in manager.layouts[u].params]
    unit_shapes = {slot.name: slot.shape for u in range(manager.num_units) for slot in manager.layouts[u].params}
    if isinstance(state_dict, StreamedStateDict):
        reader = state_dict.reader
        index = reader.manifest["params"]
        _names_check(reader.path, unit_names, set(index), strict)
        shapes_check(reader.path, unit_shapes, {n: info["shape"] for n, info in index.items() if "shape" in info})
        order = [model_file(index[s.name]["unit"]) for u in range(manager.num_units)
                 for s in manager.layouts[u].params if s.name in index]
        with _UnitFiles(reader, order) as files:
            for u in range(manager.num_units):
                slots = manager.layouts[u].params
                if not all(s.name in index for s in slots):
                    continue  # non-strict: the unit keeps its current values
                values = []
                for slot in slots:
                    rel = model_file(index[slot.name]["unit"])
                    tensors, _ = files.open(rel)
                    if slot.name not in tensors:
                        raise CheckpointError(
                            f"checkpoint {reader.path}: the manifest places {slot.name} in {reader.payload / rel}, "
                            "which does not hold it (a damaged manifest). Fix: load the previous checkpoint."
                        )
                    values.append(tensors[slot.name])
                manager.load_unit_weights(u, values)
                del values
        rest: Mapping[str, Any] = dict(state_dict)
    else:
        missing = [n for n in unit_names if n not in state_dict]
        if strict and missing:
            raise CheckpointError(f"state_dict is missing {missing[:8]}. Fix: load the model it was saved from.")
        shapes_check(source if source is not None else "state_dict", unit_shapes,
                     {n: v.shape for n, v in state_dict.items() if isinstance(v, Tensor)})
        for u in range(manager.num_units):
            slots = manager.layouts[u].params
            if all(s.name in state_dict for s in slots):
                manager.load_unit_weights(u, [state_dict[s.name] for s in slots])
        # (a unit parameter's second name, a tied head, is set with it: never copied into its placeholder)
        taken = set(unit_names) | set(parameter_aliases(module, unit_names))
        rest = {k: v for k, v in state_dict.items() if k not in taken}
    manager.flush()
    # buffers (and anything else outside the units) load the usual way; the units' parameters are
    # placeholders in the module, so they are reported missing here by design
    result = module.load_state_dict(dict(rest), strict=False)
    unexpected = [k for k in result.unexpected_keys]
    if strict and unexpected:
        raise CheckpointError(f"checkpoint has entries the model does not: {unexpected[:8]}.")


def load_optimizer_into(manager: StateSink, optimizer: torch.optim.Optimizer, opt_state: Mapping[str, Any]) -> None:
    """Hyperparameters to the user's optimizer, per-parameter state into the units."""
    # hyperparameters (and LR-scheduler bookkeeping such as initial_lr) go to the user's optimizer
    optimizer.load_state_dict({"state": dict(opt_state.get(OPTIMIZER_LEVEL_STATE, {})),
                               "param_groups": opt_state["param_groups"]})
    manager.load_calls()  # (per-call entries of the groups, pytorch-optimizer's group['step'], into every unit)
    state = opt_state["state"]
    if not isinstance(state, StreamedOptimizerState):
        manager.load_optimizer_state({int(k): v for k, v in state.items()})
        return
    reader = state.reader
    index = reader.manifest["params"]
    order = [optimizer_file(index[s.name]["unit"]) for u in range(manager.num_units)
             for s in manager.layouts[u].params if s.name in index and s.group is not None]
    parsed: dict[str, dict[str, dict[str, Any]]] = {}  # (the open file's entries, parsed once)
    with _UnitFiles(reader, order) as files:
        for u in range(manager.num_units):
            entries: dict[int, dict[str, Any]] = {}
            for i, slot in enumerate(manager.layouts[u].params):
                if slot.name not in index or slot.group is None:
                    continue
                rel = optimizer_file(index[slot.name]["unit"])
                if rel not in parsed:
                    parsed = {rel: optimizer_entries(*files.open(rel))}
                entry = parsed[rel].get(slot.name)
                if entry:
                    entries[i] = entry
            if entries:
                manager.load_unit_optimizer_state(u, entries)
    manager.flush()
