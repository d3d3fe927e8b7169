"""Layered models: the protocol, this package's GPT, and adapters for other model families."""

from lightning_greedysnake.models.discovery import (
    LayeredModelNotFound,
    Unit,
    check_parameter_ownership,
    find_layered_model,
    make_units,
)
from lightning_greedysnake.models.gpt import GPT, GPTConfig
from lightning_greedysnake.models.protocol import (
    LayerChain,
    LayeredModel,
    UnitInitializer,
    chain_of,
    is_layered,
    reset_modules,
    sequential_chain,
    unit_initializer_of,
)

__all__ = [
    "GPT",
    "GPTConfig",
    "LayerChain",
    "LayeredModel",
    "LayeredModelNotFound",
    "Unit",
    "UnitInitializer",
    "chain_of",
    "is_layered",
    "unit_initializer_of",
    "check_parameter_ownership",
    "find_layered_model",
    "make_units",
    "reset_modules",
    "sequential_chain",
]
