"""Fractional placement: a kind split between host memory and SSD by whole units (``{host: f, ssd: g}``)
trains bit-identically to the same kind wholly in RAM, and only its SSD units touch the disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig, TensorKind, Tier
from lightning_greedysnake.config import REGION_KINDS
from lightning_greedysnake.offload.regions import FILE_NAMES
from tests.helpers import TinyGPTModule, UnitGradients, make_trainer, token_loader

K = 3
STEPS = 3


class Seen(UnitGradients):
    """Every window's gradients, the unit placement and the SSD traffic per kind (read at the end)."""

    def on_train_end(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        manager.drain()
        self.tiers = {kind.value: list(manager.arena.regions.unit_tiers[kind]) for kind in REGION_KINDS}
        self.region_bytes = {kind.value: [manager.region_bytes(kind, u) for u in range(manager.num_units)]
                             for kind in REGION_KINDS}
        self.stats = manager.stats.copy()
        self.file_bytes = {str(f): f.stat().st_size for f in manager.files if f.exists()}


def fit(offload: Any, schedule: str = "vertical", precision: str = "32-true") -> tuple[dict[str, torch.Tensor], Seen]:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=4, lr=3e-3)
    seen = Seen()
    trainer = make_trainer(GreedySnakeStrategy(auto=False, schedule=schedule, offload=offload, alpha=0.25, lag=1), K,
                           callbacks=[seen], max_epochs=1, precision=precision)
    trainer.fit(module, token_loader(K * STEPS))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, seen


SPLITS = {  # (test_equivalence compares a split of weights, state and gradients with Lightning's own step)
    "every-kind": {kind: {"host": 0.4, "ssd": 0.6}
                   for kind in ("weights", "master_weights", "optimizer_states", "gradients")},
    "weights-mostly-host": {"weights": {"host": 0.8, "ssd": 0.2}, "activations": "ssd"},
}


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_a_split_placement_is_bit_identical_to_everything_in_ram(split, schedule):
    resident, ref = fit(OffloadConfig.everywhere("host"), schedule)
    got, seen = fit(SPLITS[split], schedule)
    for name, value in resident.items():
        assert torch.equal(got[name], value), name
    for window, ref_window in zip(seen.windows(), ref.windows(), strict=True):
        for name, grad in ref_window.items():
            assert torch.equal(window[name], grad), name
    for kind, tiers in seen.tiers.items():
        if isinstance(SPLITS[split].get(kind), dict) and sum(seen.region_bytes[kind]):  # (no fp32 master in 32-true)
            assert tiers[0] is Tier.HOST and tiers[-1] is Tier.SSD, (kind, tiers)  # really split


def test_only_the_ssd_units_of_a_split_kind_touch_the_disk():
    _, whole = fit({"optimizer_states": "ssd"})
    _, split = fit({"optimizer_states": {"host": 0.5, "ssd": 0.5}})
    tiers = split.tiers["optimizer_states"]
    sizes = split.region_bytes["optimizer_states"]
    on_ssd = sum(size for size, t in zip(sizes, tiers, strict=True) if t is Tier.SSD)
    assert 0 < on_ssd <= sum(sizes) // 2 + max(sizes)
    # the file holds the SSD units' regions only, and the traffic shrinks with them
    assert [n for f, n in split.file_bytes.items() if Path(f).name == FILE_NAMES[TensorKind.OPTIMIZER_STATES]] == [on_ssd]
    read_whole = whole.stats.bytes_read("optimizer_states")
    read_split = split.stats.bytes_read("optimizer_states")
    assert 0 < read_split < read_whole
    assert read_split * sum(sizes) == read_whole * on_ssd  # each step reads exactly its SSD units


def test_a_split_of_every_kind_is_bit_identical_in_bf16_mixed():
    resident, ref = fit(OffloadConfig.everywhere("host"), precision="bf16-mixed")
    got, seen = fit(SPLITS["every-kind"], precision="bf16-mixed")
    assert all(torch.equal(got[name], value) for name, value in resident.items())
    assert seen.tiers["master_weights"][0] is Tier.HOST and seen.tiers["master_weights"][-1] is Tier.SSD
    for window, ref_window in zip(seen.windows(), ref.windows(), strict=True):
        assert all(torch.equal(window[name], grad) for name, grad in ref_window.items())


def test_several_offload_paths_stripe_every_kind_and_each_carries_traffic(tmp_path):
    """Two offload directories on two filesystems (the disk and a tmpfs): each kind's SSD units are
    striped over both, both carry reads and writes, the result is bit-identical to one directory, and
    each directory is locked during the run and left empty after it."""
    from tests.helpers import mounted

    disk = tmp_path / "disk"
    disk.mkdir()
    with mounted(tmp_path / "ram", size="64M") as ram:
        one, _ = fit({**OffloadConfig.everywhere("ssd").__dict__, "path": str(disk / "one")})
        seen_locks: list[bool] = []

        class Locks(L.Callback):
            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                seen_locks.append(all((d / ".greedysnake.lock").exists()
                                      for d in trainer.strategy.tensor_manager.offload_dirs))

        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(n_layer=4, lr=3e-3)
        seen = Seen()
        paths = [str(disk / "a"), str(ram / "b")]
        strategy = GreedySnakeStrategy(auto=False, offload={**OffloadConfig.everywhere("ssd").__dict__, "path": paths},
                                       alpha=0.25, lag=1)
        make_trainer(strategy, K, callbacks=[seen, Locks()], max_epochs=1).fit(module, token_loader(K * STEPS))
        got = {n: p.detach().clone() for n, p in module.named_parameters()}
        traffic = seen.stats.by_directory()
        assert set(traffic) == set(paths)
        flat = seen.stats.flat()
        assert all(flat[f"ssd_path/{p}/bytes_read"] == traffic[p][0] for p in paths)
        assert all(read > 0 and written > 0 for read, written in traffic.values()), traffic
        for kind in ("weights", "optimizer_states", "activations"):
            assert {Path(f).parent.name for f in seen.file_bytes if Path(f).name.startswith(kind)} <= {"a", "b"}
        assert sum(1 for f in seen.file_bytes if Path(f).name == "weights.bin") == 2  # one file per directory
        assert seen_locks and all(seen_locks)
        assert all(torch.equal(got[n], v) for n, v in one.items())
        assert not any((Path(p)).exists() for p in paths)  # created by the run, removed empty
