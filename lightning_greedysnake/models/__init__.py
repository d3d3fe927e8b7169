"""Layered models: the protocol, this package's GPT, and adapters for other model families."""

from lightning_greedysnake.models import hf  # noqa: F401 - registers the Hugging Face adapter
from lightning_greedysnake.models import litgpt  # noqa: F401 - registers the LitGPT adapter
from lightning_greedysnake.models.adapters import (
    Adapter,
    chain_of,
    is_layered,
    register_adapter,
    sequential_chain,
    unit_initializer_of,
)
from lightning_greedysnake.models.discovery import (
    LayeredModelNotFound,
    Unit,
    check_parameter_ownership,
    check_tied_weights,
    find_layered_model,
    make_units,
    model_name,
)
from lightning_greedysnake.models.gpt import GPT, GPTConfig
from lightning_greedysnake.models.protocol import LayerChain, LayeredModel, UnitInitializer, reset_modules

__all__ = [
    "GPT",
    "Adapter",
    "GPTConfig",
    "LayerChain",
    "LayeredModel",
    "LayeredModelNotFound",
    "Unit",
    "UnitInitializer",
    "chain_of",
    "check_parameter_ownership",
    "check_tied_weights",
    "find_layered_model",
    "is_layered",
    "make_units",
    "model_name",
    "register_adapter",
    "reset_modules",
    "sequential_chain",
    "unit_initializer_of",
]
