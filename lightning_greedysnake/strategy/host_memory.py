"""What the host budget covers, and what it does not: said in the start-of-run report, with the peak the
process should expect, and a warning with the fixes where the model itself exceeds the budget.

``auto_host_budget_bytes`` (default: half of ``MemAvailable``) bounds what the tensor manager keeps in
RAM: the kinds the placement plan puts there, the staging buffers and the activation checkpoints. It
does not bound the process: the LightningModule's parameters as the user built them stay allocated
until setup moves them into the tensor manager (none on the meta device), and at the end of fit
``offload.return_weights=True`` copies the trained weights and the optimizer's state back into the
module and the user's optimizer (new memory: the parameters are placeholders during the run).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

FP32_BYTES = 4
"""The optimizer's state comes back as ``torch.optim`` keeps it: fp32 tensors the size of the parameter,
one per slot (quantized state dequantized)."""


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError


@dataclass(frozen=True)
class HostMemory:
    """The process's host memory beside the budget, from the model's parameters (any device, meta too)."""

    budget_bytes: int
    """The host budget the plan kept (``auto_host_budget_bytes`` or its default)."""
    built_bytes: int
    """The LightningModule's parameters as built (0 on the meta device)."""
    weights_bytes: int
    """The layered model's parameters in their own dtypes: what ``return_weights`` copies back."""
    state_bytes: int
    """The optimizer's per-parameter state as ``torch.optim`` keeps it: what ``return_weights`` copies back."""
    return_weights: bool

    @classmethod
    def of(cls, budget_bytes: int, built_bytes: int, params: Iterable[nn.Parameter], num_slots: int,
           return_weights: bool) -> HostMemory:
        """From the layered model's parameters (their shapes and dtypes; on the meta device too) and the
        optimizer's number of state slots (0 without an optimizer)."""
        params = list(params)
        return cls(budget_bytes, built_bytes, sum(p.numel() * p.element_size() for p in params),
                   sum(p.numel() for p in params if p.requires_grad) * FP32_BYTES * num_slots, return_weights)

    def tell(self, report: Callable[[str], None], warn: Callable[[str, str], None]) -> None:
        """The report line, and the warning where the model exceeds the budget (once per run)."""
        report(self.report())
        if (warning := self.warning()) is not None:
            warn("host_memory", warning)

    @property
    def returned_bytes(self) -> int:
        return self.weights_bytes + self.state_bytes if self.return_weights else 0

    @property
    def peak_bytes(self) -> int:
        """What the process should expect at most, torch and the data aside: the budget, the model as
        built (an allocator seldom gives it back to the system) and what comes back at the end."""
        return self.budget_bytes + self.built_bytes + self.returned_bytes

    def report(self) -> str:
        built = (f"the model as you built it, {_size(self.built_bytes)} of parameters (built on the meta device, "
                 "trainer.init_module(empty_init=True), it takes none)" if self.built_bytes else
                 "the model as built takes none (the meta device)")
        back = (f"; at the end of fit the trained weights and the optimizer's state copied back into the module "
                f"and your optimizer (offload.return_weights=True), {_size(self.weights_bytes)} + "
                f"{_size(self.state_bytes)}" if self.return_weights else
                "; nothing is copied back at the end (offload.return_weights=False)")
        return (f"greedysnake host memory: the host budget ({_size(self.budget_bytes)}) covers what the tensor "
                f"manager keeps in RAM (the kinds placed there, staging, activation checkpoints). Not in it: "
                f"{built}{back}. Expect the process to peak near {_size(self.peak_bytes)}, plus torch and the data.")

    def warning(self) -> str | None:
        """The fixes, where the model itself (as built, or as it comes back) exceeds the budget."""
        fixes = []
        if self.built_bytes > self.budget_bytes:
            fixes.append("build the model on the meta device (`with trainer.init_module(empty_init=True): module = "
                         "MyModule(...)`: setup materializes it unit by unit straight into the tensor manager)")
        if self.returned_bytes > self.budget_bytes:
            fixes.append("set offload.return_weights=False (nothing is copied back; save with ModelCheckpoint, and "
                         "the module refuses to run or be saved until a checkpoint is loaded into it)")
        if not fixes:
            return None
        what = [f"the model as built ({_size(self.built_bytes)})"] if self.built_bytes > self.budget_bytes else []
        if self.returned_bytes > self.budget_bytes:
            what.append(f"the weights and optimizer state copied back at the end ({_size(self.returned_bytes)})")
        return (f"greedysnake: {' and '.join(what)} exceed the host budget of {_size(self.budget_bytes)}, which "
                f"covers the tensor manager's RAM only: the process may peak near {_size(self.peak_bytes)}. "
                f"Fix: {'; and '.join(fixes)}.")
