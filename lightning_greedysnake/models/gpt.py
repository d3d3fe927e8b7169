"""A small, readable GPT (pre-norm decoder, learned positions, GELU MLP) that is a LayeredModel."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_greedysnake.models.protocol import LayerChain


@dataclass
class GPTConfig:
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Hidden size."""
    vocab_size: int = 256
    """Vocabulary size (256 for the byte-level corpus)."""
    block_size: int = 128
    """Longest sequence the position embedding covers."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and MLP outputs."""
    bias: bool = True
    """Whether linear layers and LayerNorms have a bias."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}); "
                f"pick n_head from the divisors of {self.n_embd}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def num_params(self) -> int:
        """Parameter count, computed from the config alone (no model needed)."""
        e, b = self.n_embd, int(self.bias)
        layer_norm = e + e * b
        per_block = 2 * layer_norm
        per_block += (e * 3 * e + 3 * e * b) + (e * e + e * b)  # attention: qkv, proj
        per_block += (e * 4 * e + 4 * e * b) + (4 * e * e + e * b)  # MLP: fc, proj
        embeddings = self.vocab_size * e + self.block_size * e
        return embeddings + self.n_layer * per_block + layer_norm + e * self.vocab_size


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx) -> logits`` with ``idx`` of shape (batch, time), token ids.

    The output embedding is not tied to the input embedding: a tie would make one parameter belong to
    both the first and the last unit.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # The weights are drawn from a generator holding the global RNG state of this moment, not from
        # the global RNG after construction: so a GPT created on the meta device and materialized unit by
        # unit later (the SSD tier's way to build models larger than RAM) gets the very same weights.
        self._init_rng_state = torch.get_rng_state()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if not self.lm_head.weight.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialisation; residual projections scaled by 1/sqrt(2 * n_layer)."""
        self.init_modules([self], self.weight_init_generator())

    def weight_init_generator(self) -> torch.Generator:
        generator = torch.Generator()
        generator.set_state(self._init_rng_state)
        return generator

    def init_modules(self, modules: Sequence[nn.Module], generator: torch.Generator) -> None:
        """Initialize the parameters of ``modules`` in place, in the model's parameter order (so unit by
        unit in unit order draws what one pass over the whole model draws)."""
        wanted = {id(p) for m in modules for p in m.parameters()}
        with torch.no_grad():
            for name, p in self.named_parameters():
                if id(p) not in wanted:
                    continue
                if p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("proj.weight") else 0.02
                    p.normal_(mean=0.0, std=std, generator=generator)
                elif name.endswith("bias"):
                    p.zero_()
                else:  # LayerNorm weights
                    p.fill_(1.0)

    # -- the layered-model protocol -------------------------------------------------------------------
    def _pre(self, idx: Tensor) -> tuple[Tensor, Any]:
        T = idx.shape[-1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds GPTConfig.block_size={self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos)), None

    def _post(self, x: Tensor, ctx: Any) -> Tensor:
        return self.lm_head(self.ln_f(x))

    def layer_chain(self) -> LayerChain:
        return LayerChain(
            pre_modules=(self.wte, self.wpe, self.drop),
            blocks=tuple(self.blocks),
            post_modules=(self.ln_f, self.lm_head),
            pre=self._pre,
            block_forward=lambda block, x, ctx: block(x),
            post=self._post,
        )

    def forward(self, idx: Tensor) -> Tensor:
        return self.layer_chain().forward(idx)
