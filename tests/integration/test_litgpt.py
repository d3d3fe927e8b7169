"""LitGPT models: the adapter's chain is the model's forward, greedysnake trains three families as Lightning
does (fp32: weights and every window's gradient; bf16-mixed: against the same policy in plain PyTorch), and
``lit_model.pth`` streams in unit by unit and is exported back for LitGPT's own loader."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

litgpt = pytest.importorskip("litgpt")

from litgpt.config import Config  # noqa: E402
from litgpt.model import GPT  # noqa: E402

from lightning_greedysnake import GreedySnakeStrategy  # noqa: E402
from lightning_greedysnake.models import chain_of  # noqa: E402
from tests.helpers import (  # noqa: E402
    Grads,
    OptimizerMixin,
    assert_weights_match,
    bf16_policy_run,
    make_trainer,
    max_abs_diff,
    token_loader,
)

VOCAB = 64
TINY = dict(n_layer=3, n_embd=32, n_head=4, n_query_groups=2, head_size=8, intermediate_size=64,
            vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=16)
FAMILIES = {
    # Llama 3 rotary scaling, GQA (4 query heads, 2 key/value groups), SwiGLU
    "llama": ("Llama-3.2-1B", {}),
    # GQA with biased q/k/v projections
    "qwen": ("Qwen2.5-0.5B", {}),
    # Gemma 3's own block: post-attention and post-MLP norms, q/k norms, scaled embeddings, sliding-window
    # layers, and a RoPE base per layer (rope_indices: each block takes its own slice of cos/sin)
    "gemma3": ("Gemma-3-1b-it", {"sliding_window_size": 4, "sliding_window_indices": [1, 0, 1],
                                 "rope_indices": [1, 0, 1]}),
}
CHAIN_ONLY = {
    # parallel residual and partial rotary (Phi), final logit soft-capping (Gemma 2)
    "phi2": ("phi-2", {}),
    "gemma2": ("gemma-2-2b", {"sliding_window_size": 4}),
}
K = 3
NUM_BATCHES = 9
LR = 3e-3


def _config(family: str) -> Config:
    name, extra = {**FAMILIES, **CHAIN_ONLY}[family]
    return Config.from_name(name, **TINY, **extra)


class LitModule(OptimizerMixin, L.LightningModule):
    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = GPT(_config(family))
        self.lr = LR

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, on_step=True)
        return loss


@pytest.mark.parametrize("family", [*FAMILIES, *CHAIN_ONLY])
def test_the_chain_computes_what_the_model_computes(family):
    torch.manual_seed(0)
    model = GPT(_config(family)).eval()
    chain = chain_of(model)
    assert chain is not None and len(chain.blocks) == 3
    x = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        assert torch.equal(chain.forward(x), model(x))


def _fit(strategy: Any, family: str, precision: str = "32-true") -> tuple[dict[str, torch.Tensor], Grads]:
    L.seed_everything(0, verbose=False)
    module = LitModule(family)
    grads = Grads()
    trainer = make_trainer(strategy, K, max_epochs=2, precision=precision, callbacks=[grads])
    trainer.fit(module, token_loader(NUM_BATCHES, vocab=VOCAB))
    assert trainer.global_step == 2 * NUM_BATCHES // K
    return {n: p.detach().clone() for n, p in module.named_parameters()}, grads


_REFERENCES: dict[str, tuple[dict[str, torch.Tensor], Grads]] = {}


def _reference(family: str) -> tuple[dict[str, torch.Tensor], Grads]:
    if family not in _REFERENCES:
        _REFERENCES[family] = _fit("auto", family)
    return _REFERENCES[family]


@pytest.mark.parametrize("placement", ["ssd", "planned"])
@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedysnake_trains_a_litgpt_model_as_lightning_does(family, schedule, placement):
    ref_params, ref_grads = _reference(family)
    settings = {"auto": False} if placement == "ssd" else {}  # ssd: every kind on SSD; planned: the defaults
    strategy = GreedySnakeStrategy(schedule=schedule, layers_per_unit=1, **settings)
    got_params, got_grads = _fit(strategy, family)
    # (at most the slowest rotary pair of each key head, in a q/k/v bias)
    assert_weights_match(got_params, ref_params, ref_grads.grads, "attn.qkv.bias",
                         2 * _config(family).n_query_groups)
    assert len(got_grads.grads) == len(ref_grads.grads) == 2 * NUM_BATCHES // K
    for step, (g, r) in enumerate(zip(got_grads.grads, ref_grads.grads, strict=True)):
        assert g.keys() == r.keys() and max_abs_diff(g, r) <= (1e-6 if step == 0 else 1e-5), step


def test_the_reference_really_trains():
    L.seed_everything(0, verbose=False)
    initial = {n: p.detach().clone() for n, p in LitModule("gemma3").named_parameters()}
    assert max_abs_diff(initial, _reference("gemma3")[0]) > 100 * 1e-5


_BF16_POLICIES: dict[str, tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]] = {}


def _bf16_policy(family: str) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The plain-PyTorch bf16-mixed policy (``tests.helpers.bf16_policy_run``): bf16 copies of the fp32
    master weights under autocast, gradients accumulated in fp32, the module's AdamW on the masters. Only
    the parameters are bf16: the rope cache stays fp32, as under Lightning's bf16-mixed. (Once per family:
    both schedules compare against the same run, as :func:`_reference`.)"""
    if family not in _BF16_POLICIES:
        L.seed_everything(0, verbose=False)
        module = LitModule(family)
        grads = bf16_policy_run(module, list(token_loader(NUM_BATCHES, vocab=VOCAB)), K, epochs=2)
        _BF16_POLICIES[family] = {n: p.detach().clone() for n, p in module.named_parameters()}, grads
    return _BF16_POLICIES[family]


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_mixed_matches_the_policy_in_plain_pytorch(family, schedule):
    ref_params, ref_grads = _bf16_policy(family)
    got_params, got = _fit(GreedySnakeStrategy(auto=False, schedule=schedule, layers_per_unit=1), family, "bf16-mixed")
    assert all(p.dtype is torch.float32 for p in got_params.values())
    assert max_abs_diff(got_params, ref_params) <= 1e-5
    windows = got.grads
    assert len(windows) == len(ref_grads)
    for step, (g, r) in enumerate(zip(windows, ref_grads, strict=True)):
        assert max_abs_diff(g, r) <= (1e-6 if step == 0 else 1e-5), step


