"""Hugging Face causal LMs: the adapter's chain is the model, greedysnake trains it as Lightning does,
pretrained weights stream in unit by unit, and the export loads with ``from_pretrained``."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

transformers = pytest.importorskip("transformers")

from lightning_greedysnake import GreedySnakeStrategy  # noqa: E402
from lightning_greedysnake.models import chain_of  # noqa: E402
from lightning_greedysnake.models import hf as hf_adapter  # noqa: E402
from lightning_greedysnake.recipes.hf_module import HFCausalLMModule, export_hf  # noqa: E402
from tests.helpers import Grads, assert_weights_match, make_trainer, max_abs_diff, token_loader  # noqa: E402

VOCAB = 64
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)
CONFIGS = {
    "llama": {"model_type": "llama", **LLAMA_LIKE},
    "qwen2": {"model_type": "qwen2", **LLAMA_LIKE},
    "mistral": {"model_type": "mistral", **LLAMA_LIKE},
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 3, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64,
             "tie_word_embeddings": False, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
             "bos_token_id": 0, "eos_token_id": 0},
}


def _model(name: str) -> Any:
    config = dict(CONFIGS[name])
    return transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(config.pop("model_type"), **config))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_chain_computes_what_the_model_computes(family):
    torch.manual_seed(0)
    model = _model(family).eval()
    chain = chain_of(model)
    assert chain is not None and len(chain.blocks) == 3
    x = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        assert torch.equal(chain.forward(x).logits, model(input_ids=x).logits)
        labels = torch.randint(0, VOCAB, (2, 10))
        assert torch.equal(chain.forward(x, labels=labels).loss, model(input_ids=x, labels=labels).loss)


def _fit(strategy: Any, family: str = "llama", root: Any = None, pretrained: str | None = None,
         empty_init: bool = False, callbacks: list | None = None, max_epochs: int = 2) -> tuple[dict, Any, Any]:
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(strategy, 3, max_epochs=max_epochs, default_root_dir=root, callbacks=callbacks or [],
                           enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks or []))
    with trainer.init_module(empty_init=empty_init):
        module = HFCausalLMModule(CONFIGS[family], pretrained=pretrained, lr=3e-3, warmup_steps=2)
    trainer.fit(module, token_loader(7, vocab=VOCAB))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, module, trainer


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_greedysnake_trains_a_hf_model_as_lightning_does(family, tmp_path):
    """Every window's gradient to 1e-6, the weights to 1e-5 but GPT-2's key bias (a third of each fused
    c_attn.bias): its gradient is rounding noise, which Adam turns into lr-sized steps (1.4e-5 on an AMD
    EPYC's kernels, where the gradients agree to 1e-7)."""
    ref_grads, got_grads = Grads(), Grads()
    reference, _, _ = _fit("auto", family, tmp_path / "a", callbacks=[ref_grads])
    got, _, _ = _fit(GreedySnakeStrategy(auto=False), family, tmp_path / "g", callbacks=[got_grads])  # state on SSD
    assert len(got_grads.grads) == len(ref_grads.grads) > 0
    for step, (g, r) in enumerate(zip(got_grads.grads, ref_grads.grads, strict=True)):
        assert g.keys() == r.keys() and max_abs_diff(g, r) <= 1e-6, step
    assert_weights_match(got, reference, ref_grads.grads, "attn.c_attn.bias", CONFIGS["gpt2"]["n_embd"])


def test_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _, module, _ = _fit(GreedySnakeStrategy(auto=False), root=tmp_path, callbacks=[ckpt])
    out = export_hf(tmp_path / "ckpt" / "last.ckpt", tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, module.model.eval()(input_ids=x).logits, atol=1e-6)
    assert (out / "config.json").is_file()


def test_pretrained_weights_stream_in_unit_by_unit(tmp_path, monkeypatch):
    torch.manual_seed(1)
    pretrained = _model("llama")
    pretrained.save_pretrained(tmp_path / "pre")
    calls: list[int] = []
    original = hf_adapter.load_module_weights

    def spy(model: Any, modules: Any, index: Any, names: Any = None) -> None:
        calls.append(sum(p.numel() for m in modules for p in m.parameters()))
        original(model, modules, index, names)

    monkeypatch.setattr(hf_adapter, "load_module_weights", spy)

    class Initial(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.state = trainer.strategy.full_state_dict()

    initial = Initial()
    got, module, _ = _fit(GreedySnakeStrategy(auto=False), pretrained=str(tmp_path / "pre"), empty_init=True,
                          callbacks=[initial])
    expected = {f"model.{k}": v for k, v in pretrained.state_dict().items()}
    assert max_abs_diff({k: initial.state[k] for k in expected}, expected) == 0
    total = sum(p.numel() for p in pretrained.parameters())
    assert len(calls) == 3 and sum(calls) == total and max(calls) < total  # one unit per read
    # and training from there is what Lightning does from the eagerly loaded weights
    reference, _, _ = _fit("auto", pretrained=str(tmp_path / "pre"))
    assert max_abs_diff(reference, got) <= 1e-5


def test_a_tied_pretrained_model_trains_untied_from_the_embedding(tmp_path):
    config = dict(CONFIGS["llama"], tie_word_embeddings=True)
    torch.manual_seed(2)
    tied = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **{k: v for k, v in config.items() if k != "model_type"}))
    tied.save_pretrained(tmp_path / "tied")
    with pytest.warns(UserWarning, match="tie_word_embeddings=True is trained untied"):
        module = HFCausalLMModule(config, pretrained=str(tmp_path / "tied"))
    assert module.model.lm_head.weight is not module.model.model.embed_tokens.weight
    assert torch.equal(module.model.lm_head.weight, tied.model.embed_tokens.weight)


def test_bad_hf_inputs_are_refused():
    with pytest.raises(ValueError, match="needs a model_type"):
        HFCausalLMModule({"hidden_size": 8})
    chain = chain_of(_model("llama"))
    with pytest.raises(TypeError, match=r"use_cache=True.*Fix"):
        chain.pre(torch.zeros(1, 4, dtype=torch.long), use_cache=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(TypeError, match=r"inputs_embeds.*Fix"):
            chain.pre(inputs_embeds=torch.zeros(1, 4, 32))
