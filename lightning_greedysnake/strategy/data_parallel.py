"""Data-parallel plumbing of the strategy: processes and ranks (Lightning's launcher, the process
groups), and the collectives its hooks and the tensor manager call (DDP's conventions: rank 0's weights
broadcast at setup, gradients averaged). :class:`DataParallelStrategy` is the strategy's base class
with these Lightning hooks; :class:`DataParallel` holds the groups.

The optimizer lane's collectives (a unit's gradient all-reduce, a partitioned unit's weights gather)
run on the lane's thread, in unit order on every rank: they get their own process group, so they never
interleave with the training thread's (logging, barriers, checkpoint gathers).
"""

from __future__ import annotations

import atexit
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor, nn
from typing_extensions import override

from lightning_greedysnake.distributed import gather_chunks
from lightning_greedysnake.offload.device import DeviceCopies
from lightning_greedysnake.offload.device_reduce import DeviceGradientReducer
from lightning_greedysnake.optim.protocols import StepCollectives
from lightning_greedysnake.strategy.lightning_api import init_process_group, subprocess_launcher, sync_reduce
from lightning_greedysnake.strategy.manager_setup import move_all_but_units
from lightning_greedysnake.tensor_manager import DataParallelHooks


def _destroy_process_groups() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class DataParallel:
    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.lane_group: Any = None
        """The optimizer lane's own process group (created at :meth:`setup`; gloo: it moves host tensors)."""
        self.host_group: Any = None
        """Beside NCCL, a gloo group for the training thread's collectives of host tensors (the units'
        parameters at setup, checkpoint gathers of partitioned state); None: the default group is gloo."""
        self.collective_bytes = 0
        """Payload bytes this rank has put into collectives so far: gradient all-reduces (a ring sends
        and receives about twice that) and, with partitioned state, its chunks of the weights gathers.
        Written by the optimizer lane, read between steps."""

    def setup(self, cluster_environment: ClusterEnvironment, backend: str) -> None:
        init_process_group(cluster_environment, backend, self.timeout)
        # gloo's worker threads abort the interpreter's exit ("terminate called without an active
        # exception") when a process group outlives it: destroy them while Python is still alive
        atexit.register(_destroy_process_groups)
        self.lane_group = torch.distributed.new_group(backend="gloo")
        self.host_group = torch.distributed.new_group(backend="gloo") if backend != "gloo" else None

    def teardown(self) -> None:
        for group in (self.lane_group, self.host_group):
            if group is not None and ready():
                torch.distributed.destroy_process_group(group)
        self.lane_group = self.host_group = None

    # -- the training thread ---------------------------------------------------------------------------
    @staticmethod
    def barrier() -> None:
        if ready():
            torch.distributed.barrier()

    @staticmethod
    def broadcast(obj: Any, src: int = 0) -> Any:
        if not ready():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @staticmethod
    def reduce(tensor: Any, group: Any | None, reduce_op: Any) -> Any:
        if isinstance(tensor, Tensor) and ready():
            return sync_reduce(tensor, group, reduce_op)
        return tensor

    def broadcast_parameters(self, params: Iterable[nn.Parameter]) -> None:
        """Every rank starts from rank 0's weights (as DDP does at setup)."""
        for p in params:
            torch.distributed.broadcast(p.data, 0, group=self.host_group if p.data.device.type == "cpu" else None)

    @staticmethod
    def average_param_grads(params: Iterable[nn.Parameter], world_size: int) -> None:
        """Everything on the device: Lightning steps ``param.grad``, averaged over the ranks as DDP does."""
        for grad in [p.grad for p in params if p.grad is not None]:
            torch.distributed.all_reduce(grad)
            grad.div_(world_size)

    # -- the optimizer lane ------------------------------------------------------------------------------
    def average_gradient(self, grad: Tensor, world_size: int) -> None:
        """A unit's fp32 gradient, averaged over the ranks in place (on the lane's group)."""
        torch.distributed.all_reduce(grad, group=self.lane_group)
        grad.div_(world_size)
        self.collective_bytes += grad.numel() * grad.element_size()

    def gather_weights(self, flat: Tensor, bounds: list[tuple[int, int]], rank: int) -> None:
        """Partitioned state: every rank's newly stepped chunk of a unit's compute weights (on the lane)."""
        self.collective_bytes += gather_chunks(flat, bounds, rank, self.lane_group)


class DataParallelStrategy(ParallelStrategy):
    """Processes and ranks for ``Trainer(devices=N, num_nodes=M)``, as Lightning's DDP strategy has them:
    Lightning's subprocess launcher, torch.distributed (gloo on CPU, nccl on CUDA), DistributedSampler
    sharding, ``barrier``/``broadcast``/``reduce`` for user code and metrics."""

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        # Lightning's accelerator connector fills parallel_devices, the cluster environment and the
        # number of nodes from Trainer(accelerator=..., devices=..., num_nodes=...)
        super().__init__(checkpoint_io=checkpoint_io)
        self._num_nodes = 1
        self._dp = DataParallel(default_pg_timeout)
        self._device_reducer: DeviceGradientReducer | None = None
        self.units_stay_on_host: list[Any] | None = None
        """The units whose parameters the tensor manager keeps in its tiers: ``model_to_device`` leaves
        them where they are."""

    @property
    @override
    def root_device(self) -> torch.device:
        if self.parallel_devices:
            return torch.device(self.parallel_devices[self.local_rank])
        return torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def is_distributed(self) -> bool:
        """More than one process: Lightning then shards the data with a DistributedSampler."""
        return self.num_nodes * self.num_processes > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def collective_bytes(self) -> int:
        """Payload bytes this rank has put into the optimizer lane's collectives so far."""
        device = self._device_reducer.collective_bytes if self._device_reducer is not None else 0
        return self._dp.collective_bytes + device

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.is_distributed and not self.cluster_environment.creates_processes_externally:
            self._launcher = subprocess_launcher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        if self.is_distributed:
            reset_seed()
            self.set_world_ranks()
            assert self.cluster_environment is not None
            self._dp.setup(self.cluster_environment, "nccl" if self.root_device.type == "cuda" else "gloo")
        super().setup_environment()

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._dp.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._dp.broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return self._dp.reduce(tensor, group, reduce_op)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self.units_stay_on_host is not None:
            move_all_but_units(self.model, self.units_stay_on_host, self.root_device)
        else:
            self.model.to(self.root_device)

    @override
    def teardown(self) -> None:
        self._dp.teardown()
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
        steps = StepCollectives(
            average_gradient=lambda grad: self._dp.average_gradient(grad, self.world_size),
            gather_weights=lambda flat, b: self._dp.gather_weights(flat, b, self.global_rank))
        return DataParallelHooks(steps, self._dp.host_group, self._device_reducer if copies is not None else None)

    def broadcast_parameters(self, params: list[nn.Parameter]) -> None:
        """Data parallel: every rank starts from rank 0's weights (as DDP does at setup)."""
        if self.is_distributed:
            self._dp.broadcast_parameters(params)
