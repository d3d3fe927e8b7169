"""What the LightningModule holds once the strategy is torn down, as with any other strategy.

- Training ended normally (``offload.return_weights=True``): the trained weights go back into the
  parameters and the optimizer's state into the user's optimizer, so ``trainer.save_checkpoint`` after
  ``fit`` writes what ``strategy="auto"`` writes (weights and Adam moments); with ``auto=True`` as far as
  the host budget allows (:class:`~lightning_greedysnake.strategy.host_memory.HandBack`, planned and said
  at setup): unit by unit, each unit's RAM regions freed once it is back. What does not come back
  refuses to be used (the module, or only the optimizer's ``state_dict`` and ``step``), naming the fixes.
- ``fit`` failed: the weights of the last complete update go back where they can be read (every pending
  step is completed first), with a warning that says which optimizer step each unit holds.
- Where the state cannot come back (``return_weights=False``, a failed optimizer lane or disk, data
  parallel after a failure): the module fails on first use (forward, ``state_dict``) with an error that
  says where the state went and the fix, instead of computing with NaN placeholders. Loading weights
  into it (``load_state_dict``) lifts that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_greedysnake.config import TensorKind, Tier
from lightning_greedysnake.steps import step_done, step_running
from lightning_greedysnake.strategy.host_memory import HandBack
from lightning_greedysnake.tensor_manager import TieredTensorStore
from lightning_greedysnake.unit_state import UnitReader

FAILED_WAIT_S = 10.0
"""After a failure, the longest a pending step waits for staging memory before giving up."""


class StateNotReturned(RuntimeError):
    """The module's parameters are placeholders: its trained state stayed in greedysnake's tiers."""


def _remove_all(handles: list[Any]) -> None:
    """Remove the hooks in ``handles`` and empty the list (in place: the hooks' own ``lift`` holds it)."""
    for handle in handles:
        handle.remove()
    handles.clear()


class UnusableUntilLoaded:
    """Hooks on a module whose parameters are placeholders, and on an optimizer whose state did not come
    back: the module's forward and ``state_dict``, the optimizer's ``state_dict`` and ``step`` raise
    :class:`StateNotReturned` with ``message``. The module's ``load_state_dict`` first gives the
    parameters real memory (in their own dtypes, ``params``) and then lifts its hooks; the optimizer's
    ``load_state_dict`` lifts its own. ``module`` None: the weights came back, only the optimizer refuses."""

    def __init__(self, module: nn.Module | None, message: str, params: list[tuple[nn.Parameter, torch.dtype]],
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.message = message

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise StateNotReturned(self.message)

        def materialize(*args: Any, **kwargs: Any) -> None:
            for p, dtype in params:
                p.data = torch.empty(p.shape, dtype=dtype)

        def lift(handles: list[Any]) -> Callable[..., None]:
            def lifted(*args: Any) -> None:
                _remove_all(handles)
            return lifted

        self._module: list[Any] = []
        self._optimizer: list[Any] = []
        if module is not None:
            self._module += [module.register_forward_pre_hook(refuse), module.register_state_dict_pre_hook(refuse),
                             module.register_load_state_dict_pre_hook(materialize)]
            self._module.append(module.register_load_state_dict_post_hook(lift(self._module)))
        if optimizer is not None:
            self._optimizer += [optimizer.register_state_dict_pre_hook(refuse),
                                optimizer.register_step_pre_hook(refuse)]
            self._optimizer.append(optimizer.register_load_state_dict_post_hook(lift(self._optimizer)))

    def remove(self) -> None:
        _remove_all(self._module)
        _remove_all(self._optimizer)


def steps_held(manager: TieredTensorStore, global_step: int, nonfinite: tuple[list[int], int] | None = None) -> str:
    """Which optimizer step the units' weights hold, in words (after a drain). ``nonfinite``: fit raised on
    a non-finite gradient (:attr:`~lightning_greedysnake.strategy.nonfinite.NonFiniteGuard.stepped_nonfinite`:
    the units, the ``global_step`` during that step), at the end of the step: its update landed in the
    units that reached it, Lightning never counted it."""
    stepper = manager.stepper
    # (a unit the optimizer never steps, a Tanh's or a frozen one's, counts no steps and holds every step alike)
    done = {u: n for u, n in enumerate(stepper.steps_completed) if stepper.trains(u)}
    if nonfinite is not None:
        units, step = nonfinite
        top = max(done.values(), default=0)
        behind = [u for u, n in done.items() if n < top]
        held = (f"optimizer step {step + 1}'s update in every unit" if not behind else
                f"optimizer step {step + 1}'s update in units {[u for u, n in done.items() if n == top]} and "
                f"{step_done(step)} in units {behind}")
        return (f"{held} (trainer.global_step={step}: fit raised at the end of that step, before Lightning counted "
                f"it); unit{'s' if len(units) > 1 else ''} {units} were stepped with a non-finite gradient")
    if not done or min(done.values()) == max(done.values()):
        return f"the last complete optimizer step, {step_done(global_step)}" if global_step else step_done(0)
    low = min(done.values())
    ahead = [u for u, n in done.items() if n > low]
    return (f"a mix: units {ahead} were already updated by {step_running(global_step)} when fit failed, the "
            f"other {len(done) - len(ahead)} units hold {step_done(global_step)}")


def where_state_is(manager: TieredTensorStore) -> str:
    """Where the model's trained weights and optimizer state live in the tiers, in words: host memory,
    the device, the offload files, as this run placed them."""
    regions = manager.placement
    tiers = {tier for kind in (TensorKind.WEIGHTS, TensorKind.MASTER_WEIGHTS, TensorKind.OPTIMIZER_STATES)
             for tier, size in zip(regions.unit_tiers[kind], regions.state.all_region_bytes(kind), strict=True)
             if size}
    dirs = ", ".join(str(d) for d in manager.offload_dirs)
    names = {Tier.HOST: "host memory", Tier.DEVICE: "device memory", Tier.SSD: f"the offload files in {dirs}"}
    return " and ".join(names[t] for t in (Tier.HOST, Tier.DEVICE, Tier.SSD) if t in tiers) or "host memory"


def hand_back(manager: TieredTensorStore, view: UnitReader, layered: nn.Module, plan: HandBack, *, name: str, failed: bool,
              distributed: bool, global_step: int, warn: Callable[[str], None],
              nonfinite: tuple[list[int], int] | None = None) -> UnusableUntilLoaded | None:
    """Give the module (and the user's optimizer, ``manager.optimizer``) the state in ``manager``'s tiers
    that ``plan`` returns, before they close, unit by unit: each unit's RAM regions are freed once it is
    back, and the staging is held to ``plan.staging_bytes``, so the hand-back stays within what setup
    planned. ``view`` reads the whole units (``manager.values`` itself, or gathered over the ranks with
    partitioned state). ``name``: the user's model, as
    messages name it. Returns the hooks that make the module (or the optimizer) fail on first use where its
    state did not come back. ``nonfinite``: see :func:`steps_held`."""
    optimizer = manager.optimizer
    where = where_state_is(manager)
    on_ssd = "offload files" in where
    kept = f"in {where}" + ("; the offload files are kept (offload.keep_files=True)" if manager.config.keep_files
                            and on_ssd else ", released at the end of the run")
    params = [(p, dtype) for ps, ds in zip(manager.params, manager.weights.dtypes, strict=True)
              for p, dtype in zip(ps, ds, strict=True)]
    load = ("Fix: load a checkpoint saved during fit (ModelCheckpoint; trainer.fit(..., ckpt_path=...), "
            "LightningModule.load_from_checkpoint or load_state_dict)")

    def unusable(message: str) -> UnusableUntilLoaded:
        return UnusableUntilLoaded(layered, message, params, optimizer)

    if not manager.config.return_weights:
        return unusable(f"greedysnake left {name}'s trained weights {kept} (offload.return_weights=False): its "
                        f"parameters are placeholders. {load}, or set offload.return_weights=True.")
    if failed and distributed:
        return unusable(f"fit failed with several processes, so greedysnake did not gather {name}'s weights (the "
                        f"other ranks may be gone); they were {kept}. {load}.")
    if not plan.weights:
        return unusable(f"greedysnake did not give {name}'s trained weights back ({plan.why}); they were {kept}. "
                        f"{load}.")
    states = optimizer is not None and plan.state
    try:
        manager.values.hand_back(view, with_state=states, staging_bytes=plan.staging_bytes,
                                 wait_timeout_s=FAILED_WAIT_S if failed else None)
    except Exception as e:  # noqa: BLE001 - reported on first use, the original error is already raised
        return unusable(f"greedysnake could not read {name}'s weights back after fit{' failed' if failed else ''} "
                        f"({type(e).__name__}: {e}); they were {kept}. {load}.")
    if failed:
        with_state = ", with the optimizer's state" if states else ""
        bad = [u for u, ps in enumerate(manager.params) if not all(bool(torch.isfinite(p).all()) for p in ps)]
        finite = (f": the parameters of unit{'s' if len(bad) > 1 else ''} {bad} are not finite" if bad else
                  ": its parameters are finite" if nonfinite is not None else "")
        warn(f"greedysnake: fit failed; {name} holds {steps_held(manager, global_step, nonfinite)}{finite}, read "
             f"back from {where}{with_state}.")
    if optimizer is not None and not plan.state:
        return UnusableUntilLoaded(None, f"greedysnake: {plan.why}.", [], optimizer)
    return None
