"""The tensor manager at setup: the placement checked against the device, the offload directory
prepared and locked, the initial weights stored in the tiers (rank 0's, broadcast).

Models created on the meta device (``trainer.init_module(empty_init=True)``): the layered model's
parameters get memory-less stand-ins at setup, and are then materialized one unit at a time straight
into the tensor manager's tiers, so a model larger than RAM never exists there whole (Lightning's
convention for FSDP and DeepSpeed)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_greedysnake.config import REGION_KINDS, RunConfig, TensorKind, Tier
from lightning_greedysnake.layout import StateLayout, empty_shares
from lightning_greedysnake.models import Unit, reset_modules, unit_initializer_of
from lightning_greedysnake.offload.device import device_copies_for
from lightning_greedysnake.offload.preflight import human_bytes
from lightning_greedysnake.optim import ClipPolicy
from lightning_greedysnake.optim.contract import OptimizerContract
from lightning_greedysnake.planner.plan import ALPHAS
from lightning_greedysnake.schedule import window_facts
from lightning_greedysnake.strategy.lightning_api import record_module_device
from lightning_greedysnake.strategy.offload_dir import OffloadDirectories
from lightning_greedysnake.strategy.report import frozen_note, kinds_without_bytes
from lightning_greedysnake.strategy.setup_context import SetupContext, SetupPlan
from lightning_greedysnake.tensor_manager import TieredTensorStore

Broadcast = Callable[[list[nn.Parameter]], None]
"""Every rank's copy of these parameters becomes rank 0's (a no-op in one process)."""


def stand_in_for_meta_parameters(module: nn.Module, units: list[Unit], uses_tensor_manager: bool) -> bool:
    """Swap every meta parameter of the layered model for a memory-less CPU stand-in (the same
    Parameter object, so the optimizer Lightning builds next refers to it); False if none is meta."""
    unit_params = [p for unit in units for p in unit.parameters()]
    owned = {id(p) for p in unit_params}  # (one pass: a test per tensor against every unit was quadratic)
    meta_outside = [
        n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta and id(t) not in owned
    ]
    in_units = [p for p in unit_params if p.is_meta]
    if not in_units and not meta_outside:
        return False
    if meta_outside:
        raise ValueError(
            f"tensors on the meta device outside the layered model's parameters: {meta_outside[:6]}. "
            "greedysnake materializes the layered model's parameters unit by unit; buffers and other "
            "tensors must be real. Fix: create them on the CPU (e.g. register buffers in setup())."
        )
    if not uses_tensor_manager:
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


def materialize(manager: TieredTensorStore, layered: nn.Module, units: list[Unit], broadcast: Broadcast) -> None:
    """Initialize the layered model unit by unit into ``manager`` (each unit's values ``broadcast`` from
    rank 0 with several processes), with the model's own initializer or ``reset_parameters()``."""
    initializer = unit_initializer_of(layered)
    generator = initializer.weight_init_generator() if initializer is not None else None

    def init(u: int) -> None:
        if initializer is not None:
            initializer.init_modules(units[u].modules, generator)
        else:
            reset_modules(units[u].modules)
        broadcast(units[u].parameters())

    manager.initialize_unit_by_unit(init)


