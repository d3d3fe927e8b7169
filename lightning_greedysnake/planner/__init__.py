"""Roofline and planning: pure arithmetic over measured costs (no torch)."""

from lightning_greedysnake.planner.plan import (
    Choice,
    PlanError,
    plan,
    read_ahead_bytes,
    score,
    staging_bytes,
    window_tail,
)
from lightning_greedysnake.planner.roofline import Machine, Prediction, Traffic, UnitCost, predict, traffic

__all__ = [
    "Choice",
    "Machine",
    "PlanError",
    "Prediction",
    "Traffic",
    "UnitCost",
    "plan",
    "predict",
    "read_ahead_bytes",
    "score",
    "staging_bytes",
    "traffic",
    "window_tail",
]
