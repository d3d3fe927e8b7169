"""The typed configuration tree. Pure Python: validated on construction, before any work starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_greedysnake.schedule import ScheduleKind


def _enum_value(enum_cls: type, setting: str, value: Any) -> Any:
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(repr(e.value) for e in enum_cls)
        raise ValueError(f"{setting}={value!r} is not valid. Fix: use one of {choices}.") from None


@dataclass
class GreedySnakeConfig:
    """Settings of the greedysnake strategy (Hydra group ``strategy``)."""

    schedule: ScheduleKind = ScheduleKind.VERTICAL
    """``vertical``: all micro-batches of a window through unit j before unit j+1, in snake order (the
    GreedySnake order); ``horizontal``: each micro-batch through all units (the ZeRO-Infinity order, the
    baseline for comparisons)."""

    layers_per_unit: int = 1
    """Blocks per unit. A unit is what is loaded, checkpointed and recomputed as one piece: only each
    unit's input is kept per micro-batch, so larger units keep fewer checkpoints but recompute more."""

    recompute: bool = True
    """Backward recomputes each unit from its checkpointed input (RNG restored so dropout masks match).
    ``False`` keeps every unit's autograd graph from the forward instead: more memory, no recompute;
    meant for debugging and for checking that recomputation is exact."""

    layered_module: str | None = None
    """Dotted name of the submodule that is the layered model (``""`` for the LightningModule itself).
    ``None``: find it (the one outermost GPT, LayeredModel or nn.Sequential)."""

    def __post_init__(self) -> None:
        self.schedule = _enum_value(ScheduleKind, "schedule", self.schedule)
        if isinstance(self.layers_per_unit, bool) or not isinstance(self.layers_per_unit, int):
            raise ValueError(
                f"layers_per_unit={self.layers_per_unit!r} must be a positive integer (blocks per unit). "
                "Fix: e.g. layers_per_unit=1."
            )
        if self.layers_per_unit < 1:
            raise ValueError(
                f"layers_per_unit={self.layers_per_unit} must be >= 1 (blocks per unit). Fix: e.g. "
                "layers_per_unit=1."
            )
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute={self.recompute!r} must be true or false.")
        if self.layered_module is not None and not isinstance(self.layered_module, str):
            raise ValueError(
                f"layered_module={self.layered_module!r} must be a dotted submodule name such as 'model', "
                "or None to let greedysnake find it."
            )

    @classmethod
    def from_kwargs(cls, base: GreedySnakeConfig | None = None, **overrides: Any) -> GreedySnakeConfig:
        """``base`` with ``overrides`` applied; unknown names are an error that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown greedysnake setting(s) {unknown}. Known settings: {sorted(known)}."
            )
        values = dataclasses.asdict(base) if base is not None else {}
        values.update(overrides)
        return cls(**values)
