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
class Place:
    """Where a module of a unit stands in the chain."""

    label: str
    """As messages name it: ``block 3``, ``pre module 0``, ``post module 1``."""
    block: int
    """The block it is cut with: its own for a block, the first for a pre module, the last for a post one."""


@dataclass(frozen=True)
class Unit:
    """A group of consecutive blocks; unit 0 also owns ``pre``, the last unit also owns ``post``."""

    index: int
    block_indices: tuple[int, ...]
    modules: tuple[nn.Module, ...]
    places: tuple[Place, ...] = ()
    """Where each of :attr:`modules` stands (:func:`make_units` fills it; messages only)."""

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
        placed: list[tuple[nn.Module, Place]] = []
        if index == 0:
            placed += [(m, Place(f"pre module {i}", 0)) for i, m in enumerate(chain.pre_modules)]
        placed += [(chain.blocks[i], Place(f"block {i}", i)) for i in block_indices]
        if index == len(starts) - 1:
            last = num_blocks - 1
            placed += [(m, Place(f"post module {i}", last)) for i, m in enumerate(chain.post_modules)]
        units.append(Unit(index, block_indices, tuple(m for m, _ in placed), tuple(p for _, p in placed)))
    return units


def _joined(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


Use = tuple[Unit, Place | None, nn.Module]
"""One use of a parameter: the unit, where the top-level module holding it stands (None: a unit built
without places) and that module."""


def _tied_error(root: nn.Module, layered_path: str, units: list[Unit],
                tied: list[tuple[nn.Parameter, list[Use]]]) -> ValueError:
    """The refusal of parameters used by several units, naming the first one's uses, with one
    ``layers_per_unit`` that puts every one's uses in one unit (the smallest)."""
    param, uses = tied[0]
    name = next((n for n, p in root.named_parameters(remove_duplicate=False) if p is param), "?")
    where = ""
    if all(place is not None for _, place, _ in uses):
        labels = _joined([place.label for _, place, _ in uses if place is not None])
        where = f": at {labels} of {model_name(root, layered_path)}"
        if len({id(m) for _, _, m in uses}) == 1:  # one module at several positions: Sequential(*[b] * 4)
            module = uses[0][2]
            module_name = next(n for n, m in root.named_modules(remove_duplicate=False) if m is module)
            where += f", which are one {type(module).__name__} object ({module_name!r})"
    size = "layers_per_unit"
    spans = [[place.block for _, place, _ in u if place is not None] for _, u in tied]
    if all(len(span) == len(u) for span, (_, u) in zip(spans, tied, strict=True)):
        fits = (c for c in range(1, units[-1].block_indices[-1] + 2)
                if all(min(s) // c == max(s) // c for s in spans))
        size += f"={next(fits)}"
    in_units = _joined([str(i) for i in sorted({unit.index for unit, _, _ in uses})])
    return ValueError(
        f"parameter {name!r} is used by units {in_units} (tied weights across units){where}. greedysnake "
        "steps each unit on its own, so a parameter must belong to one unit. Fix: give each position its own "
        "module (a copy.deepcopy: its weights are then no longer shared), untie it (e.g. "
        f"tie_word_embeddings=False), set {size} so that all its uses fall in one unit (exact: its "
        "gradient sums over every use; that unit holds them all in memory at once), or train this model "
        "with strategy='auto'."
    )


def check_tied_weights(root: nn.Module, layered_path: str, units: list[Unit]) -> None:
    """Every trainable parameter of the layered model is used by one unit (its uses within one unit are exact:
    autograd sums the gradient over them).

    A trainable parameter in two units (a tied embedding and head, or one module at several positions of an
    ``nn.Sequential``, say) would be updated by two optimizer steps of one window. A frozen one is accepted
    (PEFT's LoRA on GPT-2, whose head is its frozen embedding): read-only, each unit keeps an equal copy.
    """
    uses: dict[int, tuple[nn.Parameter, list[Use]]] = {}
    for unit in units:
        for module, place in zip(unit.modules, unit.places or (None,) * len(unit.modules), strict=True):
            for p in module.parameters():
                if p.requires_grad:
                    uses.setdefault(id(p), (p, []))[1].append((unit, place, module))
    tied = [(p, u) for p, u in uses.values() if len({unit.index for unit, _, _ in u}) > 1]
    if tied:
        raise _tied_error(root, layered_path, units, tied)


def check_parameter_ownership(root: nn.Module, layered_path: str, units: list[Unit]) -> None:
    """Every trainable parameter of ``root`` belongs to exactly one unit: none in two
    (:func:`check_tied_weights`), and none outside the layered model, which would never get a gradient
    through the unit-by-unit backward."""
    check_tied_weights(root, layered_path, units)
    owned = {id(p) for unit in units for p in unit.parameters()}
    outside = [n for n, p in root.named_parameters() if p.requires_grad and id(p) not in owned]
    if outside:
        where = layered_path or "the LightningModule itself"
        raise ValueError(
            f"trainable parameters outside the layered model ({where}): {outside[:8]}"
            f"{' ...' if len(outside) > 8 else ''}. greedysnake trains parameters unit by unit through the "
            "layered model only. Fix: move them into the layered model's pre (embeddings) or post (head) "
            "part, or freeze them with requires_grad_(False)."
        )
