"""``auto=True``'s planning: one :class:`Planner` per run (``planner``), over the device plan
(``device``), the host budget and placement (``placement``) and setup's unit-size candidates
(``unit_size``); the arithmetic is :mod:`lightning_greedysnake.planner`'s."""

from lightning_greedysnake.strategy.planning.planner import Planner

__all__ = ["Planner"]
