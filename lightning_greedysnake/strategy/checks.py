"""What the strategy refuses or warns about before any work starts: module hooks it cannot honour,
optimizers it cannot step unit by unit, and how the Trainer's gradient clipping maps onto the stepper."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

from lightning_greedysnake.optim import ClipPolicy, UnsupportedOptimizerError
from lightning_greedysnake.optim.contract import refusal
from lightning_greedysnake.precision import cpu_bf16_slowdown, slow_bf16_warning

Warn = Callable[[str, str], None]
"""``warn(key, message)``: warn once per key."""


def check_module_for_training(module: LightningModule, warn: Warn) -> None:
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
        warn(
            "on_after_backward",
            f"{type(module).__name__}.on_after_backward runs after each micro-batch's backward through the "
            "last unit only; with strategy='greedysnake' the earlier units' gradients are complete only "
            "in on_before_optimizer_step. Inspect gradients there.",
        )


def check_optimizers(optimizers: list[Any]) -> None:
    if len(optimizers) != 1:
        raise ValueError(
            f"strategy='greedysnake' needs exactly one optimizer from configure_optimizers (got "
            f"{len(optimizers)}). Fix: return one optimizer, with several param groups if needed."
        )
    why = refusal(type(optimizers[0]))  # (on every placement: the engine runs one forward per micro-batch)
    if why is not None:
        raise UnsupportedOptimizerError(f"strategy='greedysnake' cannot step {why}")


def clip_policy(trainer: Any, module: LightningModule, warn: Warn) -> ClipPolicy:
    """Clipping by value is applied unit by unit as each gradient completes; clipping by norm (or a
    custom ``configure_gradient_clipping``) needs every gradient first, so every step waits for it."""
    custom = type(module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping
    value = trainer.gradient_clip_val
    algorithm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm")
    if custom:
        warn(
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


def check_loss_scaling(plugin: Any, uses_tensor_manager: bool) -> None:
    """``16-mixed`` scales the loss for the tensor manager's deferred, all-or-nothing step; with every
    kind on the device Lightning's own strategy does the same with ``torch.amp.GradScaler``."""
    if getattr(plugin, "loss_scaler", None) is not None and not uses_tensor_manager:
        raise ValueError(
            "precision='16-mixed' with every kind of tensor on 'device' is Lightning's own fp16 training. Fix: "
            "Trainer(strategy='auto', precision='16-mixed'), or offload a kind (e.g. offload.optimizer_states="
            "'host') to train it with greedysnake."
        )


def check_cpu_precision(plugin: Any, device: torch.device, warn: Warn) -> None:
    """``bf16-mixed`` on a CPU without native bf16 runs about 100x slower than fp32: measure it (a few
    milliseconds) and say so, with the fix."""
    if getattr(plugin, "precision", None) == "16-mixed" and device.type == "cpu":
        warn("cpu_fp16", "precision='16-mixed' on a CPU, as asked through GreedySnakePrecision('16-mixed'): fp16 "
             "autocast with loss scaling runs here to test the path, without a speed advantage (Lightning itself "
             "turns Trainer(precision='16-mixed') into bf16-mixed on a CPU, the CPU's mixed precision).")
    if getattr(plugin, "precision", None) == "bf16-mixed" and device.type == "cpu":
        message = slow_bf16_warning(cpu_bf16_slowdown())
        if message is not None:
            warn("slow_bf16", message)


def check_accumulation(accumulate_grad_batches: Any) -> None:
    """``Trainer(accumulate_grad_batches=K)`` is the window's micro-batch count: a positive integer. Lightning
    accepts 0 (and negative numbers) and fails later, mid-run, dividing by it; refused here, before any work."""
    k = accumulate_grad_batches
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={k!r}): strategy='greedysnake' runs each optimizer step over a "
            "window of accumulate_grad_batches micro-batches, so it must be a positive integer. Fix: set "
            "Trainer(accumulate_grad_batches=1) for one optimizer step per batch, or the number of batches "
            "to accumulate per step (e.g. 8)."
        )


def check_parameter_dtypes(module: torch.nn.Module, units: Any, compute_dtype: torch.dtype, precision: str) -> None:
    """Refuse a layered model's parameter whose dtype the tensor manager would change, before any work.

    Every parameter of the layered model is laid out as ``compute_dtype`` compute weights, a trainable one
    with an fp32 master copy: exact for an fp32 parameter, and for a frozen one already in the compute dtype
    (a bf16 base under ``bf16-mixed``). Any other (a frozen bf16 base under ``32-true``, PEFT's usual setup; a
    trainable bf16 parameter, which Lightning would step in bf16; an int8 or NF4 base) would compute with
    other values than Lightning does: refused, naming the parameter."""
    names = {id(p): n for n, p in module.named_parameters()}
    for unit in units:
        for p in unit.parameters():
            if p.dtype == torch.float32 or (not p.requires_grad and p.dtype == compute_dtype):
                continue
            name = names.get(id(p), f"a parameter of unit {unit.index}")
            role = "trainable" if p.requires_grad else "frozen"
            raise ValueError(
                f"parameter {name!r} is {str(p.dtype).removeprefix('torch.')} ({role}), but under precision="
                f"{precision!r} strategy='greedysnake' keeps every parameter of the layered model as "
                f"{str(compute_dtype).removeprefix('torch.')} compute weights"
                f"{', a trainable one with float32 master weights' if compute_dtype != torch.float32 else ''}: it "
                "would train with other values than Lightning does. Parameters in their own dtype (a frozen bf16 "
                "or quantized base for LoRA) are not supported yet. Fix: keep the model in float32 (model.float() "
                "before fit), use precision='bf16-mixed' for a frozen bfloat16 base, or strategy='auto'.")
