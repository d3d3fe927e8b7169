"""The per-unit optimizer: the user's optimizer class stepped unit by unit over streamed state."""

from lightning_greedysnake.optim.unit_optimizer import (
    SPLIT_ALIGN_NUMEL,
    UnitOptimizer,
    UnsupportedOptimizerError,
    discover_slots,
    split_numel,
)

__all__ = ["SPLIT_ALIGN_NUMEL", "UnitOptimizer", "UnsupportedOptimizerError", "discover_slots", "split_numel"]
