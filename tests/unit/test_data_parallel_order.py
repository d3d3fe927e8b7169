"""Data parallel's setup order, as Lightning's DDP: the CUDA device is set before any process group is
created (NCCL binds a communicator to the current device; a group made first lands on device 0 for
every rank). Checked on the CPU by recording the calls, with a stand-in accelerator."""

from __future__ import annotations

import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import ddp as lightning_ddp

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.strategy import data_parallel


class RecordingAccelerator:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def setup_device(self, device: torch.device) -> None:
        self.calls.append(f"set device {device}")


def test_the_device_is_set_before_the_process_groups(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(lightning_ddp, "_init_dist_connection",
                        lambda *a, **k: calls.append("default process group"))
    monkeypatch.setattr(data_parallel.torch.distributed, "new_group",
                        lambda backend: calls.append(f"greedysnake's {backend} group"))
    strategy = GreedySnakeStrategy()
    strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    strategy.cluster_environment = LightningEnvironment()
    strategy.accelerator = RecordingAccelerator(calls)  # type: ignore[assignment]
    strategy._process_group_backend = "nccl"
    monkeypatch.setattr(type(strategy), "_get_process_group_backend", lambda self: "nccl")
    strategy.set_world_ranks()
    assert strategy.is_distributed
    strategy.setup_environment()
    assert calls == ["set device cuda:0", "default process group", "greedysnake's gloo group", "greedysnake's gloo group"]
