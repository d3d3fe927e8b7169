"""Compute weights resident on the device beside an offloaded optimizer (``offload.weights='device'``),
on the simulated device (device memory separate and NaN until a copy lands, every copy late by a random
few milliseconds): exact against Lightning (32-true) and the plain-PyTorch bf16 policy, the parameters
bound to the resident memory, no weights on the disk, one H2D copy of each unit's new weights per step
and none per use, a resume bit for bit, device memory freed after fit, and a dropped wait caught.
(``tests/gpu`` runs the same on CUDA; CI reruns the fp16 and data-parallel cases on the simulated device.)"""

from __future__ import annotations

import gc
import threading
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import TensorKind
from lightning_greedysnake.offload.device import SIMULATE_ENV, SimulatedCopies
from lightning_greedysnake.offload.device_regions import DeviceRegions
from tests.helpers import TinyGPTModule, make_trainer, max_abs_diff, token_loader
from tests.integration.test_bf16 import POLICY_GRADS, greedysnake_bf16, policy_reference
from tests.integration.test_equivalence import assert_matches, reference, run

ON_HOST = {"master_weights": "host", "optimizer_states": "host", "gradients": "host"}


@pytest.fixture
def simulated(monkeypatch):
    monkeypatch.setenv(SIMULATE_ENV, "1")


class Resident(L.Callback):
    """During training: whether every held unit's parameters view its device-resident region, the bytes
    copied to the device over the run's steps, the weights' SSD traffic."""

    def __init__(self) -> None:
        self.bound: list[bool] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.manager = manager = trainer.strategy.tensor_manager
        assert isinstance(manager.copies, SimulatedCopies)
        self.copies = manager.copies
        self.to_device_at_start = manager.copies.counts.bytes_to_device
        self.to_host_at_start = manager.copies.counts.bytes_to_host
        self.tiers = {t.value for t in manager.arena.regions.unit_tiers[TensorKind.WEIGHTS]}

    def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
        weights, arena = self.manager.weights, self.manager.arena
        for unit, held in list(weights._held.items()):
            if not arena.regions.on_device(TensorKind.WEIGHTS, unit):
                self.bound.append(False)
                continue
            flat, _ = arena.device_tensor(TensorKind.WEIGHTS, unit, weights.compute_dtype)
            lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
            self.bound.append(held is None and all(lo <= p.data_ptr() < hi for p in weights.params[unit]))

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.manager.drain()
        self.to_device = self.copies.counts.bytes_to_device - self.to_device_at_start
        self.to_host = self.copies.counts.bytes_to_host - self.to_host_at_start
        self.grad_bytes = sum(lay.numel * 4 for lay in self.manager.layouts)
        self.ssd_weight_bytes = (self.manager.stats.bytes_read("weights") + self.manager.stats.bytes_written("weights"))
        self.files = [p.name for p in self.manager.files]
        self.weights_bytes = sum(self.manager.region_bytes(TensorKind.WEIGHTS, u) for u in range(self.manager.num_units))
        itemsize = torch.empty((), dtype=self.manager.compute_dtype).element_size()
        self.used_bytes = sum(self.manager.layouts[u].numel * itemsize * loads
                              for u, loads in self.manager.weights.weight_loads.items())
        """Each unit's weights (unpadded) times its acquisitions (uses) during training."""
        self.manager = None


CASES = {
    "vertical-ssd-state": ({"offload": {"weights": "device"}, "alpha": 0.25, "lag": 1}),
    "synchronous": ({"offload": {"weights": "device"}, "alpha": 0.0, "lag": 0}),
    "alpha-half-lag-2-host-state": ({"offload": {"weights": "device", **ON_HOST}, "alpha": 0.5, "lag": 2}),
    "horizontal": ({"offload": {"weights": "device"}, "schedule": "horizontal", "alpha": 0.25, "lag": 1}),
    "two-blocks-per-unit": ({"offload": {"weights": "device"}, "layers_per_unit": 2}),
    # units of 20, 16 and 20 KiB: one on the device, one in RAM, one on SSD
    "three-way-split": ({"offload": {"weights": {"device": 0.36, "host": 0.29, "ssd": 0.35}}}),
}


