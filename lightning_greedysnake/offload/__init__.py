"""The tensor manager: which tensor of which unit lives where, behind the TensorStore protocol."""

from lightning_greedysnake.offload.store import InMemoryTensorStore, TensorStore

__all__ = ["InMemoryTensorStore", "TensorStore"]
