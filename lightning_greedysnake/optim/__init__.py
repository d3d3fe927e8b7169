"""The per-unit optimizer: the user's optimizer class stepped unit by unit over streamed state."""

from lightning_greedysnake.optim.unit_optimizer import UnitOptimizer, UnsupportedOptimizerError, discover_slots

__all__ = ["UnitOptimizer", "UnsupportedOptimizerError", "discover_slots"]
