"""What the user sees of the tensor manager while training: tokens/s and SSD GB/s on the progress bar,
and each optimizer step's telemetry in the Trainer's loggers (``greedysnake/<metric>``, every
``log_every_n_steps``, as Lightning logs its own metrics); and at the end of fit, what moved where
(:func:`fit_summary`: per kind of tensor, its tier and directory and the bytes read and written there)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.pytorch.trainer.states import TrainerFn

from lightning_greedysnake.config import REGION_KINDS, TensorKind, Tier
from lightning_greedysnake.offload.preflight import human_bytes
from lightning_greedysnake.strategy.report import MASTER_COPY
from lightning_greedysnake.telemetry import StepTelemetry

if TYPE_CHECKING:
    from lightning_greedysnake.tensor_manager import TieredTensorStore


def show_progress(module: Any, last: StepTelemetry | None) -> None:
    """The last step's tokens/s and SSD GB/s on the progress bar (not the loggers: they get it all)."""
    if last is None:
        return
    # unrounded: the bar prints three significant digits (tqdm's format); rounding here to places showed a
    # slow disk's or a small model's traffic as 0.0
    values = {"gs/ssd_GBps": last.ssd_gb_per_s}
    if last.tokens:
        values["gs/tok_s"] = last.tokens_per_s
    module.log_dict(values, prog_bar=True, logger=False, on_step=True, on_epoch=False, batch_size=1)


def log_step(trainer: Any, entry: StepTelemetry) -> None:
    every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 1))
    step = trainer.global_step
    if trainer.loggers and step % every == 0:
        metrics = {f"greedysnake/{k}": v for k, v in entry.as_metrics().items()}
        scaler = getattr(trainer.precision_plugin, "loss_scaler", None)
        if scaler is not None:  # 16-mixed: the loss scale after this step, and the steps skipped so far
            metrics["greedysnake/loss_scale"] = scaler.scale
            metrics["greedysnake/skipped_steps"] = float(len(scaler.skipped_steps))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def end_of_fit(manager: TieredTensorStore | None, trainer: Any, failed: bool, say: Callable[[str], None]) -> None:
    """Teardown, the tensor manager closed: :func:`fit_summary` to ``say`` (rank 0's log) after a fit that
    ended normally (not after evaluation, nor a failure, whose error says enough)."""
    if manager is None or failed or trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return
    say(fit_summary(manager, trainer.global_step, trainer.world_size))


def fit_summary(manager: TieredTensorStore, steps: int, world_size: int = 1) -> str:
    """The end-of-fit summary, once the tensor manager closed (its counters final, the hand-back's reads
    in them): a line per kind of tensor with its tier (and, on SSD, its offload directories) and the bytes
    read and written there (with a device tier, the host <-> device copies of all kinds; under the
    weights, the part of those bytes that fell in frozen parameters, written only when placed), then the SSD
    traffic in all and per optimizer step. The numbers are ``manager.stats``'s
    (``GreedySnakeStrategy.io_stats()``); host and device tiers are used in place."""
    stats = manager.stats
    counters = stats.snapshot()
    kinds = [kind.value for kind in TensorKind]
    kinds += sorted({kind for kind, _ in counters} - set(kinds))  # (any other label counted)
    back = ", the hand-back at its end included" if manager.config.return_weights else ""
    whose = f", rank 0's share of {world_size} processes" if world_size > 1 else ""
    lines = [f"greedysnake: what moved where in this fit ({steps} optimizer step{'' if steps == 1 else 's'}"
             f"{back}{whose}):"]
    read_only = stats.read_only()
    read_total = written_total = 0
    for kind in kinds:
        placed = _placed(manager, kind)
        moved = [(tier, c) for (k, tier), c in sorted(counters.items())
                 if k == kind and (c.bytes_read or c.bytes_written)]
        if placed is None and not moved:
            continue
        if not moved:
            none = "nothing moved" if "ssd" in str(placed) else "used in place, no I/O"
            lines.append(f"  {kind:<17} {placed}: {none}")
            continue
        for tier, c in moved:
            dirs = stats.directories(kind, tier)
            where = f"{tier} in {', '.join(dirs)}" if dirs else tier
            if placed is not None and placed != tier:
                where = f"{where} ({placed})"
            elif placed is None and kind == TensorKind.MASTER_WEIGHTS.value:
                where = f"{where} (the weights' region: {MASTER_COPY})"
            lines.append(f"  {kind:<17} {human_bytes(c.bytes_read)} read, {human_bytes(c.bytes_written)} written, "
                         f"{where}")
            frozen = read_only.get((kind, tier))
            if frozen is not None:  # (measured per transfer: the bytes past each unit's trained prefix)
                laid = f", {human_bytes(frozen.placed_bytes)} when placed" if frozen.placed_bytes else ""
                lines.append(f"    of which read-only (frozen): {human_bytes(frozen.read_bytes)} read, "
                             f"{human_bytes(frozen.written_bytes)} written by training{laid}")
            if tier == Tier.SSD.value:
                read_total += c.bytes_read
                written_total += c.bytes_written
    if manager.copies is not None:  # (a GPU, or the simulated device: host <-> device copies, all kinds)
        counts = manager.copies.counts
        lines.append(f"  {'device copies':<17} {human_bytes(counts.bytes_to_device)} to the device, "
                     f"{human_bytes(counts.bytes_to_host)} back ({counts.copies:,} copies)")
    per = max(1, steps)
    lines.append(f"SSD traffic: {read_total / 1e6:.1f} MB read, {written_total / 1e6:.1f} MB written "
                 f"({read_total / per / 1e6:.2f} / {written_total / per / 1e6:.2f} MB per optimizer step)")
    return "\n".join(lines)


def _placed(manager: TieredTensorStore, kind: str) -> str | None:
    """Where this run placed ``kind``'s units (``ssd``; ``host 2 units, ssd 4 units`` for a split kind);
    None where the kind holds no bytes (master weights under 32-true) or is not one of the manager's."""
    if kind == TensorKind.ACTIVATIONS.value:
        return str(manager.activations.tier.value)
    region_kind = next((k for k in REGION_KINDS if k.value == kind), None)
    if region_kind is None:
        return None
    regions = manager.placement
    tiers = Counter(tier.value for tier, size in zip(regions.unit_tiers[region_kind],
                                                     regions.state.all_region_bytes(region_kind), strict=True)
                    if size)
    if len(tiers) <= 1:
        return next(iter(tiers), None)
    return ", ".join(f"{tier} {n} unit{'' if n == 1 else 's'}" for tier, n in sorted(tiers.items()))
