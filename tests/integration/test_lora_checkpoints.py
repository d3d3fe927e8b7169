"""Checkpoints of a LoRA run (issue 70): PEFT's LoRA on a tiny llama and on GPT-2 (its frozen head tied to its
frozen embedding), the base in bf16 beside fp32 adapters under ``32-true``, and LitGPT's own LoRA model, saved
mid-fit by ``ModelCheckpoint`` and resumed with ``trainer.fit(..., ckpt_path=...)``, end where the uninterrupted
run ends (the adapters as the other resume tests hold them, the frozen base bit-identical and in its own dtype),
with every kind on SSD and with the planned defaults. The checkpoint holds the base in its own dtype (bf16 stays
bf16) under every name Lightning's own state dict has (GPT-2's tied head included), with its true values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_greedysnake import GreedySnakeStrategy, OffloadConfig
from lightning_greedysnake.checkpoint.plain import plain_checkpoint
from tests.helpers import make_trainer, max_abs_diff, token_loader

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("litgpt")

from tests.integration.test_litgpt_lora import LoRAModule
from tests.integration.test_peft import VOCAB, PeftModule

BATCHES = 6  # with K=3: two optimizer steps an epoch

MODELS = {
    "peft_llama_bf16_base": lambda: PeftModule(torch.bfloat16, "llama"),
    "peft_gpt2_bf16_base_tied_head": lambda: PeftModule(torch.bfloat16, "gpt2"),
    "litgpt_lora": LoRAModule,
}
STRATEGIES = {
    "every_kind_on_ssd": lambda: GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd")),
    "planned_defaults": lambda: GreedySnakeStrategy(),
}


def build(model: str) -> L.LightningModule:
    L.seed_everything(0, verbose=False)
    return MODELS[model]()


def fit(model: str, strategy: Any, root: Path, max_epochs: int = 3, ckpt_path: str | None = None
        ) -> tuple[dict[str, torch.Tensor], L.LightningModule, L.Trainer]:
    module = build(model)
    trainer = make_trainer(strategy, 3, max_epochs=max_epochs, enable_checkpointing=True, default_root_dir=root,
                           callbacks=[ModelCheckpoint(dirpath=root, save_last=True)])
    L.seed_everything(0, verbose=False)
    trainer.fit(module, token_loader(BATCHES, vocab=VOCAB), ckpt_path=ckpt_path)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, module, trainer


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("model", list(MODELS))
def test_a_lora_run_resumed_from_a_checkpoint_ends_where_the_uninterrupted_run_ends(tmp_path, model, strategy):
    initial = {n: p.detach().clone() for n, p in build(model).named_parameters()}
    uninterrupted, module, _ = fit(model, STRATEGIES[strategy](), tmp_path / "a")
    fit(model, STRATEGIES[strategy](), tmp_path / "b", max_epochs=1)
    last = tmp_path / "b" / "last.ckpt"
    resumed, _, trainer = fit(model, STRATEGIES[strategy](), tmp_path / "b", ckpt_path=str(last))
    assert trainer.global_step == 6
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    frozen = set(initial) - trainable
    assert trainable and frozen and all("lora_" in n for n in trainable)
    assert max_abs_diff({n: resumed[n] for n in trainable}, {n: uninterrupted[n] for n in trainable}) <= 1e-6
    assert max_abs_diff({n: resumed[n] for n in trainable}, {n: initial[n] for n in trainable}) > 1e-4  # it trained
    assert all(resumed[n].dtype == initial[n].dtype for n in initial)  # bf16 base, fp32 adapters
    assert max_abs_diff({n: resumed[n] for n in frozen}, {n: initial[n] for n in frozen}) == 0


@pytest.mark.parametrize("model", list(MODELS))
def test_the_checkpoint_holds_the_base_in_its_own_dtype_under_every_name_lightning_saves(tmp_path, model):
    """Every entry of the module's own state dict (GPT-2's ``lm_head.weight``, the embedding it is tied to,
    included), in the parameter's dtype (bf16 not upcast to fp32: the size of the base is its own), the frozen
    ones with the base's values; the adapters as Lightning's own checkpoint at the same step holds them."""
    module = build(model)
    expected = {n: v.detach().clone() for n, v in module.state_dict().items()}
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    fit(model, GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd")), tmp_path / "gs",
        max_epochs=1)
    fit(model, "auto", tmp_path / "auto", max_epochs=1)
    saved = plain_checkpoint(tmp_path / "gs" / "last.ckpt")["state_dict"]
    reference = torch.load(tmp_path / "auto" / "last.ckpt", weights_only=True)["state_dict"]
    assert saved.keys() == reference.keys() == expected.keys()
    for name, value in saved.items():
        assert value.dtype == reference[name].dtype == expected[name].dtype, name
        assert value.shape == expected[name].shape, name
        assert torch.isfinite(value.float()).all(), name
    base = [n for n in saved if n not in trainable]
    assert any(saved[n].dtype == torch.bfloat16 for n in base) or model == "litgpt_lora"
    assert max_abs_diff({n: saved[n] for n in base}, {n: expected[n] for n in base}) == 0
    assert max_abs_diff({n: saved[n] for n in trainable}, {n: reference[n] for n in trainable}) <= 1e-5


def test_a_plain_lightning_checkpoint_of_gpt2_with_its_tied_head_resumes_under_greedysnake(tmp_path):
    """Lightning's own file holds the frozen head under both names; the second one is the embedding, set once
    through its unit (it was copied into the head's placeholder: "more than one element of the written-to
    tensor refers to a single memory location")."""
    model = "peft_gpt2_bf16_base_tied_head"
    fit(model, "auto", tmp_path / "plain", max_epochs=1)
    plain = str(tmp_path / "plain" / "last.ckpt")
    reference, module, _ = fit(model, "auto", tmp_path / "r", ckpt_path=plain)
    got, _, _ = fit(model, GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd")), tmp_path / "g",
                    ckpt_path=plain)
    assert max_abs_diff(got, reference) <= 1e-5
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    assert max_abs_diff({n: got[n] for n in frozen}, {n: reference[n] for n in frozen}) == 0
