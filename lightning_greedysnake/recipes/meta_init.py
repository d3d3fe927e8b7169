"""Building a model inside ``trainer.init_module(empty_init=True)`` for greedysnake: its parameters on the
meta device (materialized unit by unit by the strategy), its buffers real."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def building_on_meta() -> bool:
    """Whether the caller is inside ``trainer.init_module(empty_init=True)`` (the default device is meta)."""
    return torch.empty(()).is_meta


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters on the meta device, buffers real (rotary tables are computed at construction and are not
    in checkpoints): what accelerate's ``init_empty_weights(include_buffers=False)`` does."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
