"""Hugging Face decoder-only causal LMs as layered models (Llama, Qwen2, Mistral and GPT-2 families).

A ``*ForCausalLM`` is ``base model (embeddings, decoder layers, final norm) + lm_head``. The chain is:

- ``pre``: the base model's own forward up to its first decoder layer, stopped there by a pre-hook that
  captures the layer's inputs. Whatever this version of ``transformers`` computes before the layers
  (embeddings, position ids, the causal mask, rotary embeddings) is computed by ``transformers`` itself,
  so the chain stays exact across versions; the captured keyword arguments are the blocks' ``ctx``.
- blocks: the decoder layers, called with the captured keyword arguments.
- ``post``: the final norm and ``lm_head``; with ``labels``, the model's own ``loss_function``.

Meta-device models are materialized unit by unit with the model's ``_init_weights``, or, when a
pretrained checkpoint was attached (:func:`attach_pretrained`), with its tensors read per unit from
the local safetensors files (``safe_open``: only the unit's tensors are read).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_greedysnake.models.adapters import Adapter, register_adapter
from lightning_greedysnake.models.protocol import LayerChain

_LAYERS = ("layers", "h")
_NORMS = ("norm", "ln_f")
_PRETRAINED = "_greedysnake_pretrained"


def is_hf_causal_lm(module: nn.Module) -> bool:
    """A ``transformers`` model with a base model and an ``lm_head`` (checked without importing
    ``transformers``)."""
    if not type(module).__module__.startswith("transformers."):
        return False
    prefix = getattr(module, "base_model_prefix", None)
    base = getattr(module, prefix, None) if prefix else None
    return isinstance(getattr(module, "lm_head", None), nn.Module) and isinstance(base, nn.Module) and any(
        isinstance(getattr(base, n, None), nn.ModuleList) for n in _LAYERS)


def _parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module]:
    base = getattr(model, model.base_model_prefix)
    layers = next(getattr(base, n) for n in _LAYERS if isinstance(getattr(base, n, None), nn.ModuleList))
    norm = next((getattr(base, n) for n in _NORMS if isinstance(getattr(base, n, None), nn.Module)), None)
    if norm is None:
        raise ValueError(f"{type(model).__name__}: no final norm ({' or '.join(_NORMS)}) on its base model; "
                         "greedysnake's Hugging Face adapter knows the Llama, Qwen2, Mistral and GPT-2 layouts.")
    return base, layers, norm


class _Captured(Exception):
    def __init__(self, hidden: Tensor, kwargs: dict[str, Any]) -> None:
        super().__init__("greedysnake: first decoder layer reached")
        self.hidden, self.kwargs = hidden, kwargs


_ACCEPTED = {"input_ids", "attention_mask", "position_ids", "labels", "use_cache", "return_dict", "logits_to_keep"}


def hf_chain(model: nn.Module) -> LayerChain:
    base, layers, norm = _parts(model)
    if getattr(model.config, "num_hidden_layers", len(layers)) != len(layers):
        raise ValueError("config.num_hidden_layers differs from the number of decoder layers")

    def pre(*args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        if args:
            kwargs = {"input_ids": args[0], **kwargs}
            if len(args) > 1:
                raise TypeError("pass the Hugging Face model's inputs other than input_ids by keyword")
        # (PEFT's PeftModelForCausalLM passes inputs_embeds=None, output_attentions=None, ...: unset, they ask
        # for nothing else)
        kwargs = {k: v for k, v in kwargs.items() if k in _ACCEPTED or (v is not None and v is not False)}
        unknown = sorted(set(kwargs) - _ACCEPTED)
        if unknown or kwargs.get("use_cache"):
            raise TypeError(
                f"greedysnake trains Hugging Face causal LMs on input_ids, attention_mask, position_ids and "
                f"labels; got {unknown or ['use_cache=True']}. Fix: compute anything else in training_step."
            )
        labels = kwargs.pop("labels", None)
        kwargs.pop("return_dict", None)
        kwargs.pop("logits_to_keep", None)
        kwargs["use_cache"] = False

        def stop(module: nn.Module, a: tuple, kw: dict[str, Any]) -> None:
            hidden = a[0] if a else kw.pop("hidden_states")
            raise _Captured(hidden, dict(kw))

        handle = layers[0].register_forward_pre_hook(stop, with_kwargs=True)
        try:
            base(**kwargs)
        except _Captured as captured:
            return captured.hidden, {"block": captured.kwargs, "labels": labels}
        finally:
            handle.remove()
        raise RuntimeError(f"{type(base).__name__}.forward never reached its first decoder layer")

    def block_forward(block: nn.Module, hidden: Tensor, ctx: Any) -> Tensor:
        out = block(hidden, **ctx["block"])
        return out[0] if isinstance(out, tuple) else out  # older transformers return (hidden, ...)

    def post(hidden: Tensor, ctx: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        logits = model.lm_head(norm(hidden))
        loss = None
        if ctx["labels"] is not None:
            loss = model.loss_function(logits=logits, labels=ctx["labels"], vocab_size=model.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    pre_modules = [m for name, m in base.named_children() if m is not layers and m is not norm]
    return LayerChain(pre_modules=pre_modules, blocks=tuple(layers), post_modules=[norm, model.lm_head],
                      pre=pre, block_forward=block_forward, post=post)


# -- pretrained weights and initialization -------------------------------------------------------------------
def safetensors_index(path: Path) -> dict[str, Path]:
    """Tensor name -> file, for a ``save_pretrained`` directory (single file or sharded)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: single for k in f.keys()}
    raise FileNotFoundError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json. Fix: point pretrained= at a "
        "directory written by save_pretrained(..., safe_serialization=True)."
    )


