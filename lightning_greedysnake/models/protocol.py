"""The layered-model seam: what the engine needs to know about a model to run it unit by unit. It knows
no model family: adapters register with :mod:`lightning_greedysnake.models.adapters`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

PreFn = Callable[..., tuple[Tensor, Any]]
"""``pre(*args, **kwargs) -> (hidden, ctx)``: the model's input processing (e.g. embeddings). ``ctx`` is
anything the blocks or the head need besides the hidden state (masks, positions, targets); it must not
require grad, since it is computed once per micro-batch and shared by all units."""

BlockFn = Callable[[nn.Module, Tensor, Any], Tensor]
"""``block_forward(block, hidden, ctx) -> hidden``."""

PostFn = Callable[[Tensor, Any], Any]
"""``post(hidden, ctx) -> output``: final norm, head; its result is what the model's ``forward`` returns."""


@dataclass(frozen=True)
class LayerChain:
    """A model seen as ``pre -> blocks[0..L-1] -> post``.

    ``pre_modules`` and ``post_modules`` list the modules whose parameters ``pre`` and ``post`` use, so the
    engine can assign every parameter to exactly one unit.
    """

    pre_modules: Sequence[nn.Module]
    blocks: Sequence[nn.Module]
    post_modules: Sequence[nn.Module]
    pre: PreFn
    block_forward: BlockFn
    post: PostFn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The whole chain, in memory: equal to the model's own forward by contract."""
        hidden, ctx = self.pre(*args, **kwargs)
        for block in self.blocks:
            hidden = self.block_forward(block, hidden, ctx)
        return self.post(hidden, ctx)


@runtime_checkable
class LayeredModel(Protocol):
    """Implement this on an ``nn.Module`` to train it with greedysnake.

    The chain's forward must compute exactly what the module's ``forward`` computes for the same inputs.
    """

    def layer_chain(self) -> LayerChain: ...


@runtime_checkable
class UnitInitializer(Protocol):
    """Optional, for models created on the meta device: initialize some of the model's modules in place.

    ``init_modules`` is called unit by unit, in unit order, with one ``generator`` from
    ``weight_init_generator()`` for the whole model; calling it for every unit in order must give the
    model's eager initialization."""

    def weight_init_generator(self) -> Any: ...

    def init_modules(self, modules: Sequence[nn.Module], generator: Any) -> None: ...


def reset_modules(modules: Sequence[nn.Module]) -> None:
    """The generic initializer (FSDP's convention): ``reset_parameters()`` on every submodule that has
    one, drawing from the global RNG."""
    for module in modules:
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