# -- lit_model.pth in and out ------------------------------------------------------------------------------
def _lit_checkpoint_dir(path: Any, family: str = "llama", seed: int = 1) -> Any:
    """A LitGPT checkpoint directory of random weights, written by LitGPT's own code (as ``litgpt
    convert_to_litgpt`` writes one): ``lit_model.pth`` and ``model_config.yaml``."""
    from litgpt.utils import incremental_save, save_config

    torch.manual_seed(seed)
    model = GPT(_config(family))
    path.mkdir()
    save_config(model.config, path)
    with incremental_save(path / "lit_model.pth") as saver:
        saver.save({k: saver.store_early(v) for k, v in model.state_dict().items()})
    return model


def _fit_recipe(strategy: Any, checkpoint_dir: Any = None, empty_init: bool = False, root: Any = None,
                callbacks: list | None = None) -> tuple[dict[str, torch.Tensor], Any]:
    from lightning_greedysnake.recipes.litgpt_module import LitGPTModule

    L.seed_everything(0, verbose=False)
    # (one epoch: GPTLightningModule's configure_optimizers sizes its schedule from
    # trainer.estimated_stepping_batches, which sets the train dataloader up during the strategy's setup)
    trainer = make_trainer(strategy, K, max_epochs=1, default_root_dir=root, callbacks=callbacks or [],
                           enable_checkpointing=bool(callbacks))
    with trainer.init_module(empty_init=empty_init):
        module = LitGPTModule(checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, name="Llama-3.2-1B",
                              overrides=None if checkpoint_dir else TINY, lr=LR, warmup_steps=2)
    trainer.fit(module, token_loader(NUM_BATCHES, vocab=VOCAB))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, module