def attach_pretrained(model: nn.Module, path: str | Path) -> None:
    """Mark a (meta-device) model to be materialized from the safetensors files in ``path`` unit by unit."""
    setattr(model, _PRETRAINED, str(path))


class HFInitializer:
    """Materializes a Hugging Face model's units: from attached pretrained files, else ``_init_weights``."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.names = {id(m): n for n, m in model.named_modules()}
        path = getattr(model, _PRETRAINED, None)
        self.index = safetensors_index(Path(path)) if path else None

    def weight_init_generator(self) -> Any:
        return None

    def init_modules(self, modules: Sequence[nn.Module], generator: Any) -> None:
        if self.index is None:
            init = getattr(self.model, "_init_weights")
            for module in modules:
                for sub in module.modules():
                    init(sub)
            return
        load_module_weights(self.model, modules, self.index, self.names)


def load_module_weights(model: nn.Module, modules: Sequence[nn.Module], index: dict[str, Path],
                        names: dict[int, str] | None = None) -> None:
    """Copy ``modules``' parameters (and buffers saved with them) from pretrained safetensors files,
    reading only those tensors."""
    from safetensors import safe_open

    names = names or {id(m): n for n, m in model.named_modules()}
    wanted: dict[Path, list[tuple[str, Tensor]]] = {}
    for module in modules:
        prefix = names[id(module)]
        for pname, tensor in [*module.named_parameters(), *module.named_buffers()]:
            key = f"{prefix}.{pname}" if prefix else pname
            if key not in index and key.endswith("lm_head.weight"):
                # a checkpoint of a tied model stores the embedding only; the untied head starts from it
                key = next((k for k in index if k.endswith(("embed_tokens.weight", "wte.weight"))), key)
            if key not in index:
                if any(tensor is p for p in module.parameters()):
                    raise KeyError(f"pretrained weights have no tensor {key!r}")
                continue  # a buffer the checkpoint does not store (rotary inv_freq): keep the computed one
            wanted.setdefault(index[key], []).append((key, tensor))
    for file, items in wanted.items():
        with safe_open(str(file), framework="pt") as f:
            for key, tensor in items:
                with torch.no_grad():
                    tensor.copy_(f.get_tensor(key))


register_adapter(Adapter("Hugging Face causal LM", is_hf_causal_lm, hf_chain, HFInitializer))
