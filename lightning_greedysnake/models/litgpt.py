"""LitGPT's ``GPT`` as a layered model (Llama, Qwen, Mistral, Phi, Gemma, ... from ``litgpt.Config``).

A LitGPT ``GPT`` is ``transformer.wte -> transformer.h[0..L-1] -> transformer.ln_f -> lm_head``. The chain
computes what ``GPT.forward`` computes without a KV cache (training):

- ``pre``: the RoPE ``cos``/``sin`` for the sequence (rows of the model's own rope cache, the buffers
  ``GPT.max_seq_length`` sizes), the token embedding, scaled by ``sqrt(n_embd)`` where the config asks
  (``scale_embeddings``, Gemma). The mask is ``None`` as in ``GPT.forward``: each block's attention builds
  its causal (or sliding-window) mask itself.
- blocks: ``block(x, cos, sin, None, None, None)``; with ``config.rope_indices`` (Gemma 3: local and global
  layers on different RoPE bases) each block takes its own slice of ``cos``/``sin``.
- ``post``: ``ln_f``, ``lm_head`` and the final logit soft-capping where the config has one.

``cos``/``sin`` travel in the context the engine hands every block. LitGPT does not tie the head to the
embedding (its converter writes both); a checkpoint without ``lm_head.weight`` starts the head from the
embedding and is trained untied (:func:`read_lit_state`, said once).

Meta-device models are materialized unit by unit with ``reset_parameters()`` (FSDP's convention), or, when
a ``lit_model.pth`` was attached (:func:`attach_lit_checkpoint`), from it: the file is memory-mapped and
each unit's modules load their own tensors through their own ``load_state_dict`` (LitGPT's hooks for older
key names included), so only one unit's weights are read at a time.

Nothing here imports ``litgpt`` at import time (the adapter recognizes the class by its module).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_greedysnake.models.adapters import Adapter, register_adapter
from lightning_greedysnake.models.protocol import LayerChain

EXTRA = "litgpt"
"""The optional dependency group: ``pip install "lightning-greedysnake[litgpt]"``."""
_CHECKPOINT = "_greedysnake_lit_checkpoint"


def require_litgpt() -> Any:
    """The ``litgpt`` package, or an ImportError that names the extra to install."""
    try:
        import litgpt
    except ImportError as e:
        raise ImportError(
            f"LitGPT models need the litgpt package, which is not installed ({e}). Fix: pip install "
            f'"lightning-greedysnake[{EXTRA}]" (or pip install litgpt).') from e
    return litgpt


def is_litgpt_gpt(module: nn.Module) -> bool:
    """A LitGPT ``GPT`` (checked without importing ``litgpt``)."""
    if not type(module).__module__.startswith("litgpt."):
        return False
    transformer = getattr(module, "transformer", None)
    return (isinstance(transformer, nn.ModuleDict) and isinstance(getattr(module, "lm_head", None), nn.Module)
            and all(k in transformer for k in ("wte", "h", "ln_f")) and isinstance(transformer["h"], nn.ModuleList))


class RopeContext(NamedTuple):
    """What every block's call needs besides the hidden state: the RoPE tables for the sequence,
    ``(1, T, rope_n_elem)`` (``(1, T, rope_n_elem, 2)`` with ``rope_indices``). Not trainable."""

    cos: Tensor
    sin: Tensor


def litgpt_chain(model: nn.Module) -> LayerChain:
    config = model.config
    wte, blocks, ln_f, head = model.transformer.wte, model.transformer.h, model.transformer.ln_f, model.lm_head
    if len(blocks) != config.n_layer:
        raise ValueError(f"LitGPT GPT: config.n_layer={config.n_layer} but transformer.h has {len(blocks)} blocks")
    rope_indices = config.rope_indices
    block_index = {id(block): i for i, block in enumerate(blocks)}

    def pre(idx: Tensor, input_pos: Tensor | None = None, input_pos_maxp1: int | None = None,
            lm_head_chunk_size: int = 0) -> tuple[Tensor, RopeContext]:
        if input_pos is not None or input_pos_maxp1 is not None:
            raise TypeError("greedysnake trains LitGPT models without a KV cache; got input_pos. Fix: call the "
                            "model as model(idx) in training_step (input_pos is for generation).")
        if lm_head_chunk_size:
            raise TypeError(f"lm_head_chunk_size={lm_head_chunk_size}: greedysnake runs the head as one post "
                            "step. Fix: call model(idx) and chunk the loss in training_step if needed.")
        T = idx.size(1)
        if model.max_seq_length < T:
            raise ValueError(f"Cannot forward sequence of length {T}, max seq length is only {model.max_seq_length}.")
        ctx = RopeContext(model.cos[:T].unsqueeze(0), model.sin[:T].unsqueeze(0))
        x = wte(idx)
        if config.scale_embeddings:
            x = x * torch.tensor(config.n_embd**0.5, dtype=x.dtype)  # as GPT.forward computes it
        return x, ctx

    def block_forward(block: nn.Module, x: Tensor, ctx: RopeContext) -> Tensor:
        cos, sin = ctx
        if rope_indices is not None:
            which = rope_indices[block_index[id(block)]]
            cos, sin = cos[..., which], sin[..., which]
        return block(x, cos, sin, None, None, None)

    def post(x: Tensor, ctx: RopeContext) -> Tensor:
        logits = head(ln_f(x))
        if config.final_logit_softcapping is not None:
            from litgpt.model import do_softcapping

            logits = do_softcapping(logits, thresh=config.final_logit_softcapping)
        return logits

    return LayerChain(pre_modules=[wte], blocks=tuple(blocks), post_modules=[ln_f, head], pre=pre,
                      block_forward=block_forward, post=post)


# -- lit_model.pth in -------------------------------------------------------------------------------------
def read_lit_state(path: str | Path) -> dict[str, Tensor]:
    """The state dict of a LitGPT ``lit_model.pth`` (or a fine-tuning checkpoint's ``{"model": ...}``),
    memory-mapped: a tensor's bytes are read when it is copied. A checkpoint without ``lm_head.weight``
    (a tied model) gets the embedding as the head's start."""
    path = Path(path)
    if path.is_dir():
        path = path / "lit_model.pth"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist. Fix: point checkpoint_dir at a directory that `litgpt "
                                "download` or `litgpt convert_to_litgpt` wrote (it holds lit_model.pth).")
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    state = state.get("model", state)
    if "lm_head.weight" not in state and "transformer.wte.weight" in state:
        warnings.warn(f"{path} has no lm_head.weight (a tied embedding): the head starts as a copy of "
                      "transformer.wte.weight and is trained untied; the export holds both.", stacklevel=2)
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state


def load_lit_weights(model: nn.Module, modules: Sequence[nn.Module], state: dict[str, Tensor],
                     names: dict[int, str] | None = None) -> None:
    """Each of ``modules`` (submodules of ``model``) loads its own entries of ``state`` with its own
    ``load_state_dict(strict=True)``: only those tensors are read."""
    names = names or {id(m): n for n, m in model.named_modules()}
    for module in modules:
        prefix = names[id(module)] + "." if names[id(module)] else ""
        module.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)


def attach_lit_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Mark a (meta-device) LitGPT model to be materialized from ``path`` (a ``lit_model.pth`` or its
    directory) unit by unit."""
    setattr(model, _CHECKPOINT, str(path))


class LitCheckpointInitializer:
    """Materializes a LitGPT model's units from its attached ``lit_model.pth``."""

    def __init__(self, model: nn.Module, path: str) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        self.state = read_lit_state(path)

    def weight_init_generator(self) -> Any:
        return None

    def init_modules(self, modules: Sequence[nn.Module], generator: Any) -> None:
        load_lit_weights(self.model, modules, self.state, self.names)


def _initializer(model: nn.Module) -> LitCheckpointInitializer | None:
    path = getattr(model, _CHECKPOINT, None)
    return LitCheckpointInitializer(model, path) if path else None  # None: reset_parameters()


register_adapter(Adapter("LitGPT GPT", is_litgpt_gpt, litgpt_chain, _initializer))
