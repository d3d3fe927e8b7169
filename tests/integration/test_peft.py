"""Hugging Face PEFT's LoRA, set up as its users do (``get_peft_model`` on a causal LM): with an fp32 base it
trains as Lightning does (the adapters to 1e-5 with every window's gradients, the frozen base bit-identical),
on every path; with the base held in bf16 under ``32-true`` (PEFT's usual setup), which the tensor manager
would lay out in fp32, it is refused before any work, naming the parameter (was: 9.1e-3 away, silently).
Keeping the base in its own dtype and reading it without writing it back is issue 70's."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.helpers import Grads, make_trainer, max_abs_diff, token_loader  # noqa: E402
from tests.integration.test_optimizer_contract import PATHS  # noqa: E402  (the four paths)

VOCAB = 64
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)


class PeftModule(L.LightningModule):
    def __init__(self, base_dtype: torch.dtype) -> None:
        super().__init__()
        config = transformers.AutoConfig.for_model("llama", **LLAMA)
        base = transformers.AutoModelForCausalLM.from_config(config).to(base_dtype)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0)
        self.model = peft.get_peft_model(base, lora)
        for p in self.model.parameters():  # (the adapters in fp32, as PEFT's autocast_adapter_dtype leaves them)
            if p.requires_grad:
                p.data = p.data.float()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.model(input_ids=x, labels=y).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3)




def fit(strategy: Any, base_dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], Any, Any]:
    L.seed_everything(0, verbose=False)
    module, grads = PeftModule(base_dtype), Grads()
    trainer = make_trainer(strategy, 3, callbacks=[grads])
    trainer.fit(module, token_loader(6, vocab=VOCAB))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, grads, module


@pytest.mark.parametrize("path", list(PATHS))
def test_peft_lora_on_an_fp32_base_trains_as_lightning_does(path):
    ref, ref_grads, module = fit("auto")
    got, got_grads, _ = fit(PATHS[path]())
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(got_grads.grads) == len(ref_grads.grads) == 4
    for g, r in zip(got_grads.grads, ref_grads.grads, strict=True):
        assert g.keys() <= trainable | set(r)
        assert max_abs_diff({n: g[n] for n in trainable}, {n: r[n] for n in trainable}) <= 1e-5
    assert max_abs_diff({n: got[n] for n in trainable}, {n: ref[n] for n in trainable}) <= 1e-5
    frozen = set(got) - trainable
    assert max_abs_diff({n: got[n] for n in frozen}, {n: ref[n] for n in frozen}) == 0


def test_peft_lora_on_a_bf16_base_under_32_true_is_refused_before_any_work(tmp_path):
    L.seed_everything(0, verbose=False)
    module = PeftModule(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer = make_trainer(PATHS["vertical-ssd"](), 3, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"parameter '.*' is bfloat16 \(frozen\).*Fix:"):
        trainer.fit(module, token_loader(6, vocab=VOCAB))
    assert trainer.global_step == 0
    assert max_abs_diff({n: p.detach() for n, p in module.named_parameters()}, before) == 0
