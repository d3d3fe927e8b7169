"""Runs a Plan: forward, recompute-backward, hand-off of finished gradients."""

from lightning_greedysnake.engine.executor import InputMismatchError, SavedBytes, WindowEngine, same_inputs

__all__ = ["InputMismatchError", "SavedBytes", "WindowEngine", "same_inputs"]
