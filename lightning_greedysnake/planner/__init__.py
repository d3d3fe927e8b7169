"""Roofline and planning: pure arithmetic over measured costs (no torch)."""

from lightning_greedysnake.planner.roofline import Machine, Prediction, Traffic, UnitCost, predict, traffic

__all__ = ["Machine", "Prediction", "Traffic", "UnitCost", "predict", "traffic"]
