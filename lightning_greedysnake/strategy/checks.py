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
    """Refuse a layered model's parameter that the tensor manager would train with other values than
    Lightning does, before any work, naming it.

    A trainable parameter is laid out as ``compute_dtype`` compute weights with an fp32 master copy: exact
    for an fp32 one only (a trainable bf16 parameter Lightning would step in bf16). A frozen one is
    read-only and kept in its own dtype (a bf16 base beside fp32 adapters, PEFT's usual setup; an int8
    base), or in the compute dtype where it is float32 (the precision policy's): refused where its dtype is
    wider than the compute dtype (float64), or where it is a tensor subclass (torchao's NF4 or int8
    weight-only tensors: their bytes are not a plain array to stream)."""
    names = {id(p): n for n, p in module.named_parameters()}
    dtype_name = str(compute_dtype).removeprefix("torch.")
    for unit in units:
        for p in unit.parameters():
            name = names.get(id(p), f"a parameter of unit {unit.index}")
            own = str(p.dtype).removeprefix("torch.")
            if type(p.data) not in (torch.Tensor, torch.nn.Parameter):
                raise ValueError(
                    f"parameter {name!r} is a {type(p.data).__name__} (a tensor subclass: a quantized base such as "
                    "torchao's NF4 or int8 weight-only tensors), which strategy='greedysnake' cannot stream from "
                    "its tiers: its bytes are not one plain array. Fix: dequantize the base into a plain bfloat16 "
                    "tensor before fit (frozen, it is kept read-only in bfloat16: half the bytes of float32), or "
                    "use strategy='auto'.")
            if p.requires_grad and p.dtype != torch.float32:
                raise ValueError(
                    f"parameter {name!r} is {own} (trainable), but under precision={precision!r} "
                    f"strategy='greedysnake' steps every trainable parameter on a float32 master copy (kept as "
                    f"{dtype_name} compute weights): Lightning would step it in {own}, so it would train with other "
                    "values. Fix: keep the trainable parameters in float32 (model.float() before fit, or only the "
                    "trainable ones: a frozen base may stay in its own dtype), or use strategy='auto'.")
            if not p.requires_grad and p.dtype != torch.float32 and p.dtype.itemsize > compute_dtype.itemsize:
                raise ValueError(
                    f"parameter {name!r} is {own} (frozen): strategy='greedysnake' keeps a frozen parameter "
                    f"read-only in its own dtype where that is no wider than the compute dtype ({dtype_name} under "
                    f"precision={precision!r}), so it would compute with other values than Lightning does. Fix: "
                    f"cast it to {dtype_name} or float32 before fit, or use strategy='auto'.")
