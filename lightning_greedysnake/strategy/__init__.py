"""The Lightning strategy (hook routing in :mod:`.greedysnake`) and the modules beside it, one concern
each. Only this package and :mod:`lightning_greedysnake.precision` import Lightning."""

from lightning_greedysnake.strategy.checkpoint_io import GreedySnakeCheckpointIO
from lightning_greedysnake.strategy.greedysnake import GreedySnakeStrategy

__all__ = ["GreedySnakeCheckpointIO", "GreedySnakeStrategy"]
