"""``auto=True`` after the first step: when the measured compute says larger units are faster and the
run is long enough to pay for the copy, the state moves into them (a second tensor manager beside the
first, every unit's weights and optimizer state copied bit for bit) and training goes on exactly;
otherwise the report says why the units stay.

Stand-ins, named where used: the setup's unit-size choice is pinned to one block (so there is a larger
size to find), and the first-step plan's thresholds are lowered so that a tiny model's larger units
count as faster and its short run as long enough. The runs, their files, copies and threads are real."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.strategy import auto_plan, relayout, unit_plan
from tests.helpers import TinyGPTModule, bf16_policy_run, make_trainer, max_abs_diff, mounted, token_loader
from tests.integration.test_equivalence import GradRecorder

BLOCKS = 8
K = 2
ON_SSD = {"weights": "ssd", "optimizer_states": "ssd", "gradients": "ssd", "master_weights": "ssd"}


class Files(GradRecorder):
    """At the start and after every optimizer step (and its plan): the tensor manager's unit count and
    the offload files that exist."""

    def __init__(self) -> None:
        super().__init__()
        self.units: list[int] = []
        self.names: list[set[str]] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        super().on_train_start(trainer, module)
        self._record(trainer.strategy.tensor_manager)

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if (trainer.fit_loop.epoch_loop.batch_idx + 1) % K == 0:
            self._record(trainer.strategy.tensor_manager)

    def _record(self, manager: Any) -> None:
        self.units.append(manager.num_units)
        self.names.append({p.name for d in manager.offload_dirs for p in d.iterdir()})


def one_block_at_setup(monkeypatch: pytest.MonkeyPatch, *, pays: bool = True) -> None:
    """Setup chooses one block per unit; after the first step every larger size counts as faster, and
    (``pays``) the run as long enough for the copy."""
    monkeypatch.setattr(unit_plan, "plan_layers_per_unit", lambda *a, **kw: 1)
    monkeypatch.setattr(auto_plan, "LARGER_UNITS_GAIN", -10.0)
    if pays:
        monkeypatch.setattr(relayout, "PAYBACK", -math.inf)


def fit(strategy: Any, precision: str = "32-true", offload_dir: Path | None = None) -> tuple[dict[str, torch.Tensor], Files]:
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=BLOCKS, lr=3e-3)
    seen = Files()
    kwargs = {"default_root_dir": str(offload_dir)} if offload_dir is not None else {}
    make_trainer(strategy, K, callbacks=[seen], max_epochs=2, precision=precision, **kwargs).fit(
        module, token_loader(3 * K))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, seen


def reference(precision: str) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The reference of the same precision policy: Lightning's own strategy under 32-true, the
    plain-PyTorch bf16-mixed loop (fp32 master weights and gradient sums) under bf16-mixed."""
    L.seed_everything(0, verbose=False)
    module = TinyGPTModule(n_layer=BLOCKS, lr=3e-3)
    if precision == "32-true":
        grads = GradRecorder()
        make_trainer("auto", K, callbacks=[grads], max_epochs=2).fit(module, token_loader(3 * K))
        windows = grads.grads
    else:
        windows = bf16_policy_run(module, list(token_loader(3 * K)), K, epochs=2)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, windows


