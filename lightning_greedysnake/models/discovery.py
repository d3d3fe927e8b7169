"""Finding the layered model inside a user's module and cutting it into units."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_greedysnake.models.adapters import chain_of, is_layered
from lightning_greedysnake.models.protocol import LayerChain


class LayeredModelNotFound(ValueError):
    """The strategy could not find exactly one layered model; the message says what it found."""


def model_name(root: nn.Module, path: str) -> str:
    """The layered model as messages name it: the user's module class and the path to it
    (``MyModule.net``), not the class of the model inside (a ``Sequential`` says nothing)."""
    return f"{type(root).__name__}.{path}" if path else type(root).__name__


def _no_blocks(where: str) -> str:
    return (f"the layered model {where} has no blocks; greedysnake needs at least one (it trains the model "
            "block by block). Fix: give it at least one block (an nn.Sequential needs one child; a LayeredModel's "
            "layer_chain() at least one entry in blocks), or set layered_module to the module that holds them.")


def find_layered_model(root: nn.Module, path: str | None = None) -> tuple[str, nn.Module, LayerChain]:
    """The outermost layered model under ``root`` (``root`` itself included).

    A layered model is a module implementing :class:`LayeredModel` (this package's GPT, or your own) or an
    ``nn.Sequential``. With ``path`` (a dotted submodule name, ``""`` for ``root``), that module is used.
    Returns ``(path, module, chain)``.
    """
    if path is not None:
        try:
            module = root.get_submodule(path)
        except AttributeError:
            names = [n for n, _ in root.named_children()]
            raise LayeredModelNotFound(
                f"layered_module={path!r}: no such submodule in {type(root).__name__}; its children are "
                f"{names}. Fix: set layered_module to the dotted name of the module that holds the blocks."
            ) from None
        chain = chain_of(module)
        if chain is None:
            raise LayeredModelNotFound(
                f"layered_module={path!r} is a {type(module).__name__}, which is neither an nn.Sequential, "
                "a LayeredModel, a Hugging Face causal LM nor a LitGPT GPT. Fix: implement `layer_chain()` on it (see "
                "lightning_greedysnake.models.LayeredModel) or point layered_module at another module."
            )
        if not chain.blocks:
            raise LayeredModelNotFound(_no_blocks(f"{model_name(root, path)} ({type(module).__name__})"))
        return path, module, chain

    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if any(f == "" or name.startswith(f + ".") for f, _ in found):
            continue  # inside a layered model already found: its own Sequentials are its business
        if is_layered(module):
            found.append((name, module))
    if not found:
        kinds = sorted({type(m).__name__ for _, m in root.named_children()})
        raise LayeredModelNotFound(
            f"greedysnake found no layered model in {type(root).__name__} (its children are of types {kinds}). "
            "It needs a chain pre -> blocks -> post: this package's GPT, an nn.Sequential (each child one "
            "layer), a Hugging Face *ForCausalLM (Llama, Qwen2, Mistral, GPT-2 families), a LitGPT GPT, or a module "
            "implementing `layer_chain()` (lightning_greedysnake.models.LayeredModel)."
        )
    if len(found) > 1:
        names = [n or "<the LightningModule itself>" for n, _ in found]
        raise LayeredModelNotFound(
            f"greedysnake found {len(found)} candidate layered models: {names}. Fix: name the one to train "
            f"with GreedySnakeStrategy(layered_module=...), e.g. layered_module={names[0]!r}."
        )
    name, module = found[0]
    chain = chain_of(module)
    assert chain is not None
    if not chain.blocks:
        raise LayeredModelNotFound(_no_blocks(f"{model_name(root, name)} ({type(module).__name__})"))
    return name, module, chain


@dataclass(frozen=True)
class Unit:
    """A group of consecutive blocks; unit 0 also owns ``pre``, the last unit also owns ``post``."""

    index: int
    block_indices: tuple[int, ...]
    modules: tuple[nn.Module, ...]

    def parameters(self) -> list[nn.Parameter]:
        seen: set[int] = set()
        out: list[nn.Parameter] = []
        for module in self.modules:
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


def make_units(chain: LayerChain, layers_per_unit: int) -> list[Unit]:
    num_blocks = len(chain.blocks)
    if num_blocks < 1:
        raise LayeredModelNotFound(_no_blocks("given"))
    starts = list(range(0, num_blocks, layers_per_unit))
    units = []
    for index, start in enumerate(starts):
        block_indices = tuple(range(start, min(start + layers_per_unit, num_blocks)))
        modules: list[nn.Module] = []
        if index == 0:
            modules += chain.pre_modules
        modules += [chain.blocks[i] for i in block_indices]
        if index == len(starts) - 1:
            modules += chain.post_modules
        units.append(Unit(index, block_indices, tuple(modules)))
    return units


def check_parameter_ownership(root: nn.Module, layered_path: str, units: list[Unit]) -> None:
    """Every trainable parameter of ``root`` belongs to exactly one unit.

    A parameter in two units (a tied embedding and head, say) would be updated by two optimizer steps of one
    window; one outside the layered model would never get a gradient through the unit-by-unit backward.
    """
    owner: dict[int, int] = {}
    names = {id(p): n for n, p in root.named_parameters(remove_duplicate=False)}
    for unit in units:
        for p in unit.parameters():
            if id(p) in owner and owner[id(p)] != unit.index:
                raise ValueError(
                    f"parameter {names.get(id(p), '?')!r} is used by unit {owner[id(p)]} and unit {unit.index} "
                    "(tied weights across units). greedysnake steps each unit on its own, so a parameter must "
                    "belong to one unit. Fix: untie it (e.g. tie_word_embeddings=False), or set "
                    "layers_per_unit so that both users fall in the same unit."
                )
            owner[id(p)] = unit.index
    outside = [n for n, p in root.named_parameters() if p.requires_grad and id(p) not in owner]
    if outside:
        where = layered_path or "the LightningModule itself"
        raise ValueError(
            f"trainable parameters outside the layered model ({where}): {outside[:8]}"
            f"{' ...' if len(outside) > 8 else ''}. greedysnake trains parameters unit by unit through the "
            "layered model only. Fix: move them into the layered model's pre (embeddings) or post (head) "
            "part, or freeze them with requires_grad_(False)."
        )
