"""Roofline and planning: pure arithmetic over measured costs (no torch)."""

from lightning_greedysnake.planner.plan import Choice, PlanError, plan, score, staging_bytes
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
    "score",
    "staging_bytes",
    "traffic",
]
