"""The tensor manager: which tensor of which unit lives where, behind the TensorStore protocol."""

from lightning_greedysnake.offload.preflight import OffloadDirLock, PreflightReport, preflight, probe_o_direct
from lightning_greedysnake.offload.store import InMemoryTensorStore, TensorStore

__all__ = ["InMemoryTensorStore", "OffloadDirLock", "PreflightReport", "TensorStore", "preflight", "probe_o_direct"]