@pytest.mark.parametrize("settings", list(CASES.values()), ids=list(CASES))
def test_device_resident_weights_match_lightning(simulated, settings):
    seen = Resident()
    got = run(GreedySnakeStrategy(auto=False, **settings), "gpt", 3, callbacks=(seen,))
    assert_matches(got, reference("gpt", 3))
    if seen.tiers == {"device"}:
        assert seen.bound and all(seen.bound)  # computed on the resident memory, not on a per-use copy
        assert seen.ssd_weight_bytes == 0 and "weights.bin" not in seen.files
    else:
        assert seen.tiers == {"device", "host", "ssd"}


def test_each_units_new_weights_go_to_the_device_once_per_step_and_never_per_use(simulated):
    """Checkpoints on the device and the vertical order (gradients leave once, never come back): every
    byte copied to the device during training is a step's new weights, each unit's once per step
    (split or not), where weights on the host come to the device at every use (each acquisition)."""
    resident, staged = Resident(), Resident()
    got = run(GreedySnakeStrategy(auto=False, offload={"weights": "device", "activations": "device"}), "gpt", 3,
              callbacks=(resident,))
    assert resident.to_device == got["global_step"] * resident.weights_bytes
    run(GreedySnakeStrategy(auto=False, offload={"weights": "host", "activations": "device"}), "gpt", 3,
        callbacks=(staged,))
    assert staged.to_device == staged.used_bytes > 1.3 * resident.to_device


def test_a_bf16_step_writes_its_units_new_weights_without_reading_any_back(simulated):
    """Under bf16-mixed the step casts the fp32 master weights it stepped into 16-bit on the host and
    writes only those parameters' bytes: nothing of the weights comes back D2H (a read would wait for
    the GPU's queue of compute), only each unit's gradient, once per window."""
    seen = Resident()
    got = run(GreedySnakeStrategy(auto=False, offload={"weights": "device", "activations": "device"}), "gpt", 3,
              callbacks=(seen,), trainer_kwargs={"precision": "bf16-mixed"})
    assert seen.to_host == got["global_step"] * seen.grad_bytes
    assert 0 < seen.to_device <= got["global_step"] * seen.weights_bytes


@pytest.mark.parametrize("placement", ["ssd", "host"])
def test_bf16_mixed_with_resident_16_bit_weights_matches_the_policy(simulated, placement):
    ref = policy_reference()
    offload = {"weights": "device", **(ON_HOST if placement == "host" else {})}
    got, probe = greedysnake_bf16(GreedySnakeStrategy(auto=False, offload=offload))
    assert probe.compute_dtype is torch.bfloat16
    assert "weights" not in probe.ssd_bytes
    assert max_abs_diff(got, ref) <= 1e-5
    windows = probe.windows()
    assert len(windows) == len(POLICY_GRADS)
    for step, (g, r) in enumerate(zip(windows, POLICY_GRADS, strict=True)):
        assert max_abs_diff(g, r) <= (1e-6 if step == 0 else 1e-5), step


def test_a_resume_continues_bit_for_bit(simulated, tmp_path: Path):
    def fit(epochs: int, ckpt: Path | None = None, callbacks: tuple = ()) -> dict[str, torch.Tensor]:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(n_layer=3, lr=3e-3)
        trainer = make_trainer(GreedySnakeStrategy(auto=False, offload={"weights": "device"}), 2, max_epochs=epochs,
                               callbacks=list(callbacks), enable_checkpointing=bool(callbacks))
        trainer.fit(module, token_loader(8), ckpt_path=ckpt)
        return {n: p.detach().clone() for n, p in module.named_parameters()}

    whole = fit(2)
    fit(1, callbacks=(ModelCheckpoint(dirpath=tmp_path, save_last=True),))
    resumed = fit(2, ckpt=tmp_path / "last.ckpt")
    assert max_abs_diff(resumed, whole) == 0


