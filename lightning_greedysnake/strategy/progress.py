"""What the user sees of the tensor manager while training: tokens/s and SSD GB/s on the progress bar,
and each optimizer step's telemetry in the Trainer's loggers (``greedysnake/<metric>``, every
``log_every_n_steps``, as Lightning logs its own metrics)."""

from __future__ import annotations

from typing import Any

from lightning_greedysnake.telemetry import StepTelemetry


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
