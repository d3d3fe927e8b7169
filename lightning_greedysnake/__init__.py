"""lightning-greedysnake: GreedySnake's vertical schedule as a PyTorch Lightning strategy.

``import lightning_greedysnake`` registers the strategy names ``"greedysnake"`` (the planned defaults:
state placed within the host budget, the rest on SSD under the Trainer's ``default_root_dir``; the
vertical order wherever state streams), ``"greedysnake_horizontal"`` (the baseline order on the same
engine) and ``"greedysnake_cpu"`` (vertical, everything in host memory).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_greedysnake.config import GreedySnakeConfig, OffloadConfig, RunConfig, TensorKind, Tier
from lightning_greedysnake.models import GPT, GPTConfig, LayerChain, LayeredModel
from lightning_greedysnake.precision import GreedySnakePrecision
from lightning_greedysnake.schedule import ScheduleKind, build_horizontal_plan, build_vertical_plan
from lightning_greedysnake.strategy import GreedySnakeCheckpointIO, GreedySnakeStrategy
from lightning_greedysnake.strategy.rng_callback import MicrobatchRNG

GreedySnakeStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "GPTConfig",
    "GreedySnakeCheckpointIO",
    "GreedySnakeConfig",
    "GreedySnakePrecision",
    "GreedySnakeStrategy",
    "LayerChain",
    "LayeredModel",
    "MicrobatchRNG",
    "OffloadConfig",
    "RunConfig",
    "ScheduleKind",
    "TensorKind",
    "Tier",
    "build_horizontal_plan",
    "build_vertical_plan",
]