class MinimumAfterThePlan(L.Callback):
    def on_train_end(self, trainer: Any, module: Any) -> None:
        from lightning_greedysnake.offload.staging import staging_budget_of

        manager = trainer.strategy.tensor_manager
        arena = manager.arena
        self.lag = manager.stepper.lane.lag
        self.minimum = arena.budget.minimum_bytes - arena.budget._activation_reserve
        self.expected = staging_budget_of(manager.state, manager.config, manager.stepper.lane.lag, device_tier=True).minimum_bytes


def test_the_first_step_plans_staging_minimum_counts_the_steps_copy_of_resident_weights(simulated):
    """The first-step plan re-sizes the staging (lag, budget): the minimum must still count the pool
    buffer each step stages its resident units' new weights in, as at construction."""
    seen = MinimumAfterThePlan()
    placed = {"weights": "device", "master_weights": "ssd", "optimizer_states": "ssd", "gradients": "ssd",
              "activations": "host"}
    got = run(GreedySnakeStrategy(layers_per_unit=1, offload=placed), "gpt", 3, callbacks=(seen,))
    assert_matches(got, reference("gpt", 3))
    assert seen.minimum == seen.expected


def test_device_memory_is_freed_after_fit(simulated):
    seen = Resident()
    run(GreedySnakeStrategy(auto=False, offload={"weights": "device", "activations": "device"}), "gpt", 3,
        callbacks=(seen,))
    copies, seen.copies = seen.copies, None
    gc.collect()
    assert copies.memory_allocated() == 0  # the resident weights went with the tensor manager
    assert not [t for t in threading.enumerate() if t.name.startswith("greedysnake-sim")]


def test_a_compute_stream_that_does_not_wait_for_the_steps_copy_gives_a_wrong_result(simulated, monkeypatch):
    """Forget the step's H2D copy at acquisition (the hand-over to the compute stream): the next forward
    then reads weights still poisoned (all-ones bytes: NaN) or stale, and the comparison fails. The
    copies are made slow enough that unit 0's, the window's last step, is always still in flight."""
    monkeypatch.setattr(DeviceRegions, "last_write", lambda self, unit: None)
    init = SimulatedCopies.__init__
    monkeypatch.setattr(SimulatedCopies, "__init__", lambda self, max_delay_s=0.05, seed=None: init(self, 0.05, seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the non-finite losses it produces are reported)
        try:
            got = run(GreedySnakeStrategy(auto=False, offload={"weights": "device"}), "gpt", 3)
        except RuntimeError as err:  # or autograd sees the late copy change memory it saved for backward
            assert "modified by an inplace operation" in str(err)
            return
    with pytest.raises(AssertionError):
        assert_matches(got, reference("gpt", 3))


def test_kept_graphs_with_saved_tensors_on_ssd_on_the_device(simulated):
    """recompute=False, saved activations on SSD, computing on the (simulated) device: each kept graph's saved
    tensors leave device memory as one blob (D2H, then written) and come back for the unit's backward (read,
    H2D one op ahead): exact against Lightning and bit for bit the graphs held in device memory. A copy not
    waited for reads NaN here."""
    def kept(activations: str) -> dict[str, Any]:
        strategy = GreedySnakeStrategy(auto=False, recompute=False,
                                       offload={**ON_HOST, "weights": "device", "activations": activations})
        got = run(strategy, "gpt", 3)
        got["written"] = strategy.io_stats().get("ssd/activations/bytes_written", 0)
        return got

    on_ssd, held = kept("ssd"), kept("device")
    assert_matches(on_ssd, reference("gpt", 3))
    assert max_abs_diff(on_ssd["params"], held["params"]) == 0
    assert on_ssd["written"] > 0 and held["written"] == 0
