"""Dynamic loss scaling for ``16-mixed``, with the semantics of ``torch.amp.GradScaler``.

The loss is multiplied by ``scale`` before backward, so fp16 gradients keep their small values; every
gradient is multiplied by ``1 / scale`` before clipping and the step. A window in which any gradient
has an inf or NaN is skipped whole (no unit is stepped, on any rank) and the scale is multiplied by
``backoff_factor``; after ``growth_interval`` windows in a row without one it is multiplied by
``growth_factor``. The state (``scale``, ``_growth_tracker`` and the settings) has GradScaler's
``state_dict`` keys, and is saved in checkpoints by the precision plugin.

Training thread only: read before backward (``scale``), updated once per optimizer step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0
    """Windows in a row without an inf or NaN gradient since the scale last changed."""
    skipped_steps: list[int] = field(default_factory=list)
    """Optimizer steps (1-based, as ``global_step`` after them) skipped for a non-finite gradient."""

    def __post_init__(self) -> None:
        checks = (("scale", lambda v: v > 0, "> 0", "65536"), ("growth_factor", lambda v: v > 1, "> 1", "2"),
                  ("backoff_factor", lambda v: 0 < v < 1, "in (0, 1)", "0.5"),
                  ("growth_interval", lambda v: v >= 1 and float(v).is_integer(), "a positive integer", "2000"))
        for name, ok, what, default in checks:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"loss scaling {name}={value!r} must be {what}. Fix: e.g. {default} "
                                 "(torch.amp.GradScaler's default).")
        self.scale, self.growth_interval = float(self.scale), int(self.growth_interval)

    @classmethod
    def from_grad_scaler(cls, scaler: Any) -> LossScaler:
        """The settings (and current state) of a ``torch.amp.GradScaler``, e.g. the one a user passed to
        Lightning's ``MixedPrecision`` plugin."""
        if scaler is None:
            return cls()
        if not scaler.is_enabled():
            raise ValueError("16-mixed with a disabled GradScaler has no loss scaling, so fp16 gradients "
                             "underflow. Fix: pass an enabled torch.amp.GradScaler (or none: the defaults).")
        state = scaler.state_dict()
        return cls(scale=float(state["scale"]), growth_factor=float(state["growth_factor"]),
                   backoff_factor=float(state["backoff_factor"]), growth_interval=int(state["growth_interval"]),
                   growth_tracker=int(state["_growth_tracker"]))

    @property
    def inv_scale(self) -> float:
        """``1 / scale`` in fp32, as GradScaler computes it (exact for its power-of-two scales)."""
        return 1.0 / self.scale

    def update(self, found_inf: bool, step: int) -> bool:
        """After optimizer step ``step`` (1-based): back off where a gradient was not finite (or the window
        was dropped for a non-finite loss before any gradient existed: an overflow too, as GradScaler would
        see it), else count toward growth. Returns whether the step counts as skipped."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps.append(step)
            return True
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": self.growth_tracker}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])
