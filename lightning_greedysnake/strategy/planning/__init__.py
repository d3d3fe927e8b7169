"""``auto=True``'s planning, the settings' side: what is planned before Lightning's setup
(:func:`plan_before_setup`), then one :class:`Planner` per run with the tensor manager (``planner``), over
the device plan (``device``), the host budget and each candidate unit size as the pure plan takes it
(``placement``) and the run's measurements (``measurements``); the decisions are
:mod:`lightning_greedysnake.planner`'s (setup's in one call: :func:`~lightning_greedysnake.planner.setup.plan_setup`)."""

from lightning_greedysnake.strategy.planning.planner import (
    BeforeSetup,
    Planner,
    measurements_for,
    plan_before_setup,
)

__all__ = ["BeforeSetup", "Planner", "measurements_for", "plan_before_setup"]
