"""Data-parallel plumbing of the strategy, on Lightning's DDP strategy: its launcher, ranks, default
process group, DistributedSampler arguments, ``barrier``/``broadcast``/``reduce`` and teardown are DDP's;
what greedysnake adds is here. :class:`DataParallelStrategy` is the strategy's base class (DDP without its
``DistributedDataParallel`` wrapper, as Lightning's DeepSpeed strategy is); it also holds the extra process
groups and the collectives the tensor manager calls (DDP's conventions: rank 0's weights broadcast at
setup, gradients averaged).

The optimizer lane's collectives (a unit's gradient all-reduce, a partitioned unit's weights gather)
run on the lane's thread, in unit order on every rank: they get their own process group, so they never
interleave with the training thread's on the default group (logging, barriers, checkpoint gathers).
"""

from __future__ import annotations

import atexit
from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from torch import Tensor, nn
from typing_extensions import override

from lightning_greedysnake.distributed import gather_chunks
from lightning_greedysnake.offload.device import DeviceCopies
from lightning_greedysnake.offload.device_reduce import DeviceGradientReducer
from lightning_greedysnake.optim.protocols import StepCollectives
from lightning_greedysnake.strategy.lightning_api import keep_dataloader_samplers
from lightning_greedysnake.tensor_manager import DataParallelHooks


def _ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _destroy_process_groups() -> None:
    if _ready():
        torch.distributed.destroy_process_group()  # every group, the default one too


class DataParallelStrategy(DDPStrategy):
    """Processes and ranks for ``Trainer(devices=N, num_nodes=M)``: Lightning's DDP strategy (its subprocess
    launcher, torch.distributed with gloo on CPU and nccl on CUDA, DistributedSampler sharding,
    ``barrier``/``broadcast``/``reduce`` for user code and metrics), without the ``DistributedDataParallel``
    wrapper: the strategy averages the gradients itself. In one process nothing of DDP's runs: no launcher,
    no process group, the dataloaders' own samplers."""

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        # Lightning's accelerator connector fills parallel_devices, the cluster environment and the
        # number of nodes from Trainer(accelerator=..., devices=..., num_nodes=...)
        super().__init__(checkpoint_io=checkpoint_io)
        self._lane_group: Any = None
        """The optimizer lane's own process group (created at :meth:`setup_distributed`; gloo: it moves host
        tensors)."""
        self._host_group: Any = None
        """Beside NCCL, a gloo group for the training thread's collectives of host tensors (the units'
        parameters at setup, checkpoint gathers of partitioned state); None: the default group is gloo."""
        self._lane_bytes = 0
        """Payload bytes this rank has put into the lane's collectives so far: gradient all-reduces (a ring
        sends and receives about twice that) and, with partitioned state, its chunks of the weights gathers.
        Written by the optimizer lane, read between steps."""
        self._device_reducer: DeviceGradientReducer | None = None

    @property
    @override
    def is_distributed(self) -> bool:
        """More than one process (DDP's own answers True, deprecated, whatever the count)."""
        return self.num_nodes * self.num_processes > 1

    @property
    def collective_bytes(self) -> int:
        """Payload bytes this rank has put into the optimizer lane's collectives so far."""
        device = self._device_reducer.collective_bytes if self._device_reducer is not None else 0
        return self._lane_bytes + device

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """No names of its own: DDP's (``"ddp"``, ...) stay DDP's."""

    @override
    def _configure_launcher(self) -> None:
        if self.is_distributed:
            super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        module = self.lightning_module
        if not self.is_distributed and module is not None:
            keep_dataloader_samplers(module.trainer)
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        if not self.is_distributed:
            return
        super().setup_distributed()  # DDP's default process group
        assert self.process_group_backend is not None
        # the groups beside the default one (which must exist: ``new_group`` is collective on it).
        # gloo's worker threads abort the interpreter's exit ("terminate called without an active
        # exception") when a process group outlives it, and Lightning destroys the default group at exit
        # under NCCL only: destroy them all while Python is still alive (registered once)
        atexit.unregister(_destroy_process_groups)
        atexit.register(_destroy_process_groups)
        self._lane_group = torch.distributed.new_group(backend="gloo")
        self._host_group = torch.distributed.new_group(backend="gloo") if self.process_group_backend != "gloo" else None

    @override
    def setup(self, trainer: Any) -> None:
        # the generic setup, not DDP's: no DistributedDataParallel wrapper (``_setup_model`` below), no
        # SyncBatchNorm, no broadcast of the module's states outside fitting (the units may be on the host)
        ParallelStrategy.setup(self, trainer)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        return model  # (training_step calls the LightningModule itself)

    @override
    def teardown(self) -> None:
        for group in (self._lane_group, self._host_group):
            if group is not None and _ready():
                torch.distributed.destroy_process_group(group)
        self._lane_group = self._host_group = None
        module = self.lightning_module
        if module is not None and any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            # a model still on the meta device (setup refused it) cannot be moved to the CPU: do the rest
            self.precision_plugin.teardown()
            if self.accelerator is not None:
                self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    def data_parallel_hooks(self, copies: DeviceCopies | None, partitioned: bool) -> DataParallelHooks | None:
        """Data parallel's part in a new tensor manager (None in one process): the stepper averages each
        unit's gradient over the ranks before its step (on a device tier: the gradient accumulator, on the
        device, before the gradient's copy to the host), and gathers every rank's chunk of a partitioned
        unit's new weights after it (on the lane)."""
        if not self.is_distributed:
            return None
        if copies is not None:
            self._device_reducer = DeviceGradientReducer(copies, self.global_rank, self.world_size,
                                                         partitioned=partitioned)
        steps = StepCollectives(average_gradient=self._average_gradient, gather_weights=self._gather_weights)
        return DataParallelHooks(steps, self._host_group, self._device_reducer if copies is not None else None)

    # -- the training thread ---------------------------------------------------------------------------
    def broadcast_parameters(self, params: list[nn.Parameter]) -> None:
        """Data parallel: every rank starts from rank 0's weights (as DDP does at setup)."""
        if self.is_distributed:
            for p in params:
                torch.distributed.broadcast(p.data, 0, group=self._host_group if p.data.device.type == "cpu" else None)

    def average_param_grads(self, params: Iterable[nn.Parameter]) -> None:
        """Everything on the device: Lightning steps ``param.grad``, averaged over the ranks as DDP does."""
        for grad in [p.grad for p in params if p.grad is not None]:
            torch.distributed.all_reduce(grad)
            grad.div_(self.world_size)

    # -- the optimizer lane ------------------------------------------------------------------------------
    def _average_gradient(self, grad: Tensor) -> None:
        """A unit's fp32 gradient, averaged over the ranks in place (on the lane's group)."""
        torch.distributed.all_reduce(grad, group=self._lane_group)
        grad.div_(self.world_size)
        self._lane_bytes += grad.numel() * grad.element_size()

    def _gather_weights(self, flat: Tensor, bounds: list[tuple[int, int]]) -> None:
        """Partitioned state: every rank's newly stepped chunk of a unit's compute weights (on the lane)."""
        self._lane_bytes += gather_chunks(flat, bounds, self.global_rank, self._lane_group)
