"""The planner places by default (``auto=True``): the kinds left unset go to RAM or SSD within the host
budget, what the user set is kept, the math is bit-identical to everything in RAM, and the process's
peak memory stays within the budget."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GPT, GPTConfig, GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig, Split, Tier
from lightning_greedysnake.offload.device import simulate_device_enabled
from lightning_greedysnake.config import REGION_KINDS
from lightning_greedysnake.strategy.after_fit import StateNotReturned
from lightning_greedysnake.strategy.planning.placement import ACTIVATION_SHARE
from tests.helpers import TinyGPTModule, UnitGradients, make_trainer, token_loader

REPO = Path(__file__).resolve().parents[2]
K = 3
STAGING = 1 << 20
LPU = 1


def budget_for(room: int, staging: int = STAGING) -> int:
    """The host budget that leaves ``room`` bytes for the kinds after ``staging`` and the checkpoints' share."""
    return (staging + room) * ACTIVATION_SHARE // (ACTIVATION_SHARE - 1) + ACTIVATION_SHARE


class Seen(UnitGradients):
    def on_train_end(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        manager.drain()
        self.tiers = {kind.value: list(manager.arena.regions.unit_tiers[kind]) for kind in REGION_KINDS}
        self.regions_in_ram = manager.arena.regions.host_bytes()
        self.host_bytes = self.regions_in_ram + manager.pool.budget_bytes
        self.read = sum(v for k, v in manager.stats.flat().items() if k.startswith("ssd/") and k.endswith("bytes_read"))


def fit(strategy: GreedySnakeStrategy, precision: str = "32-true") -> tuple[dict[str, torch.Tensor], Seen]:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=4, lr=3e-3)
    seen = Seen()
    make_trainer(strategy, K, callbacks=[seen], max_epochs=2, precision=precision).fit(module, token_loader(3 * K))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, seen


@pytest.mark.parametrize("precision, schedule", [("32-true", "vertical"), ("bf16-mixed", "horizontal")])
def test_the_default_plan_splits_a_small_budget_and_trains_bit_identically(precision, schedule, caplog):
    budget = budget_for(room=96 << 10)
    settings = {"schedule": schedule, "auto_host_budget_bytes": budget, "offload": {"buffer_budget_bytes": STAGING}}
    resident, ref = fit(GreedySnakeStrategy(auto=False, alpha=0.25, lag=2, schedule=schedule,
                                            offload=OffloadConfig.everywhere("host")), precision)
    strategy = GreedySnakeStrategy(**settings)
    with caplog.at_level("INFO"):
        got, seen = fit(strategy, precision)
    assert "greedysnake placement plan" in caplog.text and "SSD bytes per step" in caplog.text
    plan = strategy.placement_plan
    assert plan is not None and plan.host_bytes <= budget
    assert seen.host_bytes <= budget - budget // ACTIVATION_SHARE  # what the tensor manager really holds
    on_host = {kind: sum(t is Tier.HOST for t in tiers) for kind, tiers in seen.tiers.items()}
    assert on_host == {kind: p.host_units for kind, p in plan.kinds.items()}
    assert seen.regions_in_ram == sum(p.host_bytes for p in plan.kinds.values())  # what the plan counted
    assert 0 < on_host["weights"] and seen.read > 0  # some of it in RAM, some on SSD
    assert any(0 < n < len(seen.tiers[k]) for k, n in on_host.items() if k != "master_weights") or (
        0 < sum(on_host.values()) < sum(len(t) for t in seen.tiers.values()))
    for name, value in resident.items():
        assert torch.equal(got[name], value), name
    for window, ref_window in zip(seen.windows(), ref.windows(), strict=True):
        for name, grad in ref_window.items():
            assert torch.equal(window[name], grad), name


