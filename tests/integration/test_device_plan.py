"""``auto=True`` on a GPU (here the simulated device): a model whose training state fits half the device
budget keeps every kind on the device, exact against Lightning; a larger one, or a run whose settings
need the tensor manager, is offloaded as before, and the report says why."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_greedysnake import GreedySnakePrecision, GreedySnakeStrategy
from lightning_greedysnake.checkpoint import is_checkpoint_dir
from lightning_greedysnake.config import GreedySnakeConfig, OffloadConfig, TensorKind, Tier
from lightning_greedysnake.offload.device import SIMULATE_ENV
from lightning_greedysnake.strategy.planning.device import model_state_bytes
from tests.helpers import TinyGPTModule, make_trainer, max_abs_diff, token_loader
from tests.integration.test_equivalence import _make, assert_matches, reference, run


@pytest.fixture
def simulated(monkeypatch):
    monkeypatch.setenv(SIMULATE_ENV, "1")


def _need() -> int:
    module, _ = _make("gpt")
    return model_state_bytes(module)


class Manager(L.Callback):
    """Whether the run trained through the tensor manager."""

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.used = trainer.strategy.tensor_manager is not None


def test_the_state_counts_four_copies_of_each_trainable_parameter_and_one_of_a_frozen_one():
    layer = torch.nn.Linear(10, 10)
    layer.bias.requires_grad_(False)
    assert model_state_bytes(layer) == 100 * 4 * 4 + 10 * 4


def test_a_model_whose_state_fits_half_the_budget_stays_on_the_device_and_trains_exactly(simulated, caplog):
    seen = Manager()
    strategy = GreedySnakeStrategy(auto_device_budget_bytes=2 * _need())  # (the boundary: exactly half)
    with caplog.at_level("INFO"):
        got = run(strategy, "gpt", 3, callbacks=(seen,))
    assert_matches(got, reference("gpt", 3))
    assert not seen.used and not strategy.config.offload.uses_tensor_manager
    assert all(strategy.config.offload.tier(kind) is Tier.DEVICE for kind in TensorKind)
    assert "every kind stays on the device" in caplog.text
    assert strategy.settings.offload.unset() == set(TensorKind)  # the user's settings are not rewritten


def test_a_model_over_half_the_budget_is_offloaded_and_the_report_says_why(simulated, caplog):
    seen = Manager()
    budget = 2 * _need() - 1
    with caplog.at_level("INFO"):
        got = run(GreedySnakeStrategy(auto_device_budget_bytes=budget), "gpt", 3, callbacks=(seen,))
    assert_matches(got, reference("gpt", 3))
    assert seen.used
    assert f"offloading (its state, {_need():,} bytes, exceeds 1/2 of the device budget of {budget:,}" in caplog.text


class WeightTiers(L.Callback):
    def on_train_start(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        self.tiers = [t.value for t in manager.arena.regions.unit_tiers[TensorKind.WEIGHTS]]
        self.sizes = [manager.region_bytes(TensorKind.WEIGHTS, u) for u in range(manager.num_units)]
        self.state = manager.state


@pytest.mark.parametrize("fits", ["all", "the first unit"])
def test_what_does_not_fit_whole_keeps_the_compute_weights_that_fit_on_the_device_exactly(simulated, caplog, fits):
    """Over half the budget: offloaded, but the placement plan puts the compute weights on the device
    first (a prefix of units, within half the budget less the device tier's working set), the rest of
    them in RAM; exact against Lightning."""
    from lightning_greedysnake.strategy.planning.device import weights_room_bytes

    seen = WeightTiers()
    budget = 2 * _need() - 1
    if fits != "all":  # units of 20, 16 and 20 KiB: room for the first only
        working = 2 * 20480 + 2 * 20480  # (the unit computing and one prefetched; two gradient accumulators)
        budget = 2 * (working + 30000)
    with caplog.at_level("INFO"):
        got = run(GreedySnakeStrategy(auto_device_budget_bytes=budget, layers_per_unit=1), "gpt", 3,
                  callbacks=(seen,))
    assert_matches(got, reference("gpt", 3))
    assert weights_room_bytes(seen.state, OffloadConfig(), budget) == budget // 2 - 4 * 20480
    assert "keeps what fits of the compute weights on the device" in _report(caplog)
    assert seen.tiers == (["device"] * 3 if fits == "all" else ["device", "host", "host"])
    table = caplog.text[caplog.text.index("greedysnake placement plan"):]
    assert "device room for weights" in table and (" device, " in table if fits == "all" else "device 1/3 units" in table)


@pytest.mark.parametrize(("settings", "plugins", "why"), [
    ({"offload": {"weights": "host"}}, (), "you placed offload.weights"),
    ({"offload": {"optimizer_state_dtype": "bfloat16"}}, (), "offload.optimizer_state_dtype='bfloat16'"),
    ({}, ("fp16",), "loss scaling"),
], ids=["a_placed_kind", "bf16_state", "fp16_loss_scaling"])
def test_settings_only_the_tensor_manager_serves_keep_the_offload(simulated, caplog, settings, plugins, why):
    seen = Manager()
    strategy = GreedySnakeStrategy(auto_device_budget_bytes=100 * _need(), **settings)
    plugins = [GreedySnakePrecision("16-mixed", scaler=torch.amp.GradScaler("cpu")) for _ in plugins]
    with caplog.at_level("INFO"):
        run(strategy, "gpt", 2, callbacks=(seen,), trainer_kwargs={"plugins": list(plugins), "max_epochs": 1})
    assert seen.used and "offloading (" in _report(caplog) and why in _report(caplog)


def test_every_kind_placed_by_you_is_neither_planned_nor_reported(simulated, caplog):
    seen = Manager()
    strategy = GreedySnakeStrategy(auto_device_budget_bytes=100 * _need(), offload=OffloadConfig.everywhere("host"))
    with caplog.at_level("INFO"):
        run(strategy, "gpt", 2, callbacks=(seen,), trainer_kwargs={"max_epochs": 1})
    assert seen.used and "device plan" not in caplog.text


def _report(caplog: Any) -> str:
    return next(line for line in caplog.text.splitlines() if "greedysnake device plan" in line)


def test_a_model_built_on_the_meta_device_is_materialized_by_the_tensor_manager(simulated, caplog):
    seen = Manager()
    trainer = make_trainer(GreedySnakeStrategy(auto_device_budget_bytes=100 * _need()), 2, callbacks=[seen], max_epochs=1)
    with trainer.init_module(empty_init=True):
        module = TinyGPTModule(n_layer=3)
    with caplog.at_level("INFO"):
        trainer.fit(module, token_loader(4))
    assert seen.used and "built on the meta device" in _report(caplog)


def test_a_run_planned_onto_the_device_resumes_a_checkpoint_an_offloaded_run_streamed(simulated, tmp_path):
    """A larger device budget on the resume (a bigger GPU, say) does not strand the offloaded run's
    checkpoint directory: the state is gathered as the export gathers it, and training goes on as if
    uninterrupted."""
    fits = 100 * _need()
    L.seed_everything(0, verbose=False)
    whole = TinyGPTModule(n_layer=3)
    make_trainer(GreedySnakeStrategy(auto_device_budget_bytes=fits), 2, max_epochs=2).fit(whole, token_loader(8))

    L.seed_everything(0, verbose=False)
    saving = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    first = make_trainer(GreedySnakeStrategy(auto_device_budget_bytes=0), 2, max_epochs=1, callbacks=[saving],
                         enable_checkpointing=True)
    first.fit(TinyGPTModule(n_layer=3), token_loader(8))
    assert is_checkpoint_dir(tmp_path / "last.ckpt")  # streamed from the tensor manager's tiers
    seen, resumed = Manager(), TinyGPTModule(n_layer=3)
    again = make_trainer(GreedySnakeStrategy(auto_device_budget_bytes=fits), 2, max_epochs=2, callbacks=[seen])
    again.fit(resumed, token_loader(8), ckpt_path=tmp_path / "last.ckpt")
    assert not seen.used and again.global_step == 8
    assert max_abs_diff(dict(resumed.named_parameters()), dict(whole.named_parameters())) <= 1e-5


def test_without_a_gpu_nor_with_auto_false_nothing_is_planned_on_the_device(caplog, monkeypatch):
    """On a CPU the "device" is host memory, which the host placement plan already uses (with the
    background optimizer); with auto=False the fixed defaults hold. (Not on the simulated device, which
    is a device: the debug reruns' ``GREEDYSNAKE_SIMULATE_DEVICE=1`` is taken out here.)"""
    monkeypatch.delenv(SIMULATE_ENV, raising=False)
    for strategy in (GreedySnakeStrategy(auto_device_budget_bytes=100 * _need()),
                     GreedySnakeStrategy(auto=False, auto_device_budget_bytes=100 * _need())):
        seen = Manager()
        with caplog.at_level("INFO"):
            run(strategy, "gpt", 2, callbacks=(seen,), trainer_kwargs={"max_epochs": 1})
        assert seen.used and "device plan" not in caplog.text


@pytest.mark.parametrize("value", [-1, True, "1e9", 1.5])
def test_a_bad_device_budget_is_refused_with_the_setting_and_the_fix(value):
    with pytest.raises(ValueError, match=r"auto_device_budget_bytes=.* Fix: e\.g\. auto_device_budget_bytes="):
        GreedySnakeConfig(auto_device_budget_bytes=value)
