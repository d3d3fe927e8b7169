"""Lightning glue: turns Lightning's per-micro-batch hooks into engine calls. Owns no tensor logic.

How a window of K micro-batches maps onto Lightning (automatic optimization, accumulate_grad_batches=K):

- micro-batch m's ``training_step`` -> the engine runs the plan up to the fused op ``L.m`` (vertically at
  m=0: every unit but the last, for all K micro-batches, read ahead through :class:`LookaheadLoader`),
  then the user's own ``training_step`` runs with the layered model's ``forward`` answered by the fused
  op: the last unit and head, from the checkpoint. The user's loss and ``self.log`` calls are real.
- micro-batch m's ``backward`` -> the loss is back-propagated through the fused op; the engine then runs
  the backward ops that follow (vertically after the last micro-batch: unit by unit, recomputing).
- the optimizer step -> the precision plugin makes sure the window's backward is complete, then
  Lightning's own path runs: ``on_before_optimizer_step``, gradient clipping, ``optimizer.step()``,
  LR schedulers, ``global_step``.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from lightning_greedysnake.checkpoint import is_checkpoint_dir
from lightning_greedysnake.checkpoint.streamed import (
    STREAMED_STATE,
    StreamedStateDict,
    StreamedTensor,
    load_model_into,
    load_optimizer_into,
    load_streamed,
    save_streamed,
)
from lightning_greedysnake.config import GreedySnakeConfig, OffloadConfig, TensorKind, Tier
from lightning_greedysnake.distributed import ShardedStateView, gather_chunks, join_save
from lightning_greedysnake.engine import WindowEngine
from lightning_greedysnake.lookahead import LookaheadLoader
from lightning_greedysnake.models import (
    check_parameter_ownership,
    find_layered_model,
    make_units,
    reset_modules,
    unit_initializer_of,
)
from lightning_greedysnake.offload import InMemoryTensorStore, OffloadDirLock, TensorStore, preflight
from lightning_greedysnake.offload.manager import ClipPolicy, TieredTensorStore
from lightning_greedysnake.precision import GreedySnakePrecision
from lightning_greedysnake.telemetry import StepRecorder, StepTelemetry


class _CapturedInputs(BaseException):
    """Raised from the layered model's forward to stop a look-ahead training_step at the model call.

    A BaseException, so that a user's ``except Exception`` around the model call does not swallow it."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args = args
        self.kwargs = kwargs


def _tokens_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Tokens in a model call: the elements of its first integer tensor input (token ids), else 0."""
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, Tensor) and not leaf.is_floating_point() and not leaf.is_complex():
            return leaf.numel()
    return 0


def _loss_of(output: Any) -> Tensor | None:
    """What Lightning will back-propagate from a training_step output (mirrors ClosureResult)."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        loss = output.get("loss")
        return loss if isinstance(loss, Tensor) else None
    return None