def test_a_lit_model_pth_streams_in_unit_by_unit(tmp_path, monkeypatch):
    from lightning_greedysnake.models import litgpt as adapter

    pretrained = _lit_checkpoint_dir(tmp_path / "base")
    calls: list[int] = []
    original = adapter.load_lit_weights

    def spy(model: Any, modules: Any, state: Any, names: Any = None) -> None:
        calls.append(sum(p.numel() for m in modules for p in m.parameters()))
        original(model, modules, state, names)

    monkeypatch.setattr(adapter, "load_lit_weights", spy)

    class Initial(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.state = trainer.strategy.full_state_dict()

    initial = Initial()
    got, module = _fit_recipe(GreedySnakeStrategy(auto=False, layers_per_unit=1), tmp_path / "base", empty_init=True,
                              callbacks=[initial])
    expected = {f"model.{k}": v for k, v in pretrained.state_dict().items()}
    assert max_abs_diff({k: initial.state[k] for k in expected}, expected) == 0
    total = sum(p.numel() for p in pretrained.parameters())
    assert len(calls) == 3 and sum(calls) == total and max(calls) < total  # one unit per read
    # and training from there is what Lightning does from the eagerly loaded weights
    reference, _ = _fit_recipe("auto", tmp_path / "base")
    assert max_abs_diff(reference, got) <= 1e-5


def test_the_export_loads_with_litgpts_own_loader_and_gives_the_same_logits(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from litgpt.utils import lazy_load

    from lightning_greedysnake.recipes.litgpt_module import export_litgpt

    _lit_checkpoint_dir(tmp_path / "base")
    (tmp_path / "base" / "tokenizer.json").write_text("{}")  # copied beside the weights for `litgpt generate`
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _, module = _fit_recipe(GreedySnakeStrategy(auto=False), tmp_path / "base", empty_init=True, root=tmp_path,
                            callbacks=[ckpt])
    target = export_litgpt(tmp_path / "ckpt" / "last.ckpt", tmp_path / "out", copy_from=tmp_path / "base")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    loaded = GPT(Config.from_file(tmp_path / "out" / "model_config.yaml"))
    state = lazy_load(target)  # what litgpt.utils.load_checkpoint (litgpt generate's loader) does
    loaded.load_state_dict(state.get("model", state), strict=True)
    assert max_abs_diff(loaded.state_dict(), module.model.state_dict()) == 0
    x = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), module.model.eval()(x))


def test_a_checkpoint_without_a_head_trains_it_untied_from_the_embedding(tmp_path):
    from litgpt.utils import save_config

    from lightning_greedysnake.recipes.litgpt_module import LitGPTModule

    torch.manual_seed(3)
    tied = GPT(_config("llama"))
    (tmp_path / "tied").mkdir()
    save_config(tied.config, tmp_path / "tied")
    untied = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    torch.save(untied, tmp_path / "tied" / "lit_model.pth")
    with pytest.warns(UserWarning, match="trained untied"):
        module = LitGPTModule(checkpoint_dir=str(tmp_path / "tied"))
    assert module.model.lm_head.weight is not module.model.transformer.wte.weight
    assert torch.equal(module.model.lm_head.weight, tied.transformer.wte.weight)


def test_bad_litgpt_inputs_are_refused(tmp_path):
    from lightning_greedysnake.recipes.litgpt_module import LitGPTModule

    with pytest.raises(ValueError, match=r"model.name='Llama-9'.*Fix"):
        LitGPTModule("Llama-9")
    with pytest.raises(FileNotFoundError, match=r"model_config.yaml.*Fix"):
        LitGPTModule(checkpoint_dir=str(tmp_path))
    chain = chain_of(GPT(_config("llama")))
    with pytest.raises(TypeError, match=r"KV cache.*Fix"):
        chain.pre(torch.zeros(1, 4, dtype=torch.long), input_pos=torch.arange(4))


def test_a_missing_litgpt_names_the_extra(monkeypatch):
    import sys

    from lightning_greedysnake.models.litgpt import require_litgpt

    monkeypatch.setitem(sys.modules, "litgpt", None)  # import litgpt raises ImportError
    with pytest.raises(ImportError, match=r'lightning-greedysnake\[litgpt\]'):
        require_litgpt()
