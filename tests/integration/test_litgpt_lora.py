"""LitGPT's own LoRA model (``litgpt.lora.GPT`` with ``mark_only_lora_as_trainable``, LitGPT's ``finetune_lora``
setup) trains as Lightning does: the LoRA weights and every window's gradients to 1e-5, the frozen base
bit-identical and in its own dtype, on every path, with the base in fp32 under ``32-true`` and in bf16 under
``bf16-mixed`` (issue 70; a bf16 base beside fp32 adapters under ``32-true`` does not run under Lightning's own
strategy either: LitGPT's LoRA layer feeds its bf16 activations to the fp32 ``lora_A`` without a cast)."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

litgpt = pytest.importorskip("litgpt")

from litgpt.lora import GPT, Config, mark_only_lora_as_trainable  # noqa: E402

from tests.helpers import Grads, make_trainer, max_abs_diff, token_loader  # noqa: E402
from tests.integration.test_optimizer_contract import PATHS  # noqa: E402  (the four paths)

VOCAB = 64


SMALL = dict(n_layer=3, n_embd=32, n_head=4, n_query_groups=2, head_size=8, intermediate_size=64)


class LoRAModule(L.LightningModule):
    """LitGPT's LoRA GPT, r=4 on query, value and projection, the rest frozen; ``size``: the config's shape
    (default :data:`SMALL`)."""

    def __init__(self, base_dtype: torch.dtype = torch.float32, **size: int) -> None:
        super().__init__()
        config = Config.from_name("Llama-3.2-1B", **(size or SMALL), vocab_size=VOCAB, padded_vocab_size=VOCAB,
                                  block_size=16, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True,
                                  lora_value=True, lora_projection=True)
        self.model = GPT(config)
        mark_only_lora_as_trainable(self.model)
        for p in self.model.parameters():  # (the base in its dtype, the adapters in fp32)
            if not p.requires_grad:
                p.data = p.data.to(base_dtype)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3)




def fit(strategy: Any, base_dtype: torch.dtype = torch.float32,
        precision: str = "32-true") -> tuple[dict[str, torch.Tensor], Any, set[str]]:
    L.seed_everything(0, verbose=False)
    module, grads = LoRAModule(base_dtype), Grads()
    make_trainer(strategy, 3, callbacks=[grads], precision=precision).fit(module, token_loader(6, vocab=VOCAB, seq=8))
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {n: p.detach().clone() for n, p in module.named_parameters()}, grads, trainable


@functools.cache
def reference(base_dtype: torch.dtype, precision: str) -> Any:
    """``strategy="auto"``'s run, once per setup (every path compares with the same one)."""
    return fit("auto", base_dtype, precision)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("base_dtype, precision", [(torch.float32, "32-true"), (torch.bfloat16, "bf16-mixed")])
def test_litgpt_lora_trains_as_lightning_does(path, base_dtype, precision):
    ref, ref_grads, trainable = reference(base_dtype, precision)
    got, got_grads, _ = fit(PATHS[path](), base_dtype, precision)
    assert trainable and all("lora_" in n for n in trainable)
    assert len(got_grads.grads) == len(ref_grads.grads) == 4
    for g, r in zip(got_grads.grads, ref_grads.grads, strict=True):
        assert max_abs_diff({n: g[n] for n in trainable}, {n: r[n] for n in trainable}) <= 1e-5
    assert max_abs_diff({n: got[n] for n in trainable}, {n: ref[n] for n in trainable}) <= 1e-5
    frozen = set(got) - trainable
    assert all(got[n].dtype == ref[n].dtype == base_dtype for n in frozen)
    assert max_abs_diff({n: got[n] for n in frozen}, {n: ref[n] for n in frozen}) == 0


@pytest.mark.parametrize("base_dtype, precision", [(torch.float32, "32-true"), (torch.bfloat16, "bf16-mixed")])
def test_kept_graphs_on_ssd_train_as_lightning_does(base_dtype, precision):
    """recompute=False with every kind on SSD, the saved activations too (LoRA's fastest setting where compute
    binds: no recomputing forward, the graphs' saved tensors on SSD): as Lightning, and bit for bit as the same
    graphs held in memory. LitGPT's attention saves transposed views (its heads), which come back in their own
    strides."""
    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.config import OffloadConfig

    def kept(activations: str) -> Any:
        return fit(GreedySnakeStrategy(auto=False, recompute=False,
                                       offload=OffloadConfig.everywhere("ssd", activations=activations)),
                   base_dtype, precision)

    ref, ref_grads, trainable = reference(base_dtype, precision)
    got, got_grads, _ = kept("ssd")
    for g, r in zip(got_grads.grads, ref_grads.grads, strict=True):
        assert max_abs_diff({n: g[n] for n in trainable}, {n: r[n] for n in trainable}) <= 1e-5
    assert max_abs_diff(got, ref) <= 1e-5
    held, held_grads, _ = kept("host")
    assert max_abs_diff(got, held) == 0
    assert all(max_abs_diff(g, h) == 0 for g, h in zip(got_grads.grads, held_grads.grads, strict=True))
