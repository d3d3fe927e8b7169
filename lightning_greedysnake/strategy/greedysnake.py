"""The strategy: Lightning's hooks routed to the engine and the tensor manager. Owns no tensor logic.

How a window of K micro-batches maps onto Lightning (automatic optimization, accumulate_grad_batches=K):

- micro-batch m's ``training_step`` -> the engine runs the plan up to the fused op ``L.m`` (vertically at
  m=0: every unit but the last, for all K micro-batches, read ahead through
  :class:`~lightning_greedysnake.strategy.inputs.WindowInputs`), then the user's own ``training_step``
  runs with the layered model's ``forward`` answered by the fused op: the last unit and head, from the
  checkpoint. The user's loss and ``self.log`` calls are real.
- micro-batch m's ``backward`` -> the loss is back-propagated through the fused op; the engine then runs
  the backward ops that follow (vertically after the last micro-batch: unit by unit, recomputing).
- the optimizer step -> :meth:`GreedySnakeStrategy.optimizer_step`, Lightning's own seam, runs the whole
  sequence in one place: the closure and the rest of the window's backward, Lightning's part through the
  precision plugin (``on_before_optimizer_step``, gradient clipping, ``optimizer.step()``), the window's
  remaining steps, the loss scale, telemetry and the warm-step plan. LR schedulers and ``global_step``
  stay Lightning's.

Each concern beside the routing lives in its own module of this package: a run's parts, built at setup
and closed at teardown (``run``), data-parallel plumbing
(``data_parallel``), the offload directory (``offload_dir``), window inputs (``inputs``), meta models
(``manager_setup``, which also builds the tensor manager), checks (``checks``), the planner (``planning``), checkpoints (``checkpoints``),
progress (``progress``), and the Lightning internals it needs (``lightning_api``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_greedysnake.config import GreedySnakeConfig, OffloadConfig, RunConfig, Tier
from lightning_greedysnake.distributed import ShardedStateView
from lightning_greedysnake.engine import WindowEngine
from lightning_greedysnake.offload import TensorStore
from lightning_greedysnake.offload.device import simulate_device_enabled
from lightning_greedysnake.offload.preflight import new_owner
from lightning_greedysnake.optim import ClipPolicy
from lightning_greedysnake.planner import Choice
from lightning_greedysnake.precision import GreedySnakePrecision
from lightning_greedysnake.steps import step_running
from lightning_greedysnake.strategy import after_fit, checkpoints, checks, progress, readable
from lightning_greedysnake.strategy.data_parallel import DataParallelStrategy
from lightning_greedysnake.strategy.inputs import forward_replaced, loss_of, read_ahead, tokens_in
from lightning_greedysnake.strategy.manager_setup import move_all_but_units
from lightning_greedysnake.strategy.planning import plan_before_setup
from lightning_greedysnake.strategy.planning.placement import PlacementPlan
from lightning_greedysnake.strategy.run import Run, cut_model, open_run
from lightning_greedysnake.strategy.setup_context import SetupContext
from lightning_greedysnake.telemetry import StepTelemetry
from lightning_greedysnake.tensor_manager import TieredTensorStore

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "greedysnake": ("GreedySnake, its schedule and placement planned (vertical wherever state streams)", {}),
    "greedysnake_horizontal": (
        "the horizontal (ZeRO-Infinity) order on the greedysnake engine", {"schedule": "horizontal"}),
    "greedysnake_cpu": (
        "GreedySnake vertical schedule with every tensor in host memory (no SSD tier)",
        {"schedule": "vertical", "offload": OffloadConfig.everywhere(Tier.HOST)},
    ),
}
"""``Trainer(strategy=name)``: the registered names and their settings."""


class GreedySnakeStrategy(DataParallelStrategy):
    """Trains a layered model with GreedySnake's vertical schedule and recompute backward.

    Args:
        config: a full :class:`GreedySnakeConfig`; keyword settings below override its fields.
        checkpoint_io: Lightning's checkpoint IO plugin.
        precision_plugin: usually left out; ``Trainer(precision=...)`` decides.
        **settings: any :class:`GreedySnakeConfig` field, e.g. ``schedule="horizontal"``,
            ``layers_per_unit=2``.
    """

    strategy_name = "greedysnake"
    _gs_precision: GreedySnakePrecision | None
    """The precision plugin, translated (set by the ``precision_plugin`` setter, which Lightning's
    ``Strategy.__init__`` calls); None: none chosen yet."""

    @override
    def __init__(self, config: GreedySnakeConfig | Mapping[str, Any] | None = None, *,
                 checkpoint_io: CheckpointIO | None = None, precision_plugin: Precision | None = None,
                 **settings: Any) -> None:
        if isinstance(config, Mapping):
            settings = {**config, **settings}
            config = None
        # validate first: bad settings fail at construction, before Lightning does anything
        self.settings = GreedySnakeConfig.from_kwargs(config, **settings)
        """What the user set (``None``: unset, the planner's with ``auto=True``)."""
        self._fixed = self.settings.resolved()
        """The settings with every unset one at its fixed default: what is known before a setup plans."""
        super().__init__(checkpoint_io=checkpoint_io)  # sets precision_plugin = None (the setter below)
        self.precision_plugin = precision_plugin
        self._run: Run | None = None
        """This setup's parts (kept after teardown, closed, for what the run planned and measured)."""
        self._batch_idx = 0
        """The epoch-local index of the batch in progress (from ``on_train_batch_start``)."""
        self._warned: set[str] = set()
        self._gradient_hooks: OrderedDict[int, Callable[[str, Tensor], None]] = OrderedDict()
        """:meth:`register_gradient_hook`'s hooks (registered on the training thread, between steps)."""
        self._failed = False
        self._unusable: after_fit.UnusableUntilLoaded | None = None
        """After a teardown that could not give the module its state back: its fail-on-use hooks."""
        self._read_guard: readable.ReadGuard | None = None
        """During a run with the tensor manager: a module's ``state_dict`` refuses outside :meth:`parameters_readable`."""
        self._owner = new_owner()
        """This strategy's mark in its offload directories' lock records (:attr:`SetupContext.owner`)."""

    # -- the precision plugin ----------------------------------------------------------------------
    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> GreedySnakePrecision:
        if self._gs_precision is None:
            # not stored in _precision_plugin: Lightning must still see "none chosen" and build one from
            # Trainer(precision=...), which the setter below then translates
            return GreedySnakePrecision()
        return self._gs_precision

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning installs a plain plugin built from Trainer(precision=...) after constructing a
        # strategy chosen by name; keep ours (translated) instead, or refuse what we cannot honour.
        self._gs_precision = None if plugin is None else GreedySnakePrecision.from_plugin(plugin)
        self._precision_plugin = self._gs_precision

    # -- what the strategy exposes ------------------------------------------------------------------
    @property
    def config(self) -> RunConfig:
        """The settings in effect: the run's one resolved configuration, which its engine and tensor
        manager were built from (the warm-step plan's after it ran); before setup, the settings with
        every unset one at its fixed default."""
        return self._run.config if self._run is not None else self._fixed

    @property
    def placement_plan(self) -> PlacementPlan | None:
        """The placement planned at setup (``auto=True`` and a kind left unset)."""
        return self._run.placement if self._run is not None else None

    @property
    def plan_choice(self) -> Choice | None:
        """The warm-step plan's choice when ``auto=True`` (after the second optimizer step)."""
        return self._run.planner.choice if self._run is not None and self._run.planner is not None else None

    @property
    def engine(self) -> WindowEngine:
        return self._open_run().engine

    @property
    def store(self) -> TensorStore:
        return self._open_run().store

    @property
    def tensor_manager(self) -> TieredTensorStore | None:
        """The SSD/host tensor manager, when the placement uses one (None: everything on the device, or
        not set up)."""
        run = self._run
        return run.tensor_manager if run is not None and not run.closed else None

    def _open_run(self) -> Run:
        assert self._run is not None and not self._run.closed, "the strategy is not set up"
        return self._run

    def register_gradient_hook(self, hook: Callable[[str, Tensor], None]) -> RemovableHandle:
        """Call ``hook(name, grad)`` once per optimizer step for every trainable parameter that the tensor
        manager steps, with its complete gradient: accumulated over the window's micro-batches, averaged
        over the ranks (with ``shard_state``, only this rank's chunk is sure to be), unscaled under fp16,
        before clipping. With offloading ``param.grad`` is never populated: this is how to see gradients.
        ``name`` is the parameter's name in the LightningModule. The hook runs on the thread that runs the
        step (the optimizer lane) and ``grad`` is valid only during the call: clone what you keep.
        Returns a handle whose ``remove()`` unregisters the hook."""
        handle = RemovableHandle(self._gradient_hooks)
        self._gradient_hooks[handle.id] = hook
        return handle

    def gradient_hooks(self, unit: int, flat: Tensor) -> None:
        """The tensor manager's gradient observer: ``unit``'s complete flat gradient to every registered
        hook, parameter by parameter (on the thread running the step)."""
        hooks = list(self._gradient_hooks.values())
        manager = self._run.tensor_manager if self._run is not None else None  # (closing too: the last steps)
        if not hooks or manager is None:
            return
        for slot in manager.layouts[unit].params:
            if slot.group is not None:
                grad = flat[slot.offset_numel : slot.offset_numel + slot.numel].view(slot.shape)
                for hook in hooks:
                    hook(slot.name, grad)

    def io_stats(self) -> dict[str, float]:
        """The tensor manager's I/O counters so far: ``{"ssd/weights/bytes_read": ..., ...}`` (bytes,
        busy seconds and the seconds training waited, per kind and tier); after fit, the whole fit's (the
        end-of-fit summary's numbers); empty without offload."""
        manager = self._run.tensor_manager if self._run is not None else None  # (closed too: final counters)
        return manager.stats.flat() if manager is not None else {}

    @property
    def step_telemetry(self) -> list[StepTelemetry]:
        """Per optimizer step: lane busy seconds (SSD read, SSD write, optimizer), compute, the seconds the
        training thread waited on reads and on the optimizer, bytes per kind. Empty without offload."""
        telemetry = self._run.telemetry if self._run is not None else None
        return telemetry.history if telemetry is not None else []

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, (description, params) in PRESETS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **params)

    # -- setup and teardown ---------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        module = self.lightning_module
        assert module is not None
        checks.check_accumulation(trainer.accumulate_grad_batches)  # (Lightning lets 0 through)
        if self._unusable is not None:  # this run gives the module its state (from the model or a checkpoint)
            self._unusable.remove()
            self._unusable = None
        fitting = trainer.state.fn == TrainerFn.FITTING
        self.precision_plugin.on_device(self.root_device)  # (autocast on the accelerator's device type)
        ctx = SetupContext(
            self.settings, self.root_device, simulate_device_enabled(), self.global_rank, self.local_rank,
            self.world_size, self.num_processes, trainer.accumulate_grad_batches, Path(trainer.default_root_dir),
            fitting, self.precision_plugin, self.broadcast, self.broadcast_parameters, self.data_parallel_hooks,
            self.gradient_hooks, self._warn_once, rank_zero_info, owner=self._owner)
        before = plan_before_setup(ctx, module)  # (the device plan and the host budget, before Lightning's setup)
        cut = cut_model(ctx, before.config, module)
        uses_manager = cut.config.offload.uses_tensor_manager
        if uses_manager:  # the units stay where they are: the tensor manager brings them to the device one by one
            move_all_but_units(module, cut.units, self.root_device)
        else:
            module.to(self.root_device)
        super().setup(trainer)  # optimizers, precision plugin (the model is placed: model_to_device below)
        if fitting:
            checks.check_optimizers(self.optimizers)
            checks.check_cpu_precision(self.precision_plugin, self.root_device, self._warn_once)
            checks.check_loss_scaling(self.precision_plugin, uses_manager)
        optimizer = self.optimizers[0] if (fitting and self.optimizers) else None
        clip = checks.clip_policy(trainer, module, self._warn_once) if fitting and uses_manager else ClipPolicy()
        self._run = run = open_run(ctx, before, module, cut, optimizer, clip)
        self.precision_plugin.gradient_owner = run.tensor_manager  # (clipping acts on its buffers)
        if run.tensor_manager is not None:  # (its parameters are NaN placeholders between uses)
            self._read_guard = readable.ReadGuard(module, [p for ps in run.tensor_manager.params for p in ps],
                                                  run.name)

    @override
    def model_to_device(self) -> None:
        """Nothing: :meth:`setup` placed the model before Lightning's setup calls this, all of it on the device
        but the units the tensor manager keeps in its tiers (setup's cut decides which; moving them would
        need the whole model in device memory)."""

    @contextlib.contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``trainer.init_module(empty_init=True)``: with the tensor manager, build the model on the meta
        device; setup then materializes it one unit at a time straight into its tiers."""
        if empty_init and self._fixed.offload.uses_tensor_manager:  # (before this setup: not a past run's plan)
            with torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
        else:
            with super().tensor_init_context(empty_init):
                yield

    @override
    def on_exception(self, exception: BaseException) -> None:
        # teardown follows: it must clean up without raising again over the original error
        self._failed = True
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        failed, self._failed = self._failed, False
        run = self._run
        if self._read_guard is not None:  # (the hand-back gives the parameters their values, or its own refusal)
            self._read_guard.remove()
            self._read_guard = None
        try:
            if run is not None and not run.closed:  # (closed: a second teardown, nothing to say again)
                run.close(lambda manager: self._hand_back(run, manager, failed))
                progress.end_of_fit(run.tensor_manager, self.lightning_module.trainer, failed, rank_zero_info)
        finally:
            self.precision_plugin.gradient_owner = None
            super().teardown()

    def _hand_back(self, run: Run, manager: TieredTensorStore, failed: bool) -> None:
        """The LightningModule should be usable after fit, as with any other strategy."""
        values = manager.values
        view = ShardedStateView(values, self.global_rank, self.world_size) if values.shard else values
        assert run.hand_back is not None  # (planned with the tensor manager)
        self._unusable = after_fit.hand_back(
            manager, view, run.layered, run.hand_back, name=run.name, failed=failed, distributed=self.is_distributed,
            global_step=self.lightning_module.trainer.global_step, warn=rank_zero_warn,
            nonfinite=run.guard.stepped_nonfinite)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)

    # -- data ---------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        return read_ahead(dataloader, trainer.accumulate_grad_batches)  # (also before setup opens the run)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._open_run().engine.rng.start()  # (the RNG policy's base seed: as MicrobatchRNG draws it, here)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    # -- the training step ------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        run = self._open_run()
        engine, inputs, telemetry = run.engine, run.inputs, run.telemetry
        module = self.lightning_module
        trainer = module.trainer
        microbatch = inputs.open_window(engine, self._batch_idx, trainer.accumulate_grad_batches,
                                        trainer.num_training_batches, self._warn_once, trainer.train_dataloader,
                                        trainer.global_step)
        inputs.feed(engine, microbatch, module, args, kwargs, self.precision_plugin.train_step_context,
                    trainer.precision_plugin.convert_input, lambda b: self.batch_to_device(b, dataloader_idx=0))
        engine.run_until_fused(microbatch)

        def fused(*a: Any, **kw: Any) -> Any:
            if telemetry is not None:
                telemetry.tokens += tokens_in(a, kw)
            with self._timed(f"L{engine.units[-1].index}.{microbatch} forward"):
                return engine.fused_forward(microbatch, a, kw)

        with forward_replaced(inputs.layered, fused):
            output = super().training_step(*args, **kwargs)
        if engine.fused_pending != microbatch:
            raise ValueError(inputs.no_model_call_message())
        if microbatch == 0 and telemetry is not None:
            progress.show_progress(module, telemetry.history[-1] if telemetry.history else None)
        if loss_of(output) is None:
            # Lightning skips backward when training_step returns no loss: this micro-batch adds nothing
            engine.fused_backward_done(microbatch)
        return output

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        run = self._open_run()
        engine = run.engine
        microbatch = engine.fused_pending
        assert microbatch is not None, "backward called without a fused forward"
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        with self._timed(f"L{engine.units[-1].index}.{microbatch} backward"):
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        plan = engine.plan
        last = plan is None or microbatch == plan.num_microbatches - 1
        if run.guard.drops_window(closure_loss, microbatch, last=last, step=int(module.trainer.global_step)):
            engine.abort_window()  # no unit of the window was stepped yet: its gradients go
            module.zero_grad(set_to_none=True)  # (everything resident: Lightning's own step finds none)
        else:
            engine.fused_backward_done(microbatch)  # the ops that follow (vertically, after the last: backward)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        """The window's optimizer step, the whole sequence (Lightning calls it at the window's last
        micro-batch, ``closure`` running that one's ``training_step`` and backward):

        1. the closure, then what the schedule left after it (vertically: the unit by unit backward, whose
           units are stepped as their gradients complete), unless the non-finite guard dropped the window;
        2. Lightning's own part, through the precision plugin: ``on_before_optimizer_step``, clipping (which
           the plugin routes to the tensor manager) and the user's ``optimizer.step()``: without a tensor
           manager that is the step; with one the parameters hold no gradient and it updates none (an
           optimizer's own per-call counters, pytorch-optimizer's ``group['step']``, are the units' to keep:
           :class:`~lightning_greedysnake.optim.unit_optimizer.CallState`, published at a checkpoint and at the
           end of fit);
        3. with the tensor manager: the window's remaining steps, as its step mode (chosen at setup) runs
           them; the loss scale's update; the step's telemetry and the gradients the lane found not
           finite; after the warm step, the warm-step plan.
        """
        run = self._open_run()
        trainer = self.lightning_module.trainer
        step = int(trainer.global_step)  # (Lightning counts this step once it returns)
        dropped = False

        def closure_then_finish_window() -> Any:
            nonlocal dropped
            output = closure()
            # before the hooks and clipping that Lightning runs as this returns, which read the gradients
            dropped = run.guard.end_window(step)
            if not dropped:
                run.engine.finish_window()
            if self.is_distributed and run.tensor_manager is None:
                self.average_param_grads(self.lightning_module.parameters())
            return output

        output = super().optimizer_step(optimizer, closure_then_finish_window, model, **kwargs)
        manager = run.tensor_manager
        if manager is None:
            return output
        scaler = self.precision_plugin.loss_scaler
        stepped = manager.finish_step(scaler.inv_scale if scaler is not None else None)
        if scaler is not None:  # (a dropped window counts as an overflow, as GradScaler would see it)
            before = scaler.scale
            if scaler.update(found_inf=dropped or not stepped, step=step + 1):  # (normal with fp16; as DeepSpeed)
                rank_zero_info(f"greedysnake: fp16 gradients overflowed in {step_running(step)}: step skipped, "
                               f"loss scale {before:g} -> {scaler.scale:g}")
        assert run.telemetry is not None and run.planner is not None  # (built with the tensor manager)
        plan_due = run.planner.step_ended()
        if run.timer is not None:  # once per window: the compute spans the device finished (all, for the plan)
            run.timer.collect(wait=plan_due)
        entry = run.telemetry.record()
        run.guard.check_gradients(manager.stepper.take_nonfinite(), step)
        if plan_due:  # between windows: the engine reads its settings op by op
            run.apply(run.planner.plan_warm_step(manager, run.engine.activation_bytes, run.config))
        progress.log_step(trainer, entry)
        return output

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        """Times the body as compute op ``name`` (with the tensor manager's timer; not when it raises)."""
        timer = self._open_run().timer
        mark = timer.start() if timer is not None else None
        yield
        if timer is not None:
            timer.stop(mark, name)

    # -- state dicts and checkpoints (the tensor manager holds the real values) -------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # with a tensor manager, a checkpoint's state goes into it unit by unit, so it must exist first. Asked
        # before setup and after it: the settings', not the plan's (which may put all on the GPU in between)
        return self.settings.offload.uses_tensor_manager

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Lightning's state dict for checkpoints; with the tensor manager, placeholders that
        :meth:`save_checkpoint` streams from the tiers (:meth:`full_state_dict` gives real tensors)."""
        with self._own_read():
            return self._checkpoints.module_state(super().lightning_module_state_dict())

    def full_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state dict with every parameter's current value (full precision),
        gathered in memory (collective with partitioned state: every rank calls it)."""
        with self._own_read():
            return self._checkpoints.full_state(super().lightning_module_state_dict())

    def _own_read(self) -> Any:
        """The strategy's own state dicts (their placeholders replaced from the tiers) pass the read guard."""
        return self._read_guard.open() if self._read_guard is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def parameters_readable(self, trainable_only: bool = False) -> Iterator[None]:
        """During fit, bind the LightningModule's parameters to their current values for the block, so code that
        reads them directly works: a Callback saving the adapters with PEFT's ``model.save_pretrained(dir)`` or
        LitGPT's LoRA checkpoint of ``model.state_dict()``. Outside it, a ``state_dict()`` of the model during fit
        refuses (:class:`~lightning_greedysnake.strategy.readable.PlaceholderRead`): between uses the parameters
        are NaN placeholders. Enter it between optimizer steps (a Callback's ``on_train_batch_end``,
        ``on_train_epoch_end``, ``on_save_checkpoint``); pending updates complete first. ``trainable_only``: bind
        only the trained parameters (a LoRA run's adapters: a few MB, where the frozen base would take its whole
        size in host memory for the block); the frozen ones stay placeholders. Read only: writes into the
        parameters in the block are not kept. With partitioned state (``shard_state``) every rank enters it (it
        gathers the units). Without the tensor manager (not set up, every kind on the device,
        after fit) the parameters are real already: nothing to do."""
        run = self._run
        manager = run.tensor_manager if run is not None and not run.closed else None
        if manager is None:
            yield
            return
        values = manager.values
        view = ShardedStateView(values, self.global_rank, self.world_size) if values.shard else values
        with readable.readable(manager, view, self._read_guard, trainable_only):
            yield

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._checkpoints.optimizer_state(optimizer, super().optimizer_state)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self._checkpoints.save(checkpoint, filepath, storage_options, super().save_checkpoint)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            checkpoints.remove(filepath, super().remove_checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint_path = checkpoints.resume_path(checkpoint_path, self.lightning_module)  # a killed first save
        return self._checkpoints.load(
            checkpoint_path, lambda: super(GreedySnakeStrategy, self).load_checkpoint(checkpoint_path, weights_only=weights_only))

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self._checkpoints.load_model(self.lightning_module, checkpoint, strict, super().load_model_state_dict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._checkpoints.load_optimizer(self.optimizers[0] if self.optimizers else None, checkpoint,
                                         super().load_optimizer_state_dict)

    @property
    def _checkpoints(self) -> checkpoints.CheckpointSeam:
        run = self._run
        return run.checkpoints if run is not None and not run.closed else checkpoints.LIGHTNING

    # -- evaluation ---------------------------------------------------------------------------------
    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with forward_replaced(self._layered_module(), self.engine.eval_forward):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with forward_replaced(self._layered_module(), self.engine.eval_forward):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with forward_replaced(self._layered_module(), self.engine.eval_forward):
            return super().predict_step(*args, **kwargs)

    def _layered_module(self) -> nn.Module:
        return self._open_run().layered
