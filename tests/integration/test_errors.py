"""Each unsupported input gets a clear error (or a one-time warning) before training starts."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from lightning_greedysnake import GPT, GPTConfig, GreedySnakePrecision, GreedySnakeStrategy, ScheduleKind
from lightning_greedysnake.engine import InputMismatchError
from lightning_greedysnake.models import LayeredModelNotFound
from tests.helpers import SequentialModule, TinyGPTModule, make_trainer, regression_loader, token_loader


def fit(module: LightningModule, loader: Any = None, strategy: Any = None, k: int = 2, **kwargs: Any) -> L.Trainer:
    trainer = make_trainer(strategy if strategy is not None else GreedySnakeStrategy(auto=False), k, max_epochs=1, **kwargs)
    trainer.fit(module, loader if loader is not None else token_loader(4))
    return trainer


def test_registered_names_and_precision_plugin_survive_string_selection():
    for name, schedule in (("greedysnake", ScheduleKind.VERTICAL), ("greedysnake_horizontal", ScheduleKind.HORIZONTAL)):
        trainer = L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
        assert isinstance(trainer.strategy, GreedySnakeStrategy)
        assert trainer.strategy.config.schedule is schedule
        assert isinstance(trainer.strategy.precision_plugin, GreedySnakePrecision)
        assert trainer.precision_plugin is trainer.strategy.precision_plugin


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_unsupported_precision(precision):
    with pytest.raises(ValueError, match=f"precision='{precision}'.*Fix"):
        L.Trainer(strategy="greedysnake", precision=precision, accelerator="cpu", logger=False)


def test_manual_optimization_refused():
    class Manual(TinyGPTModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="automatic_optimization"):
        fit(Manual(), k=1)  # with K > 1 Lightning itself refuses manual optimization first


def test_backward_override_refused():
    class Custom(TinyGPTModule):
        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            loss.backward()

    with pytest.raises(ValueError, match="overrides `backward`"):
        fit(Custom())


def test_on_after_backward_warns_once():
    class Hooked(TinyGPTModule):
        calls = 0

        def on_after_backward(self) -> None:
            type(self).calls += 1

    with pytest.warns(UserWarning, match="on_before_optimizer_step") as record:
        fit(Hooked())
    assert sum("on_after_backward" in str(w.message) for w in record) == 1
    assert Hooked.calls == 4  # still called, once per micro-batch


def test_no_layered_model():
    class Plain(TinyGPTModule):
        def __init__(self) -> None:
            super().__init__()
            del self.model
            self.proj = nn.Linear(4, 4)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.proj(batch[0].float()[..., :4]).sum()

    with pytest.raises(ValueError, match="no layered model.*Linear.*layer_chain"):
        fit(Plain())


@pytest.mark.parametrize("layered_module", [None, "net"])
def test_a_layered_model_without_blocks_names_the_users_class_and_the_fix(layered_module):
    class NoBlocks(SequentialModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential()
            self.head = nn.Linear(6, 3)

    with pytest.raises(LayeredModelNotFound, match=r"NoBlocks.net \(Sequential\) has no blocks.*Fix: give it at least"):
        fit(NoBlocks(), regression_loader(4), strategy=GreedySnakeStrategy(auto=False, layered_module=layered_module))


def test_two_candidates_then_naming_one():
    class Two(SequentialModule):
        def __init__(self) -> None:
            super().__init__()
            self.other = nn.Sequential(nn.Linear(3, 3))
            self.other.requires_grad_(False)

    with pytest.raises(ValueError, match=r"2 candidate layered models: \['net', 'other'\].*layered_module="):
        fit(Two(), regression_loader(4))
    fit(Two(), regression_loader(4), strategy=GreedySnakeStrategy(auto=False, layered_module="net"))


def test_layered_module_that_does_not_exist():
    with pytest.raises(ValueError, match="layered_module='nett'.*children are"):
        fit(SequentialModule(), regression_loader(4), strategy=GreedySnakeStrategy(auto=False, layered_module="nett"))


def test_parameters_outside_the_layered_model():
    class Extra(TinyGPTModule):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

    with pytest.raises(ValueError, match=r"outside the layered model \(model\): \['scale'\].*requires_grad_"):
        fit(Extra())


def test_tied_weights_across_units():
    class Tied(TinyGPTModule):
        def __init__(self) -> None:
            super().__init__()
            self.model.lm_head.weight = self.model.wte.weight

    with pytest.raises(ValueError, match="tied weights across units"):
        fit(Tied())
    # one unit holding everything is fine
    fit(Tied(), strategy=GreedySnakeStrategy(auto=False, layers_per_unit=3))


def test_training_step_that_skips_the_model():
    class Skips(TinyGPTModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model.wte.weight.sum()

    with pytest.raises(ValueError, match=r"did not call the layered model \(Skips.model, a GPT\)"):
        fit(Skips())


def test_training_step_calling_the_model_twice():
    class Twice(TinyGPTModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(batch[0]).sum() + self.model(batch[0]).sum()

    with pytest.raises(RuntimeError, match=r"training_step called the layered model twice for micro-batch 0: "
                                           r"strategy='greedysnake'.*Fix: call the layered model once per "
                                           r"training_step and reuse its output"):
        fit(Twice())


@pytest.mark.parametrize("k", [0, -2])
@pytest.mark.parametrize("run", ["fit", "validate"])
def test_accumulate_grad_batches_below_one_is_refused_before_any_work(tmp_path, k, run):
    """Lightning takes Trainer(accumulate_grad_batches=0) and fails mid-run dividing by it (under
    greedysnake a bare AssertionError in the planner): refused at setup, naming the setting, the value
    and the fix, before the offload directory is made."""
    trainer = make_trainer("greedysnake", k, max_epochs=1, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=rf"Trainer\(accumulate_grad_batches={k}\): strategy='greedysnake'.*"
                                         r"must be a positive integer\. Fix: set Trainer\(accumulate_grad_batches=1\)"):
        getattr(trainer, run)(TinyGPTModule(), token_loader(4))
    assert not (tmp_path / "greedysnake_offload").exists()


def test_random_inputs_before_the_model_call_are_detected():
    class Noisy(TinyGPTModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            x = (x + torch.randint(0, 2, x.shape)) % 32
            logits = self.model(x)
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    with pytest.raises(InputMismatchError, match="deterministic"):
        fit(Noisy())


def test_training_step_returning_none_skips_that_microbatch_like_lightning():
    class Skipper(TinyGPTModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx % 3 == 1 else loss

    results = []
    for strategy in ("auto", GreedySnakeStrategy(auto=False)):
        L.seed_everything(0, verbose=False)
        module = Skipper(lr=3e-3)
        fit(module, token_loader(6), strategy=strategy)
        results.append({n: p.detach().clone() for n, p in module.named_parameters()})
    assert max(float((results[0][n] - results[1][n]).abs().max()) for n in results[0]) <= 1e-5


def test_lbfgs_refused():
    class WithLBFGS(TinyGPTModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match="LBFGS"):
        fit(WithLBFGS())


class _PackedState(torch.Tensor):
    """A per-element state kept as a tensor subclass (as torchao's quantized optimizer states are)."""


class _PackedStateSGD(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for state in self.state.values():
            if type(state.get("momentum_buffer")) is torch.Tensor:
                state["momentum_buffer"] = state["momentum_buffer"].as_subclass(_PackedState)
        return loss


def test_state_in_a_tensor_subclass_is_refused_naming_the_bf16_alternative():
    class WithPackedState(TinyGPTModule):
        def configure_optimizers(self) -> Any:
            return _PackedStateSGD(self.parameters(), lr=0.1, momentum=0.9)

    with pytest.raises(ValueError, match=r"_PackedStateSGD keeps state 'momentum_buffer' as a _PackedState.*"
                                         r"optimizer_state_dtype=bfloat16"):
        fit(WithPackedState())


class _Opaque(torch.Tensor):
    """A tensor subclass without ``__tensor_flatten__``: its layout is invisible from outside."""


def test_state_in_a_tensor_subclass_that_does_not_flatten_is_refused():
    """State kept as a tensor subclass is streamed by the inner tensors it flattens into (torchao's
    quantized state, tests/integration/test_quantized_state.py); one that does not flatten is refused."""

    class OpaqueMomentum(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float = 0.1) -> None:
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        state = self.state[p]
                        if "buf" not in state:
                            state["buf"] = torch.zeros_like(p).as_subclass(_Opaque)
                        state["buf"].mul_(0.9).add_(p.grad)
                        p.add_(state["buf"], alpha=-group["lr"])

    class WithOpaqueState(TinyGPTModule):
        def configure_optimizers(self) -> Any:
            return OpaqueMomentum(self.parameters())

    with pytest.raises(ValueError, match=r"OpaqueMomentum keeps state 'buf' as a _Opaque.*cannot flatten.*Fix:"):
        fit(WithOpaqueState())


def test_layered_model_protocol_on_the_lightning_module_itself():
    """A LightningModule that *is* the layered model (implements layer_chain) works as well."""

    class SelfLayered(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=32, block_size=8))

        def layer_chain(self):  # delegate: the module itself is the layered model
            return self.gpt.layer_chain()

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.layer_chain().forward(idx)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            logits = self(batch[0])
            return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = fit(SelfLayered())
    assert trainer.global_step == 2
