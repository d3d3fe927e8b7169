"""The precision plugin: the dtype policy, and the hook that completes a window's backward before
Lightning's ``on_before_optimizer_step`` and gradient clipping run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision

SUPPORTED_PRECISION = ("32-true",)


def unsupported_precision_error(value: Any) -> ValueError:
    return ValueError(
        f"Trainer(precision={value!r}) is not supported by strategy='greedysnake' yet. Supported: "
        f"{', '.join(repr(p) for p in SUPPORTED_PRECISION)}. Fix: use precision='32-true' "
        "(bf16-mixed with fp32 master weights arrives with the SSD tier)."
    )


class GreedySnakePrecision(Precision):
    """fp32 throughout (``"32-true"``)."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise unsupported_precision_error(precision)
        self.precision = precision  # type: ignore[assignment]
        self._before_optimizer_step: Callable[[], None] | None = None

    def attach(self, before_optimizer_step: Callable[[], None] | None) -> None:
        """The strategy passes the callback that finishes the window's remaining backward ops."""
        self._before_optimizer_step = before_optimizer_step

    def _wrap_closure(self, model: pl.LightningModule, optimizer: Any, closure: Callable[[], Any]) -> Any:
        closure_result = closure()
        # The closure ran the last micro-batch's training_step and backward. Whatever the schedule left
        # for after that (the vertical order's unit-by-unit backward) must finish here, so that the
        # gradients are complete when on_before_optimizer_step and gradient clipping see them.
        if self._before_optimizer_step is not None:
            self._before_optimizer_step()
        self._after_closure(model, optimizer)
        return closure_result

    @classmethod
    def from_plugin(cls, plugin: Precision | None) -> GreedySnakePrecision:
        """Lightning builds a plain plugin from ``Trainer(precision=...)``; translate it or refuse it."""
        if plugin is None:
            return cls()
        if isinstance(plugin, GreedySnakePrecision):
            return plugin
        if type(plugin) is Precision:  # Lightning's "32-true"
            return cls("32-true")
        raise unsupported_precision_error(getattr(plugin, "precision", type(plugin).__name__))
