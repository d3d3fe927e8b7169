"""The per-unit stepper: the user's optimizer class stepped unit by unit over streamed state, on a
background lane, through the staging Protocols of :mod:`lightning_greedysnake.optim.protocols` (this
package imports nothing of ``offload``)."""

from lightning_greedysnake.layout import SPLIT_ALIGN_NUMEL
from lightning_greedysnake.optim.contract import OptimizerContract, StepPath, optimizer_contract
from lightning_greedysnake.optim.lane import OptimizerLaneError, StepLane
from lightning_greedysnake.optim.stepper import ClipPolicy, UnitStepper
from lightning_greedysnake.optim.unit_optimizer import (
    UnitOptimizer,
    UnsupportedOptimizerError,
    discover_slots,
    split_numel,
)

__all__ = [
    "SPLIT_ALIGN_NUMEL",
    "ClipPolicy",
    "OptimizerContract",
    "OptimizerLaneError",
    "StepLane",
    "StepPath",
    "UnitOptimizer",
    "UnitStepper",
    "UnsupportedOptimizerError",
    "discover_slots",
    "optimizer_contract",
    "split_numel",
]
