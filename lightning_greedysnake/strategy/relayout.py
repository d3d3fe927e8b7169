"""``auto=True`` after the warm step (the second): move the state into larger units when this run's measured compute
says they are faster (setup chose ``layers_per_unit`` from the disks alone: it sees no batch).

The files are shaped by the unit size, so a re-layout opens a second tensor manager over units of the
new size beside the first, in the same offload directories (the first one's files renamed aside: its
open descriptors keep working), streams every unit's full-precision weights and optimizer state from
the old units into the new ones by parameter name, bit for bit, then closes the old manager and
removes its files. It runs only where it pays: the predicted saving over the steps left must cover
twice the copy's time (every SSD byte of the state read once and written once). Refused, with the
reason in the report, in data parallel runs (every rank would have to re-lay out together), under
fp16 (loss scaling), with an explicit ``buffer_budget_bytes`` the larger units' staging exceeds,
where the disks lack room for the second copy, and after an I/O error while copying; the run then goes
on in the units it has.

Threads: everything here runs on the training thread, between windows, with the old manager drained
(no optimizer step, read or write of it in flight).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_greedysnake.config import GreedySnakeConfig, TensorKind
from lightning_greedysnake.models import make_units
from lightning_greedysnake.offload.preflight import disk_free_bytes
from lightning_greedysnake.planner import Choice, Machine
from lightning_greedysnake.strategy.auto_plan import larger_units_note
from lightning_greedysnake.strategy.manager_setup import new_tensor_manager
from lightning_greedysnake.strategy.placement import plan_at_setup
from lightning_greedysnake.tensor_manager import TieredTensorStore, state_layout

PAYBACK = 2.0
"""The predicted saving over the steps left must be at least this many times the copy's time."""

ASIDE = ".relayout-old"
"""Suffix of the old manager's files while the new ones are written beside them (a run killed then
leaves them; the next run in the directory removes them with its other leftovers)."""


def steps_left(trainer: Any) -> float:
    """Optimizer steps still to run in this fit (``inf`` where the Trainer cannot tell)."""
    try:
        total = float(trainer.estimated_stepping_batches)
    except Exception:  # noqa: BLE001 - an iterable of unknown length, say: treat the run as long
        return math.inf
    return max(0.0, total - trainer.global_step)


def copy_seconds(manager: TieredTensorStore, machine: Machine) -> float:
    """Predicted time to copy the state: every SSD byte read once and written once."""
    nbytes = sum(manager.ssd_bytes().values())
    return nbytes / machine.read_bytes_per_s + nbytes / machine.write_bytes_per_s


def refusal(settings: GreedySnakeConfig, *, distributed: bool, loss_scaling: bool, choice: Choice,
            current: Choice, left: float, copy_s: float, resident_weights: bool = False) -> str | None:
    """Why the re-layout to ``choice`` does not happen (None: it does)."""
    if distributed:
        return "data parallel runs keep the unit size they started with"
    if loss_scaling:
        return "fp16 loss scaling keeps the unit size it started with"
    if resident_weights:
        return "compute weights resident on the device would need a second copy there while the state moves"
    budget = settings.offload.buffer_budget_bytes
    if budget is not None and choice.buffer_budget_bytes > budget:
        return (f"its staging ({choice.buffer_budget_bytes:,} bytes) exceeds offload.buffer_budget_bytes="
                f"{budget:,}")
    gain = (current.step_s - choice.step_s) * left
    if gain < PAYBACK * copy_s:
        return (f"the {left:g} steps left would save {gain:.1f} s, under {PAYBACK:g}x the copy's predicted "
                f"{copy_s:.1f} s")
    return None


def space_shortfall(manager: TieredTensorStore, dirs: list[Path]) -> str | None:
    """Where an offload directory lacks the room for ``manager``'s files (None: every one has it)."""
    manager.arena.regions.stripe(max(1, len(dirs)))
    for d, directory in enumerate(dirs):
        need = sum(manager.ssd_bytes(d).values())
        free = disk_free_bytes(directory)
        if free < need:
            return f"{directory} has {free:,} bytes free, the larger units' files need {need:,}"
    return None


def copy_state(old: TieredTensorStore, new: TieredTensorStore) -> None:
    """Every unit's full-precision weights and optimizer state from ``old`` into ``new`` (the same
    parameters, cut into other units), by parameter name, one new unit in memory at a time."""
    where = {slot.name: (u, i) for u in range(old.num_units) for i, slot in enumerate(old.layouts[u].params)}
    cached: dict[int, tuple[list[torch.Tensor], dict[int, dict[str, Any]]]] = {}
    for v in range(new.num_units):
        values, entries = [], {}
        for j, slot in enumerate(new.layouts[v].params):
            u, i = where[slot.name]
            if u not in cached:
                state = old.unit_optimizer_state(u) if old.optimizer is not None else {}
                cached[u] = (old.unit_master_weights(u), state)
            values.append(cached[u][0][i])
            if i in cached[u][1]:
                entries[j] = cached[u][1][i]
        new.load_unit_weights(v, values)
        if entries:
            new.load_unit_optimizer_state(v, entries)
        new.weights.unbind(v)
        last = where[new.layouts[v].params[-1].name][0] if new.layouts[v].params else -1
        for u in [u for u in cached if u < last]:  # units wholly before the next new one: done with
            del cached[u]
    new.flush()