def assert_like_reference(got: dict[str, torch.Tensor], seen: Files, precision: str) -> None:
    weights, windows = reference(precision)
    assert len(seen.grads) == len(windows) == 6
    for step, (g, r) in enumerate(zip(seen.grads, windows, strict=True)):
        assert max_abs_diff(g, r) <= 1e-5, step
    assert max_abs_diff(got, weights) <= 1e-5


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_larger_units_take_the_state_over_bit_for_bit_and_train_exactly(precision, monkeypatch, caplog):
    one_block_at_setup(monkeypatch)
    copies: list[tuple[dict, dict]] = []
    real_copy = relayout.copy_state

    def state(manager: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        weights, moments = {}, {}
        for u in range(manager.num_units):
            names = [slot.name for slot in manager.layouts[u].params]
            weights.update(zip(names, manager.unit_master_weights(u)))
            moments.update({names[i]: e for i, e in manager.unit_optimizer_state(u).items()})
        return weights, moments

    def checked_copy(old: Any, new: Any) -> None:  # the real copy, with both sides read out around it
        before = state(old)
        real_copy(old, new)
        copies.append((before, state(new)))

    monkeypatch.setattr(relayout, "copy_state", checked_copy)
    strategy = GreedySnakeStrategy(offload=ON_SSD)
    with caplog.at_level("INFO"):
        got, seen = fit(strategy, precision)
    lpu = strategy.config.layers_per_unit
    assert "moving the state into them now" in caplog.text and "state re-laid out" in caplog.text
    assert lpu > 1 and seen.units == [BLOCKS] * auto_plan.PLAN_STEP + [-(-BLOCKS // lpu)] * (7 - auto_plan.PLAN_STEP)  # one block per unit, then lpu
    assert not any(name.endswith(relayout.ASIDE) for names in seen.names for name in names)
    assert seen.names[0] == seen.names[-1]  # the new files where the old ones were, under the same names
    ((old_weights, old_state), (new_weights, new_state)), = copies
    assert old_weights.keys() == new_weights.keys() and old_state.keys() == new_state.keys()
    for name, value in old_weights.items():
        assert torch.equal(new_weights[name], value), name
    for name, entry in old_state.items():
        assert entry.keys() == new_state[name].keys(), name
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(new_state[name][key]), torch.as_tensor(value)), (name, key)
    assert_like_reference(got, seen, precision)


def test_a_run_too_short_to_pay_for_the_copy_keeps_its_units(monkeypatch, caplog):
    one_block_at_setup(monkeypatch, pays=False)  # larger units count as faster, by nothing: never worth a copy
    strategy = GreedySnakeStrategy(offload=ON_SSD)
    with caplog.at_level("INFO"):
        got, seen = fit(strategy)
    assert "the state stays in the units it has" in caplog.text and "steps left would save" in caplog.text
    assert "re-laid out" not in caplog.text
    assert strategy.config.layers_per_unit == 1 and seen.units == [BLOCKS] * 7
    assert_like_reference(got, seen, "32-true")


def test_compute_weights_resident_on_the_device_keep_their_units(monkeypatch, caplog):
    """On the simulated device with the weights resident there: a second copy of them would be needed on
    the device while the state moves, so the units stay (and the report says why), exactly."""
    from lightning_greedysnake.offload.device import SIMULATE_ENV

    monkeypatch.setenv(SIMULATE_ENV, "1")
    one_block_at_setup(monkeypatch)
    strategy = GreedySnakeStrategy(offload={**ON_SSD, "weights": "device"})
    with caplog.at_level("INFO"):
        got, seen = fit(strategy)
    assert "would need a second copy there" in caplog.text and "re-laid out" not in caplog.text
    assert strategy.config.layers_per_unit == 1 and seen.units == [BLOCKS] * 7
    assert_like_reference(got, seen, "32-true")


def test_a_disk_without_room_for_the_second_copy_keeps_the_units(monkeypatch, caplog, tmp_path):
    one_block_at_setup(monkeypatch)
    # 544 KiB of files at one block per unit, 480 KiB at two: one copy fits in 1000 KiB, two do not
    with mounted(tmp_path / "small", size="1000K") as mount:
        strategy = GreedySnakeStrategy(offload=ON_SSD, offload_dir=str(mount / "gs"))
        with caplog.at_level("INFO"):
            got, seen = fit(strategy)
    assert "the state stays in the units it has" in caplog.text and "bytes free" in caplog.text
    assert strategy.config.layers_per_unit == 1 and seen.units == [BLOCKS] * 7
    assert_like_reference(got, seen, "32-true")


def test_an_io_error_while_copying_leaves_the_old_units_in_charge(monkeypatch, caplog):
    one_block_at_setup(monkeypatch)
    real_copy = relayout.copy_state

    def failing(old: Any, new: Any) -> None:
        real_copy(old, new)  # every unit written to the new files, then the disk fails
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(relayout, "copy_state", failing)
    strategy = GreedySnakeStrategy(offload=ON_SSD)
    with caplog.at_level("INFO"):
        got, seen = fit(strategy)
    assert "copying the state failed" in caplog.text and "the state stays in the units it has" in caplog.text
    assert strategy.config.layers_per_unit == 1 and seen.units == [BLOCKS] * 7
    assert seen.names[0] == seen.names[-1] and not any(n.endswith(relayout.ASIDE) for n in seen.names[-1])
    assert_like_reference(got, seen, "32-true")


def test_a_unit_size_you_set_is_kept(monkeypatch, caplog):
    one_block_at_setup(monkeypatch)
    strategy = GreedySnakeStrategy(offload=ON_SSD, layers_per_unit=1)
    with caplog.at_level("INFO"):
        _, seen = fit(strategy)
    assert "larger units" not in caplog.text and seen.units == [BLOCKS] * 7


def test_in_ram_the_units_move_too_and_train_exactly(monkeypatch, caplog):
    one_block_at_setup(monkeypatch)
    strategy = GreedySnakeStrategy(offload={kind: "host" for kind in ON_SSD})  # no SSD: the copy costs nothing
    with caplog.at_level("INFO"):
        got, seen = fit(strategy)
    lpu = strategy.config.layers_per_unit
    assert "state re-laid out" in caplog.text and lpu > 1
    assert seen.units == [BLOCKS] * auto_plan.PLAN_STEP + [-(-BLOCKS // lpu)] * (7 - auto_plan.PLAN_STEP)
    assert_like_reference(got, seen, "32-true")


def test_a_placement_refused_for_the_larger_units_keeps_the_units(monkeypatch, caplog):
    one_block_at_setup(monkeypatch)

    def over_budget(*args: Any, **kwargs: Any) -> Any:  # stand-in: the setup placement's own refusal
        raise ValueError("the staging the tensor manager needs at lag 1 exceeds the host budget")

    monkeypatch.setattr(relayout, "plan_at_setup", over_budget)
    strategy = GreedySnakeStrategy(offload=ON_SSD)
    with caplog.at_level("INFO"):
        got, seen = fit(strategy)
    assert "the state stays in the units it has (the staging" in caplog.text
    assert strategy.config.layers_per_unit == 1 and seen.units == [BLOCKS] * 7
    assert_like_reference(got, seen, "32-true")


def test_a_trace_across_the_re_layout_keeps_the_steps_before_it(monkeypatch, tmp_path):
    """The steps up to the plan's run on the old units, the next ones on the new: the trace holds both."""
    import json

    one_block_at_setup(monkeypatch)
    trace = tmp_path / "trace.json"
    strategy = GreedySnakeStrategy(offload=ON_SSD, trace_steps=auto_plan.PLAN_STEP + 2,
                                   trace_path=str(trace))
    fit(strategy)
    units = -(-BLOCKS // strategy.config.layers_per_unit)
    assert units < BLOCKS
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    compute = [e["name"] for e in events if e["ph"] == "X" and tracks[e["tid"]] == "compute"]
    assert f"F{BLOCKS - 2}.0" in compute  # the old units' (the last but one unit's forward): steps 1, 2
    assert compute.count(f"L{units - 1}.0 forward") == 2  # the new units' fused last one: steps 3 and 4
