"""What the host budget covers, and what it does not: said in the start-of-run report, with the peak the
process should expect (its RSS at setup plus what the tensor manager will hold: its RAM regions, its staging,
the hand-back at the end), and a warning with the fixes where the model itself exceeds the budget; and what
comes back at the end of fit (:class:`HandBack`, the one rule :mod:`~lightning_greedysnake.strategy.after_fit`
follows).

``auto_host_budget_bytes`` (default: half of ``MemAvailable``) bounds what the tensor manager keeps in
RAM: the kinds the placement plan puts there, the staging buffers and the saved activations. It
does not bound the process: the LightningModule's parameters as the user built them stay allocated
until setup moves them into the tensor manager (none on the meta device).

The end of fit (``offload.return_weights=True``) is planned within the same budget: the trained state
comes back unit by unit, each unit's RAM regions freed once it is back, the staging held to one unit, so
the hand-back peaks at ``max over u`` of (the regions still held + what came back), unit ``u``'s
gradients freed first, its weights' regions once its weights are back, its optimizer state's once that
is, plus one unit in flight. The weights come back where that peak fits the budget; the
optimizer's state (``torch.optim``'s fp32 tensors, Adam: twice the parameters) only where it fits with
them. What does not is said at setup with the fixes: a checkpoint saved during fit streams it from the
tiers (``ModelCheckpoint``, ``trainer.save_checkpoint`` at the last step), a larger
``auto_host_budget_bytes``, or ``offload.return_weights=False``. With ``auto=False`` (the fixed
defaults, no budget) everything comes back, as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.offload.preflight import human_bytes
from lightning_greedysnake.strategy.report import TERMS

if TYPE_CHECKING:
    from lightning_greedysnake.tensor_manager import TieredTensorStore
from lightning_greedysnake.unit_state import WEIGHT_KINDS

FP32_BYTES = 4
"""The optimizer's state comes back as ``torch.optim`` keeps it: fp32 tensors the size of the parameter,
one per slot (quantized state dequantized)."""


KEEP = ("save a checkpoint during fit, which streams the state unit by unit from the tiers (ModelCheckpoint, "
        "or trainer.save_checkpoint at the last step, e.g. in a callback's on_train_end)")
"""How to keep what the hand-back does not return (said at setup, and on first use after fit)."""




def process_rss_bytes() -> int:
    """This process's resident memory now (``/proc/self/statm``; psutil elsewhere; 0 where neither tells)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - (no psutil, or it cannot tell: the report says the peak without it)
        return 0


@dataclass(frozen=True)
class UnitBytes:
    """One unit's host memory at the end of fit: what coming back takes (its parameters in their own
    dtypes; the optimizer's fp32 state), and what its RAM regions take, freed as it comes back: the
    gradients' first, the weights' (and master weights') once the weights are back, the optimizer
    state's once it is."""

    weights: int
    state: int
    gradient_regions: int = 0
    weight_regions: int = 0
    state_regions: int = 0

    @property
    def regions(self) -> int:
        return self.gradient_regions + self.weight_regions + self.state_regions


@dataclass(frozen=True)
class HandBack:
    """What the end of fit gives back: the weights into the module, the optimizer's state into the
    user's optimizer; ``why`` says what does not come back, why and the fixes (empty: all of it)."""

    weights: bool
    state: bool
    why: str = ""
    staging_bytes: int | None = None
    """The staging the hand-back may hold (one unit's regions off the host); None: the run's, unchanged."""

    @property
    def complete(self) -> bool:
        return self.weights and self.state