def set_aside(files: list[Path]) -> list[tuple[Path, Path]]:
    """Rename ``files`` aside (their open descriptors keep working); returns (aside, original) pairs."""
    moved = []
    try:
        for path in files:
            if path.exists():
                aside = path.with_name(path.name + ASIDE)
                os.replace(path, aside)
                moved.append((aside, path))
    except BaseException:
        put_back(moved)
        raise
    return moved


def put_back(moved: list[tuple[Path, Path]]) -> None:
    for aside, path in reversed(moved):
        os.replace(aside, path)


def relayout(old: TieredTensorStore, make: Callable[[], TieredTensorStore], choice: Choice,
             report: Callable[[str], None]) -> TieredTensorStore | str:
    """The new manager (from ``make()``, not yet opened) holding ``old``'s state, with ``choice``'s
    alpha, lag and staging; ``old`` closed and its files removed. Or, where the new files do not fit
    or an I/O error stops the copy, why not: then ``old`` goes on as it was (it was only read), and so
    on any other error, which is raised."""
    old.drain()
    t0 = time.perf_counter()
    new = make()
    try:
        dirs = list(old.offload_dirs)
        short = space_shortfall(new, dirs) if new.config.uses_ssd else None
        if short is not None:
            new.close()
            return short
        moved = set_aside(old.files)
    except BaseException:
        new.close()
        raise
    try:
        new.open(dirs if new.config.uses_ssd else None)
        copy_state(old, new)
    except BaseException as e:
        new.close()
        for path in new.files:
            path.unlink(missing_ok=True)
        put_back(moved)  # the old manager was only read: it goes on as it was
        if isinstance(e, OSError):
            return f"copying the state failed: {e}"
        raise
    dtypes = {id(p): d for ps, ds in zip(old.params, old.weights.dtypes) for p, d in zip(ps, ds)}
    new.weights.dtypes = [[dtypes[id(p)] for p in ps] for ps in new.params]  # (the parameters' own)
    old.close()
    for aside, _ in moved:
        aside.unlink(missing_ok=True)
    new.reconfigure(choice.alpha, choice.lag, choice.buffer_budget_bytes)
    new.grads.register_hooks()
    report(f"greedysnake: state re-laid out in {time.perf_counter() - t0:.1f} s "
           f"({sum(new.ssd_bytes().values()):,} bytes on SSD)")
    return new


def relaid_config(config: GreedySnakeConfig, placed: GreedySnakeConfig, choice: Choice, lpu: int,
                  checkpoints: Any) -> GreedySnakeConfig:
    """The settings in effect after a re-layout: ``placed``'s placement for the new units, ``config``'s
    other settings with ``choice``'s alpha, lag and recompute, the checkpoints where they are now."""
    offload = dataclasses.replace(placed.offload, checkpoints=checkpoints)
    return dataclasses.replace(config, offload=offload, layers_per_unit=lpu, alpha=choice.alpha, lag=choice.lag,
                               recompute=choice.recompute)


@dataclasses.dataclass
class Grown:
    """A re-layout's result, for the strategy to install."""

    manager: TieredTensorStore
    units: list
    config: GreedySnakeConfig
    placement: Any
    choice: Choice


def grow_units(strategy: Any, trainer: Any, warm_plan: Any, chain: Any, report: Callable[[str], None]
               ) -> Grown | None:
    """After the warm step's plan: move ``strategy``'s state into the larger units ``warm_plan`` found
    faster, where that pays (see the module's docstring); None where it stays (the report says why)."""
    old = strategy.tensor_manager
    best, lpu = warm_plan.larger
    current = warm_plan.choice
    settings = strategy.settings
    reason = refusal(settings, distributed=strategy.is_distributed,
                     loss_scaling=strategy.precision_plugin.loss_scaler is not None, choice=best, current=current,
                     left=steps_left(trainer), copy_s=copy_seconds(old, warm_plan.machine),
                     resident_weights=any(old.on_device(TensorKind.WEIGHTS, u) for u in range(old.num_units)))
    if reason is None:
        units = make_units(chain, lpu)
        dtype, k = strategy.precision_plugin.compute_dtype, trainer.accumulate_grad_batches
        layout = state_layout(units, {}, old.optimizer, old.config, dtype)
        try:
            placed, plan = plan_at_setup(
                dataclasses.replace(settings, layers_per_unit=lpu), layout, k, speculative=False,
                clip_norm=old.clip.defer, local_processes=strategy.num_processes, broadcast=strategy.broadcast,
                report=report)
        except ValueError as e:  # the larger units' staging alone exceeds the host budget
            report(larger_units_note(best, lpu, current, str(e)))
            return None
        config = relaid_config(strategy.config, placed, best, lpu, old.activations.tier)
        budget = settings.offload.buffer_budget_bytes or best.buffer_budget_bytes
        staging = dataclasses.replace(best, buffer_budget_bytes=budget)
        report(larger_units_note(best, lpu, current, None))
        grown = relayout(old, lambda: new_tensor_manager(units, strategy.lightning_module, old.optimizer, config, dtype,
                                                         strategy.root_device, clip=old.clip, shard=None,
                                                         gradient_observer=strategy.gradient_hooks),
                         staging, report)
        if isinstance(grown, TieredTensorStore):
            return Grown(grown, units, config, plan, best)
        reason = grown
    report(larger_units_note(best, lpu, current, reason))
    return None