def test_the_users_placements_are_kept_and_the_rest_planned():
    # (one layer a unit, as a user would fix it: the unit size is chosen by measuring the disk, and with larger
    # units the first alone may outweigh half the weights, which leaves none of them in RAM)
    strategy = GreedySnakeStrategy(auto_host_budget_bytes=1 << 30, layers_per_unit=LPU,
                                   offload={"optimizer_states": "ssd", "weights": {"host": 0.5, "ssd": 0.5}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, seen = fit(strategy)
    assert not [w for w in caught if "puts no unit" in str(w.message)]
    assert strategy.config.offload.optimizer_states is Tier.SSD
    assert strategy.config.offload.weights == Split(0.5, 0.5)
    assert set(seen.tiers["optimizer_states"]) == {Tier.SSD}
    assert set(seen.tiers["weights"]) == {Tier.HOST, Tier.SSD}
    assert set(seen.tiers["gradients"]) == {Tier.HOST}  # planned: the budget holds it
    plan = strategy.placement_plan
    assert not plan.kinds["optimizer_states"].planned and plan.kinds["gradients"].planned


def test_a_split_share_that_no_whole_unit_fits_is_said():
    """Units are placed whole: with four layers a unit the first outweighs half the weights, so the user's
    ``{host: 0.5, ssd: 0.5}`` keeps none in RAM, and the run says so with the fix."""
    strategy = GreedySnakeStrategy(auto_host_budget_bytes=1 << 30, layers_per_unit=4,
                                   offload={"optimizer_states": "ssd", "weights": {"host": 0.5, "ssd": 0.5}})
    with pytest.warns(UserWarning, match=r"offload\.weights=\{host: 0\.5, ssd: 0\.5\} puts no unit on host.*"
                                         r"more than its 50\.0% share \(units of 4 layer\(s\)\)\. Fix: a host "
                                         r"share of at least"):
        _, seen = fit(strategy)
    assert set(seen.tiers["weights"]) == {Tier.SSD}


def test_a_budget_with_room_for_the_staging_only_keeps_everything_on_ssd(caplog):
    strategy = GreedySnakeStrategy(auto_host_budget_bytes=STAGING, offload={"buffer_budget_bytes": STAGING})
    with caplog.at_level("INFO"):
        _, seen = fit(strategy)
    assert all(t is Tier.SSD for kind in ("weights", "optimizer_states", "gradients") for t in seen.tiers[kind])
    # nor is there room for the first-step plan's staging: the settings in effect stay, and it says why
    assert strategy.plan_choice is None and "keeping the settings in effect" in caplog.text
    assert "no configuration fits a host memory budget" in caplog.text


@pytest.mark.parametrize("settings, words", [
    ({"auto_host_budget_bytes": STAGING - 1, "offload": {"buffer_budget_bytes": STAGING}},
     [f"auto_host_budget_bytes={STAGING - 1:,}", f"offload.buffer_budget_bytes={STAGING:,}", "Fix"]),
    ({"auto_host_budget_bytes": 1 << 20}, ["auto_host_budget_bytes=1,048,576", "staging", "lag 0", "Fix"]),
])
def test_a_budget_below_the_staging_is_refused_before_any_work(settings, words, tmp_path):
    with pytest.raises(ValueError) as info:
        fit(GreedySnakeStrategy(offload_dir=tmp_path / "off", **settings))
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    if "offload" not in settings:  # one block per unit already, lag 0: only the read-ahead can still go
        assert "layers_per_unit" not in str(info.value) and "lag=0" not in str(info.value), str(info.value)
        assert "or set offload.prefetch_units=0 (now 1; no read-ahead)" in str(info.value), str(info.value)
    assert not (tmp_path / "off").exists()  # nothing was created


CHILD = textwrap.dedent("""
    import json, sys
    import lightning as L, torch
    import torch.nn.functional as F
    from lightning_greedysnake import GPT, GPTConfig, GreedySnakeStrategy

    budget, root, placement = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(2)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(GPTConfig(n_layer=8, n_head=12, n_embd=768, vocab_size=256, block_size=16))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.model(x).view(-1, 256), y.view(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    offload = {"return_weights": False}  # (the module does not get 226 MB of weights back at the end)
    if placement == "host":
        offload.update({k: "host" for k in ("weights", "master_weights", "optimizer_states", "gradients")})
    strategy = GreedySnakeStrategy(auto_host_budget_bytes=budget, offload=offload)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=root)
    with trainer.init_module(empty_init=True):  # a model larger than RAM never exists whole
        module = Module()
    data = torch.randint(0, 256, (8, 17))
    loader = torch.utils.data.DataLoader(list(zip(data[:, :-1], data[:, 1:])), batch_size=1)

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts over from here
    before = status("VmRSS:")
    trainer.fit(module, loader)
    plan = strategy.placement_plan
    print(json.dumps({"before": before, "peak": status("VmHWM:"), "steps": trainer.global_step,
                      "host_units": {k: v.host_units for k, v in plan.kinds.items()} if plan else None}))
""")


def _peak(tmp_path: Path, budget: int, placement: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(budget), str(tmp_path / placement), placement],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_peak_memory_stays_within_a_small_host_budget(tmp_path):
    """A 57M-parameter GPT (905 MB of fp32 weights, gradients and Adam state) under a 384 MiB budget:
    the planner keeps what fits in RAM and the process's peak grows by no more than the budget, plus
    what Lightning and autograd take beside the tensor manager (measured in the same run: the growth
    when the whole state is in RAM is far beyond it)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    if simulate_device_enabled():
        pytest.skip("the simulated device's memory is host memory too")
    budget = 384 << 20
    planned = _peak(tmp_path, budget, "planned")
    assert planned["steps"] == 2
    host_units = planned["host_units"]
    assert 0 < host_units["weights"] and host_units["optimizer_states"] < 9  # a split: some in RAM, not all
    growth = planned["peak"] - planned["before"]
    overhead = 128 << 20  # Lightning, autograd and the allocator beside the tensor manager
    assert growth <= budget + overhead, (growth >> 20, budget >> 20)
    everything = _peak(tmp_path, budget, "host")
    assert everything["peak"] - everything["before"] > budget + overhead  # the test would see a planner ignoring it


class CheckpointsSeen(UnitGradients):
    def on_train_end(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        manager.drain()
        self.tier = manager.activations.tier
        self.written = manager.stats.bytes_written("activations")
        self.unit_input_bytes = manager.activations.unit_input_bytes
        self.num_units = manager.num_units
        self.schedule = trainer.strategy.engine.config.schedule


def fit_wide_batches(strategy: GreedySnakeStrategy) -> tuple[dict[str, torch.Tensor], CheckpointsSeen]:
    """Micro-batches of 64 sequences: each unit input (a checkpoint) is 32 KiB, a window's 15 of them
    480 KiB."""
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=4, lr=3e-3)
    seen = CheckpointsSeen()
    make_trainer(strategy, K, callbacks=[seen], max_epochs=1).fit(module, token_loader(2 * K, batch_size=64))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, seen


@pytest.mark.parametrize("share_kib, tier", [(256, Tier.SSD), (1024, Tier.HOST)])
def test_checkpoints_left_unset_go_to_ssd_when_a_window_of_them_exceeds_their_share(share_kib, tier, caplog):
    """The first save knows the checkpoints' size: over their share of the host budget they go to SSD
    (where the run has an offload directory), within it they stay in RAM; the math is unchanged."""
    budget = share_kib * 1024 * ACTIVATION_SHARE
    resident, ref = fit_wide_batches(GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("host")))
    settings = {"auto_host_budget_bytes": budget, "layers_per_unit": 1,
                "offload": {"weights": "ssd", "buffer_budget_bytes": STAGING}}
    with caplog.at_level("INFO"):
        got, seen = fit_wide_batches(GreedySnakeStrategy(**settings))
    window = K * (seen.num_units - 1) * seen.unit_input_bytes  # (every unit's input but the first's)
    assert (window > share_kib * 1024) == (tier is Tier.SSD)
    assert seen.tier is tier
    assert (seen.written > 0) == (tier is Tier.SSD)
    said = "saved activations on SSD" if tier is Tier.SSD else "saved activations in host memory"
    assert said in caplog.text
    for name, value in resident.items():
        assert torch.equal(got[name], value), name
    for window_grads, ref_window in zip(seen.windows(), ref.windows(), strict=True):
        for name, grad in ref_window.items():
            assert torch.equal(window_grads[name], grad), name
    # what the user sets is kept: checkpoints in RAM even over their share
    _, kept = fit_wide_batches(GreedySnakeStrategy(**{**settings, "offload": {**settings["offload"],
                                                                                  "activations": "host"}}))
    assert kept.tier is Tier.HOST and kept.written == 0


def test_a_path_given_with_nothing_else_on_ssd_takes_the_checkpoints_that_exceed_their_share(tmp_path, caplog):
    """Every kind planned in RAM, an offload path given: the report's promise holds, the checkpoints go
    there at the first save when a window's exceed their share of the host budget (the math unchanged)."""
    budget = 256 * 1024 * ACTIVATION_SHARE
    with caplog.at_level("INFO"):
        got, seen = fit_wide_batches(GreedySnakeStrategy(auto_host_budget_bytes=budget, layers_per_unit=1,
                                                         offload={"path": str(tmp_path / "off"),
                                                                  "buffer_budget_bytes": STAGING}))
    assert "nothing placed here" in caplog.text and "saved activations on SSD" in caplog.text, caplog.text
    assert seen.tier is Tier.SSD and seen.written > 0
    # every kind in RAM: horizontal on a CPU run, vertical on a device (CI's simulated one); the reference
    # runs in the same order (the two orders sum a window's gradients in different orders)
    resident, _ = fit_wide_batches(GreedySnakeStrategy(auto=False, schedule=seen.schedule,
                                                       offload=OffloadConfig.everywhere("host")))
    for name, value in resident.items():
        assert torch.equal(got[name], value), name


class EightMillion(TinyGPTModule):
    """A model larger than the smallest host budget its staging allows (48 MiB of fp32 parameters)."""

    def __init__(self) -> None:
        super().__init__(lr=1e-3)
        self.model = GPT(GPTConfig(n_layer=16, n_head=2, n_embd=256, vocab_size=32, block_size=8))


@pytest.mark.parametrize("meta", [False, True], ids=["eager-return-weights", "meta-no-return"])
def test_the_report_says_what_the_host_budget_covers_and_the_fixes_when_the_model_exceeds_it(tmp_path, caplog, meta):
    """The budget bounds the tensor manager's RAM, not the process: the model as built comes on top, and
    the report says so with the expected peak; where it exceeds the budget, a warning names meta init.
    The end of fit is planned within the budget: weights larger than it do not come back, said at setup
    (with the fixes) and on first use after fit."""
    budget = 36 << 20
    strategy = GreedySnakeStrategy(auto_host_budget_bytes=budget, layers_per_unit=1, lag=0,
                                   offload={"prefetch_units": 0, "return_weights": not meta})
    trainer = make_trainer(strategy, 2, max_steps=1, default_root_dir=tmp_path)
    with trainer.init_module(empty_init=meta):
        module = EightMillion()
    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, token_loader(2))
    report = next(line for line in caplog.text.splitlines() if "greedysnake host memory:" in line)
    assert "the host budget (36.0 MiB) covers what the tensor manager keeps in RAM" in report, report
    said = [str(w.message) for w in caught if "exceed the host budget" in str(w.message)]
    # the peak: the process's RSS at setup (the model as built in it) and what greedysnake holds, which here,
    # nothing coming back at the end, is its regions and staging: within the budget
    size = r"([0-9.]+ [KMG]?i?B)"
    found = re.search(rf"peak near {size}: its RSS at setup \({size}: [^)]*\) and what greedysnake holds \({size}\)",
                      report)
    assert found, report
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    peak = [float(x.split()[0]) * units[x.split()[1]] / 2**20 for x in found.groups()]  # (MiB)
    # (the peak and the RSS carry two decimals, so they add up in GiB too: a whole test session's RSS passes 1 GiB)
    assert peak[2] <= 36 and abs(peak[0] - peak[1] - peak[2]) <= 0.01 * peak[0] + 0.2, report
    if meta:
        assert "the model as built takes none (the meta device)" in report, report
        assert "Nothing is copied back at the end (offload.return_weights=False)" in report, report
        assert not said, said
    else:
        assert "the model as you built it, 48.3 MiB of parameters" in report, report
        assert "Neither the trained weights (48.3 MiB) nor the optimizer's state come back at the end of fit" \
            in report and "ModelCheckpoint" in report, report
        assert peak[1] >= 48.3, report  # (the model as built is in the RSS)
        assert len(said) == 1 and "init_module(empty_init=True)" in said[0], said
        not_back = [str(w.message) for w in caught if "come back at the end of fit" in str(w.message)]
        assert len(not_back) == 1 and "raise auto_host_budget_bytes" in not_back[0], not_back
        with pytest.raises(StateNotReturned, match=r"did not give EightMillion.model's trained weights back"):
            module.model(next(iter(token_loader(1)))[0])
