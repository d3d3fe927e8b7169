"""The layered-model seam: what the engine needs to know about a model to run it unit by unit."""

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


def _call_block(block: nn.Module, hidden: Tensor, ctx: Any) -> Tensor:
    return block(hidden)


def sequential_chain(model: nn.Sequential) -> LayerChain:
    """``nn.Sequential``: every child is one block; no pre or post (identity)."""
    if len(model) == 0:
        raise ValueError("greedysnake found an empty nn.Sequential; it needs at least one child layer")

    def pre(*args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        if kwargs or len(args) != 1:
            raise TypeError(
                "an nn.Sequential takes exactly one positional input; the training_step called it with "
                f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
            )
        return args[0], None

    return LayerChain(
        pre_modules=(),
        blocks=tuple(model.children()),
        post_modules=(),
        pre=pre,
        block_forward=_call_block,
        post=lambda hidden, ctx: hidden,
    )


def chain_of(module: nn.Module) -> LayerChain | None:
    """The chain of ``module`` if it is a layered model or a built-in adapter knows it, else None."""
    if isinstance(module, LayeredModel):
        return module.layer_chain()
    if isinstance(module, nn.Sequential):
        return sequential_chain(module)
    from lightning_greedysnake.models.hf import hf_chain, is_hf_causal_lm

    if is_hf_causal_lm(module):
        return hf_chain(module)
    return None


def is_layered(module: nn.Module) -> bool:
    """A module :func:`chain_of` knows (without building its chain)."""
    from lightning_greedysnake.models.hf import is_hf_causal_lm

    return isinstance(module, (LayeredModel, nn.Sequential)) or is_hf_causal_lm(module)


def unit_initializer_of(module: nn.Module) -> UnitInitializer | None:
    """How to materialize a meta-device layered model unit by unit (None: ``reset_parameters()``)."""
    if isinstance(module, UnitInitializer):
        return module
    from lightning_greedysnake.models.hf import HFInitializer, is_hf_causal_lm

    if is_hf_causal_lm(module):
        return HFInitializer(module)
    return None