def _destroy_process_groups() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class GreedySnakeStrategy(ParallelStrategy):
    """Trains a layered model with GreedySnake's vertical schedule and recompute backward.

    Args:
        config: a full :class:`GreedySnakeConfig`; keyword settings below override its fields.
        checkpoint_io: Lightning's checkpoint IO plugin.
        precision_plugin: usually left out; ``Trainer(precision=...)`` decides.
        **settings: any :class:`GreedySnakeConfig` field, e.g. ``schedule="horizontal"``,
            ``layers_per_unit=2``.
    """

    strategy_name = "greedysnake"

    def __init__(
        self,
        config: GreedySnakeConfig | Mapping[str, Any] | None = None,
        *,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        **settings: Any,
    ) -> None:
        if isinstance(config, Mapping):
            settings = {**config, **settings}
            config = None
        # validate first: bad settings fail at construction, before Lightning does anything
        self.config = GreedySnakeConfig.from_kwargs(config, **settings)
        # Lightning's accelerator connector fills parallel_devices, the cluster environment and the
        # number of nodes from Trainer(accelerator=..., devices=..., num_nodes=...)
        super().__init__(checkpoint_io=checkpoint_io)
        self._num_nodes = 1
        self._timeout = default_pg_timeout
        self._lane_group: Any = None
        self.collective_bytes = 0
        """Payload bytes this rank has put into collectives so far: gradient all-reduces (a ring sends
        and receives about twice that) and, with partitioned state, its chunks of the weights gathers."""
        self._gs_precision: GreedySnakePrecision | None = None
        if precision_plugin is not None:
            self.precision_plugin = precision_plugin
        self._engine: WindowEngine | None = None
        self._store: TensorStore | None = None
        self._layered: nn.Module | None = None
        self._layered_path: str | None = None
        self.last_checkpoint_seconds: float | None = None
        self._last_saved: Any = None
        self._checkpoint_loads = 0
        """Wall time of the last checkpoint save (streamed from the tiers)."""
        self._train_loader: LookaheadLoader | None = None
        self._seen_iterator: object | None = None
        self._iterator_offset = 0
        self._window_start = 0
        self._warned_hooks: set[str] = set()
        self._lock: OffloadDirLock | None = None
        self._created_offload_dir: Path | None = None
        self._created_rank_parent: Path | None = None
        self._failed = False
        self._telemetry: StepRecorder | None = None
        self._offload_dir: Path | None = None
        self.plan_choice: Any = None
        """The planner's choice when ``auto=True`` (after the first optimizer step)."""

    # -- Lightning plumbing ------------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        if self.parallel_devices:
            return torch.device(self.parallel_devices[self.local_rank])
        return torch.device("cpu")

    # -- data parallel (torch.distributed through Lightning's launchers) ----------------------------
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
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.is_distributed and not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        # gloo's worker threads abort the interpreter's exit ("terminate called without an active
        # exception") when a process group outlives it: destroy them while Python is still alive
        atexit.register(_destroy_process_groups)
        # the optimizer lane's collectives (a unit's gradient all-reduce) run on its own thread: they get
        # their own group, so they never interleave with the training thread's (logging, barriers)
        self._lane_group = torch.distributed.new_group(backend=backend)

    def _distributed_ready(self) -> bool:
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._distributed_ready():
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._distributed_ready():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and self._distributed_ready():
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _gather_weights(self, flat: torch.Tensor, bounds: list[tuple[int, int]]) -> None:
        """Partitioned state: every rank's newly stepped chunk of a unit's compute weights (on the lane)."""
        self.collective_bytes += gather_chunks(flat, bounds, self.global_rank, self._lane_group)

    def _average_gradient(self, grad: torch.Tensor) -> None:
        """A unit's fp32 gradient, averaged over the ranks in place (on the optimizer lane's group)."""
        torch.distributed.all_reduce(grad, group=self._lane_group)
        grad.div_(self.world_size)
        self.collective_bytes += grad.numel() * grad.element_size()

    @property  # type: ignore[override]
    def precision_plugin(self) -> GreedySnakePrecision:
        if self._gs_precision is None:
            # not stored in _precision_plugin: Lightning must still see "none chosen" and build one from
            # Trainer(precision=...), which the setter below then translates
            return GreedySnakePrecision()
        return self._gs_precision

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning installs a plain plugin built from Trainer(precision=...) after constructing a
        # strategy chosen by name; keep ours (translated) instead, or refuse what we cannot honour.
        if plugin is None:
            self._gs_precision = None
            self._precision_plugin = None
            return
        self._gs_precision = GreedySnakePrecision.from_plugin(plugin)
        self._precision_plugin = self._gs_precision

    @property
    def engine(self) -> WindowEngine:
        assert self._engine is not None, "the strategy is not set up"
        return self._engine

    @property
    def store(self) -> TensorStore:
        assert self._store is not None, "the strategy is not set up"
        return self._store

    def io_stats(self) -> dict[str, float]:
        """The tensor manager's I/O counters so far: ``{"ssd/weights/bytes_read": ..., ...}`` (bytes,
        busy seconds and the seconds training waited, per kind and tier); empty without offload."""
        manager = self.tensor_manager
        return manager.stats.flat() if manager is not None else {}

    @property
    def step_telemetry(self) -> list[StepTelemetry]:
        """Per optimizer step: lane busy seconds (SSD read, SSD write, optimizer), compute, the seconds the
        training thread waited on reads and on the optimizer, bytes per kind. Empty without offload."""
        return self._telemetry.history if self._telemetry is not None else []

    @property
    def tensor_manager(self) -> TieredTensorStore | None:
        """The SSD/host tensor manager, when the placement uses one (None: everything on the device)."""
        return self._store if isinstance(self._store, TieredTensorStore) else None

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        presets = {
            "greedysnake": ("GreedySnake vertical schedule", {"schedule": "vertical"}),
            "greedysnake_horizontal": (
                "the horizontal (ZeRO-Infinity) order on the greedysnake engine",
                {"schedule": "horizontal"},
            ),
            "greedysnake_cpu": (
                "GreedySnake vertical schedule with every tensor in host memory (no SSD tier)",
                {"schedule": "vertical", "offload": OffloadConfig.everywhere(Tier.HOST)},
            ),
        }
        for name, (description, params) in presets.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **params)

    # -- setup and teardown ------------------------------------------------------------------------
    def setup_environment(self) -> None:
        if self.is_distributed:
            self._setup_distributed()
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._check_module_for_training(module)
        path, layered, chain = find_layered_model(module, self.config.layered_module)
        units = make_units(chain, self.config.layers_per_unit)
        if fitting:
            check_parameter_ownership(module, path, units)
        on_meta = self._stand_in_for_meta_parameters(module, layered, units)
        super().setup(trainer)  # model to device, optimizers, precision plugin
        if fitting:
            self._check_optimizers()
        self._layered, self._layered_path = layered, path
        offload = self.config.offload
        if offload.uses_tensor_manager:
            manager = self._open_tensor_manager(trainer, module, units, fitting, layered if on_meta else None)
            self._store = manager
            self._telemetry = StepRecorder(manager)
            if fitting and self.config.trace_steps:
                path = Path(self.config.trace_path or Path(trainer.default_root_dir) / "greedysnake_trace.json")
                self._telemetry.start_trace(self.config.trace_steps, path)
            self.precision_plugin.attach(self._finish_window, manager, self._after_step)
        else:
            self._broadcast_parameters([p for unit in units for p in unit.parameters()])
            self._store = InMemoryTensorStore()
            self.precision_plugin.attach(self._finish_window)
        self._engine = WindowEngine(
            chain, units, self.config, self._store, self.root_device, self.precision_plugin.forward_context
        )
        if self.tensor_manager is not None:
            lanes = self.tensor_manager.stats.lanes
            self._engine.observer = lambda name, a, b: lanes.add("compute", a, b, name)

    # -- models created on the meta device ------------------------------------------------------------
    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``trainer.init_module(empty_init=True)``: with the tensor manager, build the model on the meta
        device; setup then materializes it one unit at a time straight into its tiers, so a model larger
        than RAM never exists there whole (Lightning's convention for FSDP and DeepSpeed)."""
        if empty_init and self.config.offload.uses_tensor_manager:
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    def _stand_in_for_meta_parameters(self, module: LightningModule, layered: nn.Module, units: list) -> bool:
        """Swap every meta parameter of the layered model for a memory-less CPU stand-in (the same
        Parameter object, so the optimizer Lightning builds next refers to it); False if none is meta."""
        meta_outside = [
            n for n, t in [*module.named_parameters(), *module.named_buffers()]
            if t.is_meta and not any(t is q for unit in units for q in unit.parameters())
        ]
        in_units = [p for unit in units for p in unit.parameters() if p.is_meta]
        if not in_units and not meta_outside:
            return False
        if meta_outside:
            raise ValueError(
                f"tensors on the meta device outside the layered model's parameters: {meta_outside[:6]}. "
                "greedysnake materializes the layered model's parameters unit by unit; buffers and other "
                "tensors must be real. Fix: create them on the CPU (e.g. register buffers in setup())."
            )
        if not self.config.offload.uses_tensor_manager:
            raise ValueError(
                "the model's parameters are on the meta device, but the placement keeps everything on the "
                "device, where nothing materializes them. Fix: use an offload placement (the default) or "
                "create the model without empty_init."
            )
        for p in in_units:
            stand_in = nn.Parameter(
                torch.full((1,), float("nan"), dtype=p.dtype).expand(p.shape), requires_grad=p.requires_grad
            )
            torch.utils.swap_tensors(p, stand_in)
        return True

    def _materialize(self, manager: TieredTensorStore, layered: nn.Module, units: list) -> None:
        initializer = unit_initializer_of(layered)
        if initializer is not None:
            generator = initializer.weight_init_generator()

            def init(u: int) -> None:
                initializer.init_modules(units[u].modules, generator)
                self._broadcast_parameters(units[u].parameters())
        else:

            def init(u: int) -> None:
                reset_modules(units[u].modules)
                self._broadcast_parameters(units[u].parameters())

        manager.initialize_unit_by_unit(init)

    def _broadcast_parameters(self, params: list[nn.Parameter]) -> None:
        """Data parallel: every rank starts from rank 0's weights (as DDP does at setup)."""
        if self.is_distributed:
            for p in params:
                torch.distributed.broadcast(p.data, 0)

    def _open_tensor_manager(
        self, trainer: Any, module: LightningModule, units: list, fitting: bool, meta_model: nn.Module | None
    ) -> TieredTensorStore:
        offload = self.config.offload
        if self.root_device.type != "cpu":
            raise ValueError(
                f"offload placement {self._placement_text()} on a {self.root_device.type} device: the tensor "
                "manager's accelerator path (pinned buffers, copy streams) is not built yet. Fix: "
                "Trainer(accelerator='cpu'), or keep everything on the device with "
                "offload=OffloadConfig.everywhere('device')."
            )
        optimizer = self.optimizers[0] if (fitting and self.optimizers) else None
        names = {id(p): n for n, p in module.named_parameters()}
        clip = ClipPolicy()
        if fitting:
            clip = self._clip_policy(trainer, module)
        shard = (self.global_rank, self.world_size) if self.is_distributed and self.config.shard_state else None
        manager = TieredTensorStore(
            units, names, optimizer, offload, compute_dtype=self.precision_plugin.compute_dtype, clip=clip,
            alpha=self.config.alpha, lag=self.config.lag, shard=shard,
        )
        if self.is_distributed:
            manager.grad_reducer = self._average_gradient
            manager.weights_gatherer = self._gather_weights
        try:
            self._prepare_offload_dir(trainer, manager)
            manager.open(self._offload_dir)
            if meta_model is not None:
                self._materialize(manager, meta_model, units)
            else:
                self._broadcast_parameters([p for unit in units for p in unit.parameters()])
                manager.initialize_from_parameters()
        except BaseException:
            # setup failed before the strategy owned the manager: release what it holds right here
            manager.close()
            self._cleanup_offload_dir(manager)
            raise
        return manager

    def _prepare_offload_dir(self, trainer: Any, manager: TieredTensorStore) -> None:
        """Preflight (directory, O_DIRECT, free space for ``manager``'s files) and the exclusive lock."""
        offload = self.config.offload
        offload_dir: Path | None = None
        if offload.uses_ssd:
            offload_dir = Path(offload.path or Path(trainer.default_root_dir) / "greedysnake_offload")
            if offload.path is not None and ("{rank}" in offload.path or "{local_rank}" in offload.path):
                try:
                    offload_dir = Path(offload.path.format(rank=self.global_rank, local_rank=self.local_rank))
                except (KeyError, IndexError, ValueError) as e:
                    raise ValueError(
                        f"offload.path={offload.path!r}: only {{rank}} and {{local_rank}} are filled in ({e!r}). "
                        "Fix: escape other braces as {{ and }}."
                    ) from None
            elif self.is_distributed:
                # each rank its own files and lock, under the one configured directory
                if offload_dir.parent.exists():
                    offload_dir.mkdir(exist_ok=True)  # the first rank makes it
                if offload.path is None:  # ours: whichever rank leaves last removes it (when empty)
                    self._created_rank_parent = offload_dir
                offload_dir = offload_dir / f"rank_{self.global_rank}"
            existed = offload_dir.exists()
            if offload.path is None and not existed:
                # our own default under default_root_dir (which Lightning creates lazily): make the parents;
                # a user-given path with a missing parent is refused by preflight instead (a typo?)
                offload_dir.parent.mkdir(parents=True, exist_ok=True)
            report = preflight(offload_dir, manager.ssd_bytes())
            offload_dir = report.offload_dir
            if not existed:
                self._created_offload_dir = offload_dir
            self._lock = OffloadDirLock(offload_dir)
            self._lock.acquire()
            rank_zero_info(report.text())
        self._offload_dir = offload_dir

    def _placement_text(self) -> str:
        o = self.config.offload
        return ", ".join(f"{kind.value}={o.tier(kind).value}" for kind in TensorKind)

    def _clip_policy(self, trainer: Any, module: LightningModule) -> ClipPolicy:
        custom = type(module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping
        value = trainer.gradient_clip_val
        algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm")
        if custom:
            self._warn_once(
                "configure_gradient_clipping",
                f"{type(module).__name__}.configure_gradient_clipping runs with the gradients in greedysnake's "
                "offloaded buffers: self.clip_gradients(...) works, but param.grad is not populated. Every "
                "unit's optimizer step waits until it has run.",
            )
            return ClipPolicy(defer=True)
        if value is None or value <= 0:
            return ClipPolicy()
        if algorithm == "value":
            return ClipPolicy(value=float(value))
        return ClipPolicy(defer=True)

    def on_exception(self, exception: BaseException) -> None:
        # teardown follows: it must clean up without raising again over the original error
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        manager = self.tensor_manager
        failed, self._failed = getattr(self, "_failed", False), False
        try:
            if self._engine is not None:
                self._engine.close()
            if manager is not None and self.config.offload.return_weights and not manager.closed and not failed:
                # the LightningModule should be usable after fit, as with any other strategy
                manager.restore_parameters(self._master_source(manager))
        finally:
            try:
                if self._store is not None:
                    self._store.close()
            finally:
                self._cleanup_offload_dir(manager)
                if self._lane_group is not None and self._distributed_ready():
                    # a group left to interpreter exit can abort it ("terminate called without an active
                    # exception" from gloo's threads)
                    torch.distributed.destroy_process_group(self._lane_group)
                    self._lane_group = None
                self.precision_plugin.attach(None)
                self._engine = None
                self._store = None
                self._train_loader = None
                self._base_teardown()

    def _base_teardown(self) -> None:
        module = self.lightning_module
        if module is not None and any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            # a model still on the meta device (setup refused it) cannot be moved to the CPU: do the rest
            self.precision_plugin.teardown()
            if self.accelerator is not None:
                self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    def _cleanup_offload_dir(self, manager: TieredTensorStore | None) -> None:
        if manager is not None and not self.config.offload.keep_files:
            for path in manager.files:
                path.unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        created, self._created_offload_dir = self._created_offload_dir, None
        if created is not None and not self.config.offload.keep_files:
            with contextlib.suppress(OSError):
                created.rmdir()  # only if empty: never remove what someone else put there
            if self._created_rank_parent is not None:
                with contextlib.suppress(OSError):  # only when empty: the last rank out removes it
                    self._created_rank_parent.rmdir()
        self._created_rank_parent = None

    def _check_module_for_training(self, module: LightningModule) -> None:
        if not module.automatic_optimization:
            raise ValueError(
                "strategy='greedysnake' owns backward and the optimizer step, so it needs "
                "automatic_optimization=True (found False). Fix: remove `self.automatic_optimization = False` "
                "and return the loss from training_step."
            )
        if type(module).backward is not LightningModule.backward:
            raise ValueError(
                f"{type(module).__name__} overrides `backward`, which strategy='greedysnake' cannot honour: it "
                "back-propagates unit by unit itself. Fix: remove the override (use on_before_backward or "
                "on_before_optimizer_step for custom logic)."
            )
        if is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
            raise ValueError(
                "training_step(dataloader_iter) is not supported by strategy='greedysnake': it reads a window "
                "of batches ahead. Fix: take `batch` (and optionally `batch_idx`) as arguments."
            )
        if type(module).on_after_backward is not LightningModule.on_after_backward:
            self._warn_once(
                "on_after_backward",
                f"{type(module).__name__}.on_after_backward runs after each micro-batch's backward through the "
                "last unit only; with strategy='greedysnake' the earlier units' gradients are complete only "
                "in on_before_optimizer_step. Inspect gradients there.",
            )

    def _check_optimizers(self) -> None:
        if len(self.optimizers) != 1:
            raise ValueError(
                f"strategy='greedysnake' needs exactly one optimizer from configure_optimizers (got "
                f"{len(self.optimizers)}). Fix: return one optimizer, with several param groups if needed."
            )
        if isinstance(self.optimizers[0], torch.optim.LBFGS):
            raise ValueError(
                "torch.optim.LBFGS re-evaluates the closure several times per step, which strategy='greedysnake' "
                "cannot do. Fix: use AdamW, Adam or SGD."
            )

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned_hooks:
            self._warned_hooks.add(key)
            rank_zero_warn(message)

    # -- data ---------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        if isinstance(dataloader, LookaheadLoader):
            dataloader = dataloader.loader
        keep = max(2 * trainer.accumulate_grad_batches + 2, 4)
        self._train_loader = LookaheadLoader(dataloader, keep=keep)  # type: ignore[arg-type]
        return self._train_loader

    def _raw_batch(self, position: int) -> Any:
        """The raw batch at epoch-local ``position`` (None past the end of the data)."""
        loader = self._train_loader
        if loader is None or loader.iterator is None:
            raise RuntimeError(
                "greedysnake could not read the training data ahead: the train dataloader was not set up "
                "through the strategy (several train dataloaders are not supported). Fix: return a single "
                "DataLoader from train_dataloader()."
            )
        return loader.iterator.get(position - self._iterator_offset)

    def _sync_iterator(self, position: int) -> None:
        loader = self._train_loader
        iterator = loader.iterator if loader is not None else None
        if iterator is not self._seen_iterator:
            # first batch of a fresh iterator (new epoch): it is this iterator's batch 0
            self._seen_iterator = iterator
            self._iterator_offset = position

    def _window_size(self, start: int, position: int, k: int) -> int:
        """Micro-batches in the window that ``position`` opens (Lightning's own windows: aligned to
        multiples of K within the epoch, the last one cut by the end of the data)."""
        trainer = self.lightning_module.trainer
        end = start + k
        limit = trainer.num_training_batches
        if limit != float("inf"):
            end = min(end, int(limit))
        size = 1
        for p in range(position + 1, end):
            if self._raw_batch(p) is None:
                break
            size += 1
        return size

    def _step_args(self, raw: Any, position: int) -> tuple[Any, ...]:
        """Prepare a read-ahead batch exactly as Lightning prepares the batch it hands to training_step."""
        trainer = self.lightning_module.trainer
        module = self.lightning_module
        batch = trainer.precision_plugin.convert_input(raw)
        batch = module._on_before_batch_transfer(batch, dataloader_idx=0)
        batch = self.batch_to_device(batch, dataloader_idx=0)
        if is_param_in_hook_signature(module.training_step, "batch_idx", min_args=2):
            return (batch, position)
        return (batch,)

    # -- the training step ------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        trainer = self.lightning_module.trainer
        position = trainer.fit_loop.epoch_loop.batch_idx
        k = trainer.accumulate_grad_batches
        self._sync_iterator(position)
        start = position - position % k
        if engine.window_active and (position % k == 0 or position < self._window_start):
            # the previous window never reached its optimizer step (the epoch was cut short): Lightning
            # discards its gradients too; drop our state for it
            self._warn_once("abandoned", "greedysnake: an accumulation window ended without an optimizer step.")
            engine.abort_window()
        if not engine.window_active:
            self._window_start = position
            engine.begin_window(self._window_size(start, position, k))
        microbatch = position - self._window_start
        for needed in engine.inputs_needed_until_fused(microbatch):
            if engine.has_inputs(needed):
                continue
            if needed == microbatch:
                step_args, step_kwargs = args, kwargs
            else:
                raw = self._raw_batch(self._window_start + needed)
                step_args, step_kwargs = self._step_args(raw, self._window_start + needed), {}
            engine.set_inputs(needed, *self._capture_inputs(step_args, step_kwargs))
        engine.run_until_fused(microbatch)

        def fused(*a: Any, **kw: Any) -> Any:
            if self._telemetry is not None:
                self._telemetry.tokens += _tokens_in(a, kw)
            t0 = time.perf_counter()
            out = engine.fused_forward(microbatch, a, kw)
            self._observe(f"L{engine.units[-1].index}.{microbatch} forward", t0)
            return out

        with self._forward_replaced(fused):
            output = super().training_step(*args, **kwargs)
        if engine.fused_pending != microbatch:
            raise ValueError(self._no_model_call_message())
        if microbatch == 0:
            self._log_progress()
        if _loss_of(output) is None:
            # Lightning skips backward when training_step returns no loss: this micro-batch adds nothing
            engine.fused_backward_done(microbatch)
        return output

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        engine = self.engine
        microbatch = engine.fused_pending
        assert microbatch is not None, "backward called without a fused forward"
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        t0 = time.perf_counter()
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        self._observe(f"L{engine.units[-1].index}.{microbatch} backward", t0)
        engine.fused_backward_done(microbatch)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _finish_window(self) -> None:
        self.engine.finish_window()
        if self.is_distributed and self.tensor_manager is None:
            # everything on the device: Lightning steps param.grad, averaged over the ranks as DDP does
            grads = [p.grad for p in self.lightning_module.parameters() if p.grad is not None]
            for grad in grads:
                torch.distributed.all_reduce(grad)
                grad.div_(self.world_size)

    def _auto_plan(self) -> None:
        """``auto=True``: plan from the first step's measurements and apply the choice."""
        from lightning_greedysnake.planner import Machine, plan
        from lightning_greedysnake.planner.measure import disk_bandwidth, optimizer_rate, unit_costs, unit_times

        manager = self.tensor_manager
        assert manager is not None
        manager.drain()
        probe_dir = manager.offload_dir or Path(self.lightning_module.trainer.default_root_dir)
        read_bps, write_bps = disk_bandwidth(probe_dir, nbytes=64 << 20)
        fwd, bwd = unit_times(manager.stats.lanes.spans(0.0, float("inf")), manager.num_units)
        costs = unit_costs(manager, fwd, bwd, self.engine.activation_bytes)
        budget = self.config.auto_host_budget_bytes or (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 4
        placement = "ssd" if self.config.offload.checkpoints is Tier.SSD else "host"
        choice = plan(costs, Machine(read_bps, write_bps, optimizer_rate()),
                      self.lightning_module.trainer.accumulate_grad_batches, int(budget),
                      manager.checkpoint_bytes, layers_per_unit=(1,),  # costs are per current unit
                      checkpoint_placements=(placement,))
        choice = self.broadcast(choice)  # every rank must run the same schedule and lane
        manager.reconfigure(choice.alpha, choice.lag, choice.buffer_budget_bytes)
        if choice.recompute != self.config.recompute:
            # between windows: the engine reads it op by op, from the next forward on
            self.config = dataclasses.replace(self.config, recompute=choice.recompute)
            self.engine.config = self.config
        self.plan_choice = choice
        rank_zero_info(
            f"greedysnake auto plan (SSD read {read_bps / 1e9:.2f} GB/s, write {write_bps / 1e9:.2f} GB/s):\n"
            + choice.table()
        )

    def _observe(self, name: str, start: float) -> None:
        manager = self.tensor_manager
        if manager is not None:
            manager.stats.lanes.add("compute", start, time.perf_counter(), name)

    def _log_progress(self) -> None:
        """Tokens/s and SSD GB/s of the last optimizer step on the progress bar (not to the loggers:
        they get the full per-step telemetry)."""
        if self._telemetry is None or not self._telemetry.history:
            return
        last = self._telemetry.history[-1]
        values = {"gs/ssd_GBps": round(last.ssd_gb_per_s, 3)}
        if last.tokens:
            values["gs/tok_s"] = round(last.tokens_per_s, 1)
        self.lightning_module.log_dict(values, prog_bar=True, logger=False, on_step=True, on_epoch=False,
                                       batch_size=1)

    def _after_step(self) -> None:
        """Record the step's telemetry and hand it to the Trainer's loggers (CSV, TensorBoard, ...) as
        ``greedysnake/<metric>``, every ``log_every_n_steps`` steps, as Lightning logs its own metrics."""
        assert self._telemetry is not None
        entry = self._telemetry.record()
        if self.config.auto and self.plan_choice is None and self.tensor_manager is not None:
            self._auto_plan()
        trainer = self.lightning_module.trainer
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 1))
        step = trainer.global_step
        if trainer.loggers and step % every == 0:
            metrics = {f"greedysnake/{k}": v for k, v in entry.as_metrics().items()}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    # -- state dicts and checkpoints (the tensor manager holds the real values) -------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # with a tensor manager, a checkpoint's state goes into it unit by unit, so it must exist first
        return self.config.offload.uses_tensor_manager

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Lightning's state dict for checkpoints. With the tensor manager, every unit parameter is a
        :class:`StreamedTensor` placeholder that :meth:`save_checkpoint` streams from the tiers (the
        whole model is never gathered); :meth:`full_state_dict` gives real tensors."""
        state = super().lightning_module_state_dict()
        manager = self.tensor_manager
        if manager is None:
            return state
        for u in range(manager.num_units):
            for i, slot in enumerate(manager.layouts[u].params):
                if slot.name in state:
                    state[slot.name] = StreamedTensor(u, i, slot.shape)
        return state

    def full_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state dict with every parameter's current value (full precision),
        gathered in memory."""
        state = super().lightning_module_state_dict()
        manager = self.tensor_manager
        if manager is None:
            return state
        master = self._master_source(manager) or manager.unit_master_weights
        for u in range(manager.num_units):
            for slot, value in zip(manager.layouts[u].params, master(u)):
                if slot.name in state:
                    state[slot.name] = value
        return state

    def _master_source(self, manager: TieredTensorStore) -> Any:
        """Partitioned state: full-precision weights gathered from every rank's chunk (collective: every
        rank calls it); None: the manager's own."""
        if manager.shard is None:
            return None
        return ShardedStateView(manager, self.global_rank, self.world_size).unit_master_weights

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        manager = self.tensor_manager
        if manager is None or manager.optimizer is None:
            return super().optimizer_state(optimizer)
        state = optimizer.state_dict()
        state["state"] = STREAMED_STATE  # streamed unit by unit by save_checkpoint
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        manager = self.tensor_manager
        if manager is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                f"trainer.save_checkpoint(..., storage_options={storage_options!r}): greedysnake writes its "
                "checkpoint directory itself, without a CheckpointIO plugin. Fix: drop storage_options."
            )
        if "://" in str(filepath):
            raise ValueError(
                f"checkpoint path {filepath!r}: greedysnake saves to a local or mounted filesystem (it streams "
                "every unit and renames atomically). Fix: save locally and copy the directory afterwards."
            )
        if manager.shard is not None and not self.is_global_zero:
            # partitioned state: rank 0 writes, every rank contributes its chunks
            join_save(ShardedStateView(manager, self.global_rank, self.world_size),
                      checkpoint.get("optimizer_states") is not None and manager.optimizer is not None)
            return
        if self.is_global_zero:
            t0 = time.perf_counter()
            trainer = self.lightning_module.trainer
            # the state changes only at optimizer steps: a second save at the same step (save_last after
            # a top-k save) links the first one's files
            version = (id(manager), trainer.global_step, self._checkpoint_loads)
            view = ShardedStateView(manager, self.global_rank, self.world_size) if manager.shard else manager
            self._last_saved = save_streamed(
                view, checkpoint, filepath, self._layered_prefix(), str(self.precision_plugin.precision),
                version=version, previous=None if manager.shard else self._last_saved)
            self.last_checkpoint_seconds = time.perf_counter() - t0

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero and is_checkpoint_dir(filepath) and not Path(filepath).is_symlink():
            shutil.rmtree(filepath)
            return
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if is_checkpoint_dir(checkpoint_path):
            return load_streamed(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        manager = self.tensor_manager
        state_dict = checkpoint["state_dict"]
        if manager is None:
            if isinstance(state_dict, StreamedStateDict):
                raise ValueError(
                    f"checkpoint {state_dict.reader.path} holds state streamed from SSD; loading it needs the "
                    "tensor manager (an offload placement with something off the device). Fix: export it "
                    "with `python -m lightning_greedysnake.export` to load it elsewhere."
                )
            return super().load_model_state_dict(checkpoint, strict=strict)
        self._checkpoint_loads += 1
        load_model_into(manager, self.lightning_module, state_dict, strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        manager = self.tensor_manager
        if manager is None or manager.optimizer is None:
            return super().load_optimizer_state_dict(checkpoint)
        (opt_state,) = checkpoint["optimizer_states"]
        load_optimizer_into(manager, self.optimizers[0], opt_state)

    def _layered_prefix(self) -> str:
        return f"{self._layered_path}." if self._layered_path else ""

    def _capture_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """Run training_step up to its model call and return the model's inputs (logging muted)."""

        def capture(*a: Any, **kw: Any) -> Any:
            raise _CapturedInputs(a, kw)

        with self._forward_replaced(capture), self._logging_muted():
            try:
                with self.precision_plugin.train_step_context():
                    self.lightning_module.training_step(*args, **kwargs)
            except _CapturedInputs as captured:
                return captured.args, captured.kwargs
        raise ValueError(self._no_model_call_message())

    def _no_model_call_message(self) -> str:
        where = self._layered_path or "the LightningModule itself"
        return (
            f"training_step did not call the layered model ({where}: {type(self._layered).__name__}). "
            "strategy='greedysnake' runs that model unit by unit and needs training_step to call it exactly "
            "once per micro-batch. Fix: call it in training_step, or point layered_module at the module "
            "training_step calls."
        )

    @contextlib.contextmanager
    def _forward_replaced(self, fn: Callable[..., Any]) -> Iterator[None]:
        """Answer calls to the layered model with ``fn``; an instance attribute shadows the class's
        ``forward`` while nn.Module.__call__ (and any hooks) stay in place."""
        module = self._layered
        assert module is not None
        previous = module.__dict__.get("forward")
        module.forward = fn  # type: ignore[method-assign]
        try:
            yield
        finally:
            if previous is None:
                del module.forward
            else:
                module.forward = previous  # type: ignore[method-assign]

    @contextlib.contextmanager
    def _logging_muted(self) -> Iterator[None]:
        module = self.lightning_module
        module.log = lambda *a, **k: None  # type: ignore[method-assign]
        module.log_dict = lambda *a, **k: None  # type: ignore[method-assign]
        try:
            yield
        finally:
            del module.log
            del module.log_dict

    # -- evaluation ---------------------------------------------------------------------------------
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_replaced(self.engine.eval_forward):
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_replaced(self.engine.eval_forward):
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._forward_replaced(self.engine.eval_forward):
            return super().predict_step(*args, **kwargs)