@dataclass(frozen=True)
class HostMemory:
    """The process's host memory beside the budget, from the units' sizes (the model on any device, meta
    too) and the tiers their regions were placed on."""

    budget_bytes: int
    """The host budget the plan kept (``auto_host_budget_bytes`` or its default)."""
    built_bytes: int
    """The LightningModule's parameters as built (0 on the meta device)."""
    units: Sequence[UnitBytes]
    staging_bytes: int
    """The staging one unit in flight takes during the hand-back: its regions off the host tier."""
    return_weights: bool
    bounded: bool
    """The hand-back is planned within the budget (``auto=True``); else everything comes back."""
    pool_bytes: int = 0
    """The staging budget while training (the pool's, at setup; the warm-step plan may change it, within
    the host budget)."""
    process_bytes: int = 0
    """The process's RSS at setup, before the tensor manager allocates anything: Python, torch, the data,
    the model as built (0: not known)."""

    @classmethod
    def of(cls, budget_bytes: int, built_bytes: int, manager: TieredTensorStore, *, bounded: bool,
           process_bytes: int = 0) -> HostMemory:
        """From the tensor manager's units, the tiers its regions are placed on and its staging budget
        (before it opens); ``process_bytes``: the process's RSS now (:func:`process_rss_bytes`)."""
        regions = manager.placement
        slots = len(manager.slots) if manager.optimizer is not None else 0
        units = [UnitBytes(sum(p.numel() * dtype.itemsize for p, dtype in
                               zip(manager.params[u], manager.weights.dtypes[u], strict=True)),
                           manager.layouts[u].trainable_numel * FP32_BYTES * slots,
                           regions.host_unit_bytes(u, (TensorKind.GRADIENTS,)), regions.host_unit_bytes(u, WEIGHT_KINDS),
                           regions.host_unit_bytes(u, (TensorKind.OPTIMIZER_STATES,))) for u in range(manager.num_units)]
        return cls(budget_bytes, built_bytes, units, manager.values.staging_bytes, manager.config.return_weights, bounded,
                   manager.pool.budget_bytes, process_bytes)

    @property
    def weights_bytes(self) -> int:
        """The layered model's parameters in their own dtypes."""
        return sum(u.weights for u in self.units)

    @property
    def state_bytes(self) -> int:
        """The optimizer's per-parameter state as ``torch.optim`` keeps it."""
        return sum(u.state for u in self.units)

    def hand_back_peak(self, state: bool) -> int:
        """The tensor manager's RAM at most during the hand-back of the weights (and ``state``): the
        regions of the units not back yet, what came back, one unit in flight."""
        held, back, peak = sum(u.regions for u in self.units), 0, 0
        for unit in self.units:  # (in the order after_fit.hand_back frees them)
            held -= unit.gradient_regions
            back += unit.weights
            peak = max(peak, held + back)
            held -= unit.weight_regions
            back += unit.state if state else 0
            peak = max(peak, held + back)
            held -= unit.state_regions
        return peak + self.staging_bytes + max((u.weights for u in self.units), default=0)  # (+ a transient copy)

    @property
    def hand_back(self) -> HandBack:
        """The rule: the weights come back where their hand-back fits the budget; the optimizer's state
        only where it fits with them."""
        if not self.return_weights:
            return HandBack(False, False, "offload.return_weights=False")
        if not self.bounded:
            return HandBack(True, True)
        with_state, weights_only = self.hand_back_peak(True), self.hand_back_peak(False)
        if with_state <= self.budget_bytes:
            return HandBack(True, True, staging_bytes=self.staging_bytes)
        raise_to = f"raise auto_host_budget_bytes (this placement's hand-back of both needs {with_state:,} bytes)"
        if weights_only <= self.budget_bytes:
            return HandBack(True, False, staging_bytes=self.staging_bytes, why=(
                f"the optimizer's state ({human_bytes(self.state_bytes)}) does not come back at the end of fit: with it "
                f"the hand-back would take {human_bytes(with_state)} of RAM, over the host budget of "
                f"{human_bytes(self.budget_bytes)}; the weights do ({human_bytes(self.weights_bytes)}). To keep the state: "
                f"{KEEP}; or {raise_to}. After fit your optimizer refuses state_dict() and step() (so "
                "trainer.save_checkpoint needs weights_only=True) until a state is loaded into it"))
        return HandBack(False, False, why=(
            f"neither the trained weights ({human_bytes(self.weights_bytes)}) nor the optimizer's state come back at "
            f"the end of fit: the weights alone would take {human_bytes(weights_only)} of RAM, over the host budget of "
            f"{human_bytes(self.budget_bytes)}. To keep them: {KEEP}; or raise auto_host_budget_bytes (this placement's "
            f"hand-back needs {weights_only:,} bytes for the weights, {with_state:,} with the state). After fit the module refuses "
            "to run or be saved until a checkpoint is loaded into it; set offload.return_weights=False to say so"))

    def tell(self, report: Callable[[str], None], warn: Callable[[str, str], None]) -> None:
        """The report line, and the warnings where the model exceeds the budget or not everything comes
        back at the end (once per run)."""
        report(self.report())
        if (warning := self.warning()) is not None:
            warn("host_memory", warning)
        if self.return_weights and (why := self.hand_back.why):
            warn("hand_back", f"greedysnake: {why}.")

    @property
    def returned_bytes(self) -> int:
        back = self.hand_back
        return (self.weights_bytes if back.weights else 0) + (self.state_bytes if back.state else 0)

    @property
    def regions_bytes(self) -> int:
        """The tensor manager's RAM regions (the kinds placed in host memory, every slot)."""
        return sum(u.regions for u in self.units)

    @property
    def held_bytes(self) -> int:
        """What the tensor manager holds in RAM at most, saved activations aside: its regions and its
        staging while training; the hand-back at the end, in place of them where it is planned within the
        budget, on top of them without one (``auto=False``)."""
        training = self.regions_bytes + self.pool_bytes
        back = self.hand_back
        if not back.weights:
            return training
        if self.bounded:
            return max(training, self.hand_back_peak(back.state))
        return training + self.returned_bytes

    @property
    def peak_bytes(self) -> int:
        """What the process should expect at most, the activations aside: its RSS at setup (the model as
        built in it; an allocator seldom gives that back to the system) and what the tensor manager holds
        (:attr:`held_bytes`). Where the RSS is not known, the model as built stands for it."""
        return (self.process_bytes or self.built_bytes) + self.held_bytes

    def report(self) -> str:
        built = (f"the model as you built it, {human_bytes(self.built_bytes)} of parameters (built on the meta device, "
                 "trainer.init_module(empty_init=True), it would take none)" if self.built_bytes else
                 "the model as built takes none (the meta device)")
        back = self.hand_back
        if not self.return_weights:
            end = "Nothing is copied back at the end (offload.return_weights=False)."
        elif back.complete:
            within = (f", unit by unit in place of the tensor manager's RAM: at most {human_bytes(self.hand_back_peak(True))}"
                      ", within the budget" if self.bounded else " (auto=False: no budget for it)")
            end = (f"At the end of fit the trained weights and the optimizer's state come back into the module and "
                   f"your optimizer (offload.return_weights=True), {human_bytes(self.weights_bytes)} + "
                   f"{human_bytes(self.state_bytes)}{within}.")
        else:
            end = f"{back.why[0].upper()}{back.why[1:]}."
        rss = (f"its RSS at setup ({human_bytes(self.process_bytes, 2)}: Python, torch, the data, the model as "
               "built)" if self.process_bytes else f"the model as built ({human_bytes(self.built_bytes, 2)})")
        return (f"greedysnake host memory: the host budget ({human_bytes(self.budget_bytes)}) covers what the tensor "
                f"manager keeps in RAM (the kinds placed there, staging, saved activations); this run's "
                f"placement keeps {human_bytes(self.regions_bytes)} there, and up to {human_bytes(self.pool_bytes)} of "
                f"staging. Not in it: {built}. {end} Expect the process to peak near "
                f"{human_bytes(self.peak_bytes, 2)}: "
                f"{rss} and what greedysnake holds ({human_bytes(self.held_bytes)}), plus the saved activations "
                f"kept in RAM (said at their first save) and your model's activations {TERMS}.")

    def warning(self) -> str | None:
        """The fixes, where the model itself (as built, or, without a budget for the hand-back, as it
        comes back) exceeds the budget."""
        fixes, what = [], []
        if self.built_bytes > self.budget_bytes:
            what.append(f"the model as built ({human_bytes(self.built_bytes)})")
            fixes.append("build the model on the meta device (`with trainer.init_module(empty_init=True): module = "
                         "MyModule(...)`: setup materializes it unit by unit straight into the tensor manager)")
        if not self.bounded and self.returned_bytes > self.budget_bytes:
            what.append(f"the weights and optimizer state copied back at the end ({human_bytes(self.returned_bytes)})")
            fixes.append("set offload.return_weights=False (nothing is copied back; save with ModelCheckpoint, and "
                         "the module refuses to run or be saved until a checkpoint is loaded into it)")
        if not fixes:
            return None
        return (f"greedysnake: {' and '.join(what)} exceed the host budget of {human_bytes(self.budget_bytes)}, which "
                f"covers the tensor manager's RAM only: the process may peak near {human_bytes(self.peak_bytes)}. "
                f"Fix: {'; and '.join(fixes)}.")
