"""LitGPT's own LoRA model (``litgpt.lora.GPT`` with ``mark_only_lora_as_trainable``, LitGPT's ``finetune_lora``
setup) trains as Lightning does: the LoRA weights and every window's gradients to 1e-5, the frozen base
bit-identical, on every path (issue 70: exact today, the base's cost aside)."""

from __future__ import annotations

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


class LoRAModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = Config.from_name("Llama-3.2-1B", n_layer=3, n_embd=32, n_head=4, n_query_groups=2, head_size=8,
                                  intermediate_size=64, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=16,
                                  lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True,
                                  lora_projection=True)
        self.model = GPT(config)
        mark_only_lora_as_trainable(self.model)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3)




def fit(strategy: Any) -> tuple[dict[str, torch.Tensor], Any, set[str]]:
    L.seed_everything(0, verbose=False)
    module, grads = LoRAModule(), Grads()
    make_trainer(strategy, 3, callbacks=[grads]).fit(module, token_loader(6, vocab=VOCAB, seq=8))
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {n: p.detach().clone() for n, p in module.named_parameters()}, grads, trainable


@pytest.mark.parametrize("path", list(PATHS))
def test_litgpt_lora_trains_as_lightning_does(path):
    ref, ref_grads, trainable = fit("auto")
    got, got_grads, _ = fit(PATHS[path]())
    assert trainable and all("lora_" in n for n in trainable)
    assert len(got_grads.grads) == len(ref_grads.grads) == 4
    for g, r in zip(got_grads.grads, ref_grads.grads, strict=True):
        assert max_abs_diff({n: g[n] for n in trainable}, {n: r[n] for n in trainable}) <= 1e-5
    assert max_abs_diff({n: got[n] for n in trainable}, {n: ref[n] for n in trainable}) <= 1e-5
    frozen = set(got) - trainable
    assert max_abs_diff({n: got[n] for n in frozen}, {n: ref[n] for n in frozen}) == 0
