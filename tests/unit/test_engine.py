"""The engine alone (no Lightning): driving a window by hand gives plain autograd's gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_greedysnake import GreedySnakeConfig
from lightning_greedysnake.engine import WindowEngine
from lightning_greedysnake.models import GPT, GPTConfig, make_units
from lightning_greedysnake.offload import InMemoryTensorStore


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=4, n_head=2, n_embd=16, vocab_size=32, block_size=8))


def _batches(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 32, (k, 2, 9), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def _loss(logits: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) / k


@pytest.mark.parametrize("schedule", ["vertical", "horizontal"])
@pytest.mark.parametrize("layers_per_unit", [1, 3])
@pytest.mark.parametrize("k", [1, 3])
def test_window_gradients_equal_plain_autograd(schedule, layers_per_unit, k):
    batches = _batches(k)
    reference = _model()
    for x, y in batches:
        _loss(reference(x), y, k).backward()

    model = _model()
    config = GreedySnakeConfig(schedule=schedule, layers_per_unit=layers_per_unit).resolved()
    chain = model.layer_chain()
    store = InMemoryTensorStore()
    engine = WindowEngine(chain, make_units(chain, layers_per_unit), config, store, torch.device("cpu"))
    engine.begin_window(k)
    for m, (x, y) in enumerate(batches):
        for needed in engine.inputs_needed_until_fused(m):
            if not engine.has_inputs(needed):
                engine.set_inputs(needed, (batches[needed][0],), {})
        engine.run_until_fused(m)
        _loss(engine.fused_forward(m, (x,), {}), y, k).backward()
        engine.fused_backward_done(m)
    engine.finish_window()
    assert store.num_saved_activations == 0  # every saved activation was dropped after its last use
    assert sorted(store.gradient_ready_order) == list(range(engine.num_units))
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    engine.close()


def test_eval_forward_equals_the_model():
    model = _model()
    chain = model.layer_chain()
    engine = WindowEngine(chain, make_units(chain, 2), GreedySnakeConfig().resolved(), InMemoryTensorStore(),
                          torch.device("cpu"))
    x = _batches(1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(engine.eval_forward(x), model(x), rtol=0, atol=0)


class _PrefetchLog(InMemoryTensorStore):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int]] = []

    def acquire_unit(self, unit: int) -> None:
        super().acquire_unit(unit)
        self.log.append(("acquire", unit))

    def prefetch(self, unit: int) -> None:
        self.log.append(("prefetch", unit))


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_the_engine_asks_for_the_next_prefetch_units_units_in_plan_order(depth):
    """``offload.prefetch_units``: while unit j computes, the next ``depth`` different units the plan needs
    are asked for (forward: j+1, j+2; backward: j-1, j-2), never the unit in use."""
    from lightning_greedysnake.config import OffloadConfig

    batches = _batches(2)
    model = _model()
    chain = model.layer_chain()
    store = _PrefetchLog()
    config = GreedySnakeConfig(offload=OffloadConfig(prefetch_units=depth)).resolved()
    engine = WindowEngine(chain, make_units(chain, 1), config, store, torch.device("cpu"))
    engine.begin_window(2)
    for m, (x, y) in enumerate(batches):
        for needed in engine.inputs_needed_until_fused(m):
            if not engine.has_inputs(needed):
                engine.set_inputs(needed, (batches[needed][0],), {})
        engine.run_until_fused(m)
        _loss(engine.fused_forward(m, (x,), {}), y, 2).backward()
        engine.fused_backward_done(m)
    engine.finish_window()
    engine.close()
    last = engine.num_units - 1
    held = None
    asked_while: dict[int, set[int]] = {}
    for what, unit in store.log:
        if what == "acquire":
            held = unit
        else:
            assert unit != held
            asked_while.setdefault(held, set()).add(unit)
    if depth == 0:
        assert asked_while == {}
        return
    # forward through unit 1 asks for units 2.. (then the backward's next ones)
    assert {2, 3}.intersection(range(2, 2 + depth)) <= asked_while[1]
    assert max(len(units) for units in asked_while.values()) >= min(depth, last)
    assert all(len({u for u in units if u > h}) <= depth for h, units in asked_while.items())


def test_inputs_that_are_the_same_memory_are_equal_without_reading_them(monkeypatch):
    """A micro-batch's inputs are compared with the look-ahead's once per micro-batch: ``torch.equal`` of
    device tensors is a host sync each time. The same view of the same memory (training_step slicing the
    batch the look-ahead captured from) is equal without a read; other device tensors are compared on the
    device into a flag the engine reads once per window."""
    from lightning_greedysnake.engine import same_inputs

    batch = torch.arange(24).view(2, 12)
    captured, called = ((batch[:, :-1],), {"targets": batch[:, 1:]}), ((batch[:, :-1],), {"targets": batch[:, 1:]})
    assert captured[0][0] is not called[0][0]

    def no_read(*args: object) -> bool:
        raise AssertionError("torch.equal read the inputs")

    monkeypatch.setattr(torch, "equal", no_read)
    assert same_inputs(captured, called)


def test_other_host_tensors_are_still_compared_by_value():
    from lightning_greedysnake.engine import same_inputs

    a, b = torch.arange(6), torch.arange(6)
    deferred: list[torch.Tensor] = []
    assert same_inputs(((a,), {}), ((b,), {}), deferred) and deferred == []  # (host: compared now)
    assert not same_inputs(((a,), {}), ((b + 1,), {}), deferred)
    batch = torch.arange(24).view(2, 12)
    assert not same_inputs(((batch[:, :-1],), {}), ((batch[:, 1:],), {}))  # (same storage, another slice)
