"""Hugging Face PEFT's LoRA, set up as its users do (``get_peft_model`` on a causal LM, the adapters in fp32):
it trains as Lightning does (the adapters to 1e-5 with every window's gradients, the frozen base
bit-identical) on every path, with the base in fp32 and in bf16 (PEFT's usual setup: kept read-only in its
own dtype; it was 9.1e-3 away, silently, before issue 69 refused it), under ``32-true`` and ``bf16-mixed``;
and on GPT-2 with its frozen head tied to its frozen embedding (issue 70)."""

from __future__ import annotations

import functools
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
GPT2 = dict(n_embd=32, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)  # (dropout: exact against MicrobatchRNG, see rng.py; not what this test is about)


class PeftModule(L.LightningModule):
    def __init__(self, base_dtype: torch.dtype, family: str = "llama") -> None:
        super().__init__()
        if family == "llama":
            config = transformers.AutoConfig.for_model("llama", **LLAMA)
            targets = ["q_proj", "v_proj", "o_proj"]
        else:  # GPT-2 with its default tied embeddings: the head is the (frozen) embedding
            config = transformers.AutoConfig.for_model("gpt2", **GPT2)
            targets = ["c_attn", "c_proj"]
        base = transformers.AutoModelForCausalLM.from_config(config).to(base_dtype)
        # task_type: as PEFT's docs set it up (a PeftModelForCausalLM, whose forward passes inputs_embeds=None,
        # output_attentions=None, ... on to the model)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM",
                               fan_in_fan_out=family == "gpt2")
        self.model = peft.get_peft_model(base, lora)
        for p in self.model.parameters():  # (the adapters in fp32, as PEFT's autocast_adapter_dtype leaves them)
            if p.requires_grad:
                p.data = p.data.float()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.model(input_ids=x, labels=y).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3)


def fit(strategy: Any, base_dtype: torch.dtype = torch.float32, precision: str = "32-true",
        family: str = "llama") -> tuple[dict[str, torch.Tensor], Any, Any]:
    L.seed_everything(0, verbose=False)
    module, grads = PeftModule(base_dtype, family), Grads()
    trainer = make_trainer(strategy, 3, callbacks=[grads], precision=precision)
    trainer.fit(module, token_loader(6, vocab=VOCAB))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, grads, module


@functools.cache
def reference(base_dtype: torch.dtype, precision: str, family: str = "llama") -> Any:
    """``strategy="auto"``'s run, once per setup (every path compares with the same one)."""
    return fit("auto", base_dtype, precision, family)


def assert_lora_exact(got: Any, ref: Any, module: Any) -> None:
    (got, got_grads), (ref, ref_grads) = got, ref
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(got_grads.grads) == len(ref_grads.grads) == 4
    for g, r in zip(got_grads.grads, ref_grads.grads, strict=True):
        assert g.keys() <= trainable | set(r)
        assert max_abs_diff({n: g[n] for n in trainable}, {n: r[n] for n in trainable}) <= 1e-5
    assert max_abs_diff({n: got[n] for n in trainable}, {n: ref[n] for n in trainable}) <= 1e-5
    frozen = set(got) - trainable
    assert all(got[n].dtype == ref[n].dtype for n in got)
    assert max_abs_diff({n: got[n] for n in frozen}, {n: ref[n] for n in frozen}) == 0


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("base_dtype, precision", [(torch.float32, "32-true"), (torch.bfloat16, "32-true"),
                                                   (torch.bfloat16, "bf16-mixed")])
def test_peft_lora_trains_as_lightning_does(path, base_dtype, precision):
    ref, ref_grads, module = reference(base_dtype, precision)
    got, got_grads, _ = fit(PATHS[path](), base_dtype, precision)
    assert_lora_exact((got, got_grads), (ref, ref_grads), module)


@pytest.mark.parametrize("path", list(PATHS))
def test_peft_lora_on_gpt2_with_its_frozen_tied_embedding_trains_as_lightning_does(path):
    """The head is the embedding's frozen weight, used by the first unit and the last: accepted (read-only,
    each keeps an equal copy), not refused as tied weights across units."""
    ref, ref_grads, module = reference(torch.bfloat16, "32-true", "gpt2")
    assert module.model.base_model.model.lm_head.weight is module.model.base_model.model.transformer.wte.weight
    got, got_grads, _ = fit(PATHS[path](), torch.bfloat16, family="gpt2")
    assert_lora_exact((got, got_grads), (ref, ref_grads), module)
