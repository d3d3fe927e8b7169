"""``auto=True`` on a GPU, before anything else is planned: a model whose whole training state fits the
device keeps every kind there (no offload: the vertical engine over device-resident units, and
Lightning steps your optimizer on the GPU). Offloading is for what does not fit; a model that does
would only pay PCIe and disk time for it.

What counts: each trainable parameter's weights, gradient and two optimizer moments (Adam's: four
copies of the parameter's bytes, 16 per fp32 parameter), a frozen one's weights, against half the device
budget (``auto_device_budget_bytes``, default: this GPU's free memory at setup); the other half is left
for activations, which depend on the batch setup does not see, and the allocator's own. Every setting
you give is kept: a kind you placed, a setting only the tensor manager serves (``16-mixed``'s loss
scaling, ``optimizer_state_dtype``), a model built on the meta device (``empty_init``: nothing would
materialize it on the device) each keep the offload plan, and the report says which. A run planned onto
the device resumes a checkpoint an offloaded run streamed (gathered in memory, as ``export --lightning``
gathers it). Every rank applies rank 0's decision.

A model that does not fit is offloaded, but not wholly: setup's placement
(:mod:`lightning_greedysnake.strategy.planning.placement`) then keeps what fits of its compute weights resident
on the device, a prefix of units, in :func:`weights_room_bytes` (of the budget :func:`device_budget_bytes`
measures), beside the host optimizer.

Pure over its inputs but for the measurement of the device's free memory (``torch.cuda.mem_get_info``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_greedysnake.config import GreedySnakeConfig, OffloadConfig, TensorKind, Tier
from lightning_greedysnake.layout import StateLayout

STATE_SHARE = 2
"""The model's state may take at most 1/``STATE_SHARE`` of the device budget (the rest: activations,
the allocator)."""

COPIES_PER_TRAINABLE = 4
"""Weights, gradient and two optimizer moments, each the parameter's size (Adam, AdamW)."""


def weights_room_bytes(state: StateLayout, offload: OffloadConfig, budget_bytes: int) -> int:
    """Device memory setup's placement may give compute weights kept resident when the whole model does
    not fit (:func:`~lightning_greedysnake.planner.placement.plan_placement` puts them there first, a
    prefix of units): 1/``STATE_SHARE`` of the device budget (the rest: activations and the allocator, as
    above), less the device tier's own working set: the unit computing and ``prefetch_units`` more
    (the weights of units not resident) and two units' fp32 gradient accumulators (one accumulating,
    one copying out)."""
    n = state.num_units
    weights = max((state.region_bytes(TensorKind.WEIGHTS, u) for u in range(n)), default=0)
    grads = max((state.region_bytes(TensorKind.GRADIENTS, u) for u in range(n)), default=0)
    working = (1 + offload.prefetch_units) * weights + 2 * grads
    return max(0, budget_bytes // STATE_SHARE - working)


def device_budget_bytes(settings: GreedySnakeConfig, device: torch.device) -> int | None:
    """``auto_device_budget_bytes``, else the free memory of ``device`` (a GPU); None where there is
    nothing to measure (the simulated device, whose memory is the host's)."""
    if settings.auto_device_budget_bytes is not None:
        return settings.auto_device_budget_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return None


def model_state_bytes(module: nn.Module) -> int:
    """Device bytes of training ``module`` with every kind resident (see :data:`COPIES_PER_TRAINABLE`)."""
    return sum(p.numel() * p.element_size() * (COPIES_PER_TRAINABLE if p.requires_grad else 1)
               for p in module.parameters())


def why_offloaded(settings: GreedySnakeConfig, module: nn.Module, *, loss_scaling: bool) -> str | None:
    """Why every kind cannot stay on the device whatever the budget (None: it can)."""
    if settings.offload.unset() != set(TensorKind):
        given = sorted(kind.value for kind in set(TensorKind) - settings.offload.unset())
        return f"you placed {', '.join(f'offload.{k}' for k in given)}"
    if loss_scaling:
        return "16-mixed's loss scaling is the tensor manager's here"
    if settings.offload.optimizer_state_dtype != "float32":
        return f"offload.optimizer_state_dtype={settings.offload.optimizer_state_dtype!r} is the tensor manager's"
    if any(p.is_meta for p in module.parameters()):
        return "the model was built on the meta device (empty_init=True): the tensor manager materializes it"
    return None


def plan_device(settings: GreedySnakeConfig, module: nn.Module, device: torch.device, *, simulated: bool,
                loss_scaling: bool, broadcast: Callable[[Any], Any],
                report: Callable[[str], None]) -> GreedySnakeConfig:
    """``settings`` with every kind on the device where the model's state fits (see the module), else
    ``settings`` as given. Only with ``auto=True``, on a GPU or the simulated device."""
    if not settings.auto or not settings.offload.unset() or not (device.type == "cuda" or simulated):
        return settings  # (every kind placed by you: nothing to plan, nothing to report)
    budget = device_budget_bytes(settings, device)
    if not budget:  # 0: offload by request; None: the simulated device without a budget
        return settings
    need = model_state_bytes(module)
    reason = why_offloaded(settings, module, loss_scaling=loss_scaling)
    if reason is None and need > budget // STATE_SHARE:
        reason = (f"its state, {need:,} bytes, exceeds 1/{STATE_SHARE} of the device budget of {budget:,} "
                  f"(auto_device_budget_bytes{'' if settings.auto_device_budget_bytes is not None else ': free GPU memory'})")
    reason = broadcast(reason)  # rank 0's: every rank places alike (GPUs' free memory may differ)
    if reason is not None:
        resident = (" the placement plan keeps what fits of the compute weights on the device"
                    if settings.offload.weights is None and need > budget // STATE_SHARE else "")
        report(f"greedysnake device plan: offloading ({reason}){';' + resident if resident else ''}")
        return settings
    report(f"greedysnake device plan: the model's state ({need:,} bytes: weights, gradients, optimizer state) fits "
           f"in 1/{STATE_SHARE} of the device budget ({budget:,} bytes): every kind stays on the device, no offload "
           "(set a kind's offload placement, or auto_device_budget_bytes=0, to offload)")
    offload = dataclasses.replace(settings.offload, **{kind.value: Tier.DEVICE for kind in TensorKind})
    return dataclasses.replace(settings, offload=offload)
