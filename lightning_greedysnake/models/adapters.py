"""Adapters: how greedysnake reads a family of models as a :class:`LayerChain`.

A small registry, asked in registration order: this package registers the :class:`LayeredModel`
protocol and ``nn.Sequential`` here, and the Hugging Face adapter in :mod:`lightning_greedysnake.models.hf`
(imported by the package); a user can register another family with :func:`register_adapter`. The
protocol module knows none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_greedysnake.models.protocol import LayerChain, LayeredModel, UnitInitializer


@dataclass(frozen=True)
class Adapter:
    name: str
    matches: Callable[[nn.Module], bool]
    """Whether this adapter knows ``module`` (cheap: no chain built)."""
    chain: Callable[[nn.Module], LayerChain]
    initializer: Callable[[nn.Module], UnitInitializer | None] = lambda module: None
    """How to materialize a meta-device model of this family unit by unit (None: ``reset_parameters()``)."""


_ADAPTERS: list[Adapter] = []


def register_adapter(adapter: Adapter) -> None:
    """Add ``adapter`` (after the ones registered before; a name registered again is replaced)."""
    for i, known in enumerate(_ADAPTERS):
        if known.name == adapter.name:
            _ADAPTERS[i] = adapter
            return
    _ADAPTERS.append(adapter)


def adapter_of(module: nn.Module) -> Adapter | None:
    return next((a for a in _ADAPTERS if a.matches(module)), None)


def chain_of(module: nn.Module) -> LayerChain | None:
    """The chain of ``module`` if it is a layered model or an adapter knows it, else None."""
    adapter = adapter_of(module)
    return adapter.chain(module) if adapter is not None else None


def is_layered(module: nn.Module) -> bool:
    """A module :func:`chain_of` knows (without building its chain)."""
    return adapter_of(module) is not None


def unit_initializer_of(module: nn.Module) -> UnitInitializer | None:
    """How to materialize a meta-device layered model unit by unit (None: ``reset_parameters()``)."""
    if isinstance(module, UnitInitializer):
        return module
    adapter = adapter_of(module)
    return adapter.initializer(module) if adapter is not None else None


def _call_block(block: nn.Module, hidden: Tensor, ctx: Any) -> Tensor:
    return block(hidden)


def sequential_chain(model: nn.Sequential) -> LayerChain:
    """``nn.Sequential``: every position is one block, as its ``forward`` runs them; no pre or post
    (identity). (An empty one has no blocks, which :func:`~lightning_greedysnake.models.find_layered_model`
    refuses with the fix.) One module object at several positions (``*[block] * 4``) is a block at each:
    :func:`~lightning_greedysnake.models.check_parameter_ownership` trains it where its positions share a
    unit and refuses it, naming them, where they do not."""

    def pre(*args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        if kwargs or len(args) != 1:
            raise TypeError(
                "an nn.Sequential takes exactly one positional input; the training_step called it with "
                f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
            )
        return args[0], None

    return LayerChain(
        pre_modules=(),
        blocks=tuple(model),  # every position: children() would skip a module's repeats (a shorter network)
        post_modules=(),
        pre=pre,
        block_forward=_call_block,
        post=lambda hidden, ctx: hidden,
    )


def transformer_encoder_chain(model: nn.TransformerEncoder) -> LayerChain:
    """``nn.TransformerEncoder``: its ``layers`` are the blocks, its ``norm`` (if any) the post. ``pre`` puts
    the masks in the form the encoder's own ``forward`` gives its layers (``F._canonical_mask``, a causal
    mask detected), and every layer is called with them, as that ``forward`` calls it outside its inference
    fast path (which runs only without gradients: evaluation may round differently there)."""
    import torch.nn.functional as F
    from torch.nn.modules.transformer import _detect_is_causal_mask, _get_seq_len

    def pre(src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
            is_causal: bool | None = None) -> tuple[Tensor, Any]:
        padding = F._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                                    other_type=F._none_or_dtype(mask), other_name="mask", target_type=src.dtype)
        mask = F._canonical_mask(mask=mask, mask_name="mask", other_type=None, other_name="",
                                 target_type=src.dtype, check_other=False)
        batch_first = model.layers[0].self_attn.batch_first
        is_causal = _detect_is_causal_mask(mask, is_causal, _get_seq_len(src, batch_first))
        return src, (mask, is_causal, padding)

    def block(layer: nn.Module, hidden: Tensor, ctx: Any) -> Tensor:
        mask, is_causal, padding = ctx
        return layer(hidden, src_mask=mask, is_causal=is_causal, src_key_padding_mask=padding)

    norm = model.norm
    return LayerChain(
        pre_modules=(),
        blocks=tuple(model.layers),
        post_modules=(norm,) if norm is not None else (),
        pre=pre,
        block_forward=block,
        post=(lambda hidden, ctx: norm(hidden)) if norm is not None else (lambda hidden, ctx: hidden),
    )


register_adapter(Adapter("LayeredModel", lambda m: isinstance(m, LayeredModel), lambda m: m.layer_chain()))
register_adapter(Adapter("nn.Sequential", lambda m: isinstance(m, nn.Sequential), sequential_chain))
register_adapter(Adapter("nn.TransformerEncoder", lambda m: isinstance(m, nn.TransformerEncoder),
                         transformer_encoder_chain))
