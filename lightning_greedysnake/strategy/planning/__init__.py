"""``auto=True``'s planning: what is planned before Lightning's setup (:func:`plan_before_setup`), then one
:class:`Planner` per run with the tensor manager (``planner``), over the device plan
(``device``), the host budget and placement (``placement``) and setup's unit-size candidates
(``unit_size``); the arithmetic is :mod:`lightning_greedysnake.planner`'s."""

from lightning_greedysnake.strategy.planning.planner import (
    BeforeSetup,
    Planner,
    measurements_for,
    plan_before_setup,
)

__all__ = ["BeforeSetup", "Planner", "measurements_for", "plan_before_setup"]