def check_device(config: RunConfig, device: torch.device, distributed: bool) -> None:
    """Refuse, before any work, what the device tier does not do yet."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"greedysnake's tensor manager runs on 'cpu' or 'cuda' devices, not {device.type!r}. Fix: "
            "Trainer(accelerator='gpu') or Trainer(accelerator='cpu')."
        )
    if device.type == "cuda" and distributed:
        rank_zero_warn(
            "greedysnake: data parallel with offloading on CUDA (gradients reduce-scattered on the GPUs over "
            "NCCL, host tensors over gloo) is tested on the simulated device over gloo only, not yet across "
            "real GPUs. Compare a short run against strategy='ddp' before relying on it.")


def new_tensor_manager(ctx: SetupContext, planned: SetupPlan, module: nn.Module,
                       optimizer: torch.optim.Optimizer | None, contract: OptimizerContract, clip: ClipPolicy,
                       shard: tuple[int, int] | None) -> TieredTensorStore:
    """The tensor manager for ``planned``'s units and settings, with the device tier ``ctx.device`` needs
    (CUDA copy streams, the simulated device, or none: the CPU computes in host memory), which it owns from
    then on; the precision's loss scaler, the ranks' collectives for ``shard``, the strategy's gradient
    hooks, the optimizer lane's threads and the saved activations' tier plan all from ``ctx`` and
    ``planned``."""
    copies = device_copies_for(ctx.device)
    config = planned.config
    try:
        manager = TieredTensorStore(
            planned.units, {id(p): n for n, p in module.named_parameters()}, optimizer, config.offload,
            compute_dtype=ctx.precision.compute_dtype, alpha=config.alpha, lag=config.lag, clip=clip, shard=shard,
            copies=copies, loss_scaler=ctx.precision.loss_scaler,
            data_parallel=ctx.data_parallel(copies, shard is not None), gradient_observer=ctx.gradient_observer,
            optimizer_threads=ctx.optimizer_threads, activation_plan=planned.activations,
            deferred_gradients_only=deferred_gradients_only(ctx, config, clip), contract=contract,
            double_buffered=not config.auto)  # (auto=True: the warm-step plan chooses the budget)
    except BaseException:
        if copies is not None:
            copies.close()
        raise
    warn_empty_shares(manager.state, config)
    return manager


def warn_empty_shares(state: StateLayout, config: RunConfig) -> None:
    """Say where a split placement's share gets no unit (units are placed whole, and a unit larger than the
    share goes to the next tier): the user asked for bytes there and gets none."""
    for kind in REGION_KINDS:
        sizes = state.all_region_bytes(kind)
        for tier, share, needed in empty_shares(sizes, config.offload.tier(kind)):
            rank_zero_warn(
                f"greedysnake: offload.{kind.value}={config.offload.tier(kind)} puts no unit on {tier.value}: units "
                f"are placed whole, and the one that would go there first is {needed:.1%} of the kind's "
                f"{sum(sizes):,} bytes, more than its {share:.1%} share (units of {config.layers_per_unit} "
                f"layer(s)). Fix: a {tier.value} share of at least {needed:.1%}, or a smaller layers_per_unit (set "
                "it: with auto=True the unit size is chosen by measuring the disk).")


def deferred_gradients_only(ctx: SetupContext, config: RunConfig, clip: ClipPolicy) -> float | None:
    """The largest alpha of the run where only deferred parts of gradients wait on their tier: the vertical
    order completes each unit's gradient before releasing the unit, and without clipping by the global norm
    its step takes it at once (the user's alpha, or the largest the warm-step plan may choose); None where
    whole gradients wait (the horizontal order, deferred clipping)."""
    # (the order's own character: whether it leaves gradients partial, where it has two units and micro-batches)
    if not window_facts(config.schedule, 2, 2).completes_gradients_at_once or clip.defer:
        return None
    planned = ctx.settings.auto and "alpha" in ctx.settings.unset()
    return max(ALPHAS) if planned else config.alpha


def disk_fixes(manager: TieredTensorStore, needs: list[dict[str, int]]) -> tuple[str, ...]:
    """What this run itself could set to need less disk, for a refusal of too little free space: plain fp32
    optimizer state on SSD halves in bf16."""
    state = sum(need.get(TensorKind.OPTIMIZER_STATES.value, 0) for need in needs)
    if not state or manager.state_format.codec is not None or manager.state_format.dtype != torch.float32:
        return ()
    return (f"offload.optimizer_state_dtype=bfloat16 (the optimizer state's {human_bytes(state)} on SSD in half the "
            "bytes; not bit-identical)",)


def move_all_but_units(module: nn.Module, units: list[Unit], device: torch.device) -> None:
    """``module.to(device)`` except the units' parameters: those live in the tensor manager's tiers and
    come to the device one unit at a time (moving them would need the whole model in device memory)."""
    keep = {id(p) for unit in units for p in unit.parameters()}
    module._apply(lambda t: t if id(t) in keep else t.to(device))  # (torch's own traversal of .to())
    record_module_device(module, device)


ACTIVATIONS_SIZED_LATER = ("sized at the first window (a unit's input a micro-batch), not in the total: "
                           "their room is checked then, before any is written")
"""What the offload directory's breakdown says of saved activations placed on SSD."""


def open_tensor_manager(ctx: SetupContext, manager: TieredTensorStore, directory: OffloadDirectories,
                        units: list[Unit], meta_model: nn.Module | None, empty_note: str) -> None:
    """Prepare and lock ``directory`` (where something goes to SSD, or the user named it), open
    ``manager``'s files there and store the model's initial weights in its tiers (materialized unit by
    unit from ``meta_model`` if given; rank 0's). ``empty_note``: what the report says under a directory
    that gets nothing. On a failure everything taken is given back."""
    try:
        if manager.config.uses_ssd or directory.given:
            needs = [manager.placement.ssd_bytes(d) for d in range(len(directory.dirs))]  # (striped as configured)
            reports = directory.prepare(ctx.default_root, needs, ctx.global_rank, ctx.local_rank, ctx.is_distributed,
                                        fixes=disk_fixes(manager, needs))
            notes = kinds_without_bytes(manager.placement, on_ssd=True)
            if manager.activations.tier is Tier.SSD:  # (not in the total: their size is known at the first save)
                notes[TensorKind.ACTIVATIONS.value] = ACTIVATIONS_SIZED_LATER
            ctx.report(directory.text(reports, empty_note, notes))
            manager.open(directory.paths)
            directory.record(manager.files)  # (greedysnake's mark on its own files, in the lock records)
        else:
            manager.open(None)
        frozen = frozen_note(manager.placement)
        if frozen is not None:
            ctx.report(frozen)
        if meta_model is not None:
            materialize(manager, meta_model, units, ctx.broadcast_parameters)
        else:
            ctx.broadcast_parameters([p for unit in units for p in unit.parameters()])
            manager.initialize_from_parameters()
    except BaseException:
        manager.close()
        directory.cleanup(manager.files)
        raise
