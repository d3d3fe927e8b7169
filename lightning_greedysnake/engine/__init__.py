"""Runs a Plan: forward, recompute-backward, hand-off of finished gradients."""

from lightning_greedysnake.engine.executor import SavedBytes, WindowEngine
from lightning_greedysnake.engine.inputs import InputMismatchError, same_inputs

__all__ = ["InputMismatchError", "SavedBytes", "WindowEngine", "same_inputs"]
