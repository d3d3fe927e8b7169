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
from lightning_greedysnake.strategy.readable import PlaceholderRead
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


def fit(model: str, strategy: Any, root: Path, max_epochs: int = 3, ckpt_path: str | None = None,
        callbacks: list | None = None) -> tuple[dict[str, torch.Tensor], L.LightningModule, L.Trainer]:
    module = build(model)
    trainer = make_trainer(strategy, 3, max_epochs=max_epochs, enable_checkpointing=True, default_root_dir=root,
                           callbacks=[ModelCheckpoint(dirpath=root, save_last=True), *(callbacks or [])])
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


# -- adapters-only saves, as the ecosystem makes them --------------------------------------------------------------
SSD = STRATEGIES["every_kind_on_ssd"]


def lora_of(module: L.LightningModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}


def peft_saved(directory: Path) -> dict[str, torch.Tensor]:
    """PEFT's adapter file, under the module's parameter names (PEFT drops the adapter's name, ``default``)."""
    from safetensors.torch import load_file

    saved = load_file(directory / "adapter_model.safetensors")
    return {"model." + n.replace(".weight", ".default.weight"): v for n, v in saved.items()}


def test_peft_save_pretrained_after_fit_writes_the_trained_adapters_and_from_pretrained_loads_them(tmp_path):
    import transformers
    from peft import PeftModel

    from tests.integration.test_peft import LLAMA

    _, module, _ = fit("peft_llama_bf16_base", SSD(), tmp_path / "r", max_epochs=1)
    module.model.save_pretrained(tmp_path / "adapter")
    trained = lora_of(module)
    assert max_abs_diff(peft_saved(tmp_path / "adapter"), trained) == 0
    L.seed_everything(0, verbose=False)  # (the same base, as PeftModule builds it)
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **LLAMA))
    loaded = PeftModel.from_pretrained(base.to(torch.bfloat16), tmp_path / "adapter")
    got = {"model." + n: p.detach() for n, p in loaded.named_parameters()}
    assert got.keys() == {n for n, _ in module.named_parameters()}
    assert max_abs_diff({n: got[n] for n in trained}, trained) == 0
    assert max_abs_diff(got, {n: p.detach() for n, p in module.named_parameters()}) == 0  # the base too


def test_litgpt_lora_checkpoint_after_fit_holds_the_trained_adapters(tmp_path):
    """LitGPT's ``finetune_lora`` saves ``{"model": {k: v for k, v in state_dict if lora_filter(k, v)}}``
    (``lit_model.pth.lora``); a fresh LoRA model with the same base loads it (``strict=False``) into the trained
    run's adapters."""
    from litgpt.lora import lora_filter

    _, module, _ = fit("litgpt_lora", SSD(), tmp_path / "r", max_epochs=1)
    path = tmp_path / "lit_model.pth.lora"
    torch.save({"model": {k: v for k, v in module.model.state_dict().items() if lora_filter(k, v)}}, path)
    fresh = build("litgpt_lora")
    fresh.model.load_state_dict(torch.load(path, weights_only=True)["model"], strict=False)
    assert max_abs_diff(lora_of(fresh), lora_of(module)) == 0
    assert max_abs_diff({n: p for n, p in fresh.named_parameters() if "lora_" not in n},
                        {n: p for n, p in module.named_parameters() if "lora_" not in n}) == 0


class SaveAdapters(L.Callback):
    """What users write: at the end of every epoch, save the adapters with the ecosystem's own call. Under
    greedysnake inside ``trainer.strategy.parameters_readable`` (which strategy='auto' has no need of); and
    the same call outside it, to see that it refuses instead of saving NaN placeholders."""

    def __init__(self, root: Path, model: str, trainable_only: bool) -> None:
        self.root, self.model, self.trainable_only = root, model, trainable_only
        self.saved: list[dict[str, torch.Tensor]] = []
        self.refused: list[str] = []

    def save(self, module: L.LightningModule, directory: Path) -> dict[str, torch.Tensor]:
        if self.model == "litgpt_lora":
            from litgpt.lora import lora_filter

            state = {"model." + k: v.clone() for k, v in module.model.state_dict().items() if lora_filter(k, v)}
            torch.save(state, directory.with_suffix(".lora"))
            return torch.load(directory.with_suffix(".lora"), weights_only=True)
        module.model.save_pretrained(directory)
        return peft_saved(directory)

    def on_train_epoch_end(self, trainer: Any, module: L.LightningModule) -> None:
        directory = self.root / f"epoch{trainer.current_epoch}"
        readable = getattr(trainer.strategy, "parameters_readable", None)
        if readable is None:  # strategy="auto": the parameters are the values
            self.saved.append(self.save(module, directory))
            return
        with pytest.raises(PlaceholderRead) as refused:
            self.save(module, directory)
        self.refused.append(str(refused.value))
        with readable(trainable_only=self.trainable_only):
            self.saved.append(self.save(module, directory))
        with pytest.raises(PlaceholderRead):  # (placeholders again after the block)
            module.model.state_dict()
        assert all(torch.isnan(p).all() for n, p in module.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("model, trainable_only", [("peft_llama_bf16_base", True), ("peft_gpt2_bf16_base_tied_head",
                                                   False), ("litgpt_lora", True)])
def test_adapters_saved_during_fit_inside_parameters_readable_are_the_trained_ones(tmp_path, model, trainable_only):
    """A Callback saving the adapters at every epoch's end (PEFT's ``save_pretrained``, LitGPT's LoRA state dict)
    saved the NaN placeholders, silently, before; now it refuses naming ``parameters_readable``, inside which it
    saves what strategy='auto' saves at the same point; training goes on unchanged after the block."""
    got = SaveAdapters(tmp_path / "gs", model, trainable_only)
    ref = SaveAdapters(tmp_path / "auto", model, trainable_only)
    for d in (got.root, ref.root):
        d.mkdir()
    got_end, _, _ = fit(model, SSD(), tmp_path / "g", max_epochs=2, callbacks=[got])
    ref_end, module, _ = fit(model, "auto", tmp_path / "a", max_epochs=2, callbacks=[ref])
    assert len(got.saved) == len(ref.saved) == 2 and len(got.refused) == 2
    assert "parameters_readable" in got.refused[0] and "NaN" in got.refused[0]
    for g, r in zip(got.saved, ref.saved, strict=True):
        assert g.keys() == set(lora_of(module)) and all(torch.isfinite(v).all() for v in g.values())
        assert max_abs_diff(g, r) <= 1e-5
    assert max_abs_diff(got.saved[-1], lora_of_values(got_end)) == 0  # the last epoch's: what fit ends with
    assert max_abs_diff(got_end, ref_end) <= 1e-5


def lora_of_values(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: v for n, v in values.items() if "lora_" in n}
