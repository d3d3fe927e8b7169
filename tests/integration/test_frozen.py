"""Frozen parameters are read-only (issue 70): LitGPT's LoRA model with every kind on SSD reads its frozen base
with its unit and never writes it; the master weights, gradients and optimizer state exist for the trained
parameters only; in the vertical order a window reads each unit's weights once, the horizontal order once per
micro-batch. Measured with ``io_stats()``/``step_telemetry``, the bytes the SSD really moved. A parameter whose
``requires_grad`` changes during fit is refused."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import pytest

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.config import OffloadConfig, TensorKind
from lightning_greedysnake.offload.preflight import human_bytes
from lightning_greedysnake.planner import traffic
from lightning_greedysnake.strategy.planning.placement import planned_costs
from tests.helpers import make_trainer, max_abs_diff, token_loader

litgpt = pytest.importorskip("litgpt")

from tests.integration.test_litgpt_lora import VOCAB  # noqa: E402
from tests.integration.test_litgpt_lora import LoRAModule as LitGPTLoRA  # noqa: E402

K = 3


def LoRAModule() -> L.LightningModule:  # noqa: N802  (a model class's stand-in)
    """The issue's model: n_embd 128, 4 layers, r=4 on query, value and projection (about 1% trainable)."""
    return LitGPTLoRA(n_layer=4, n_embd=128, n_head=4, n_query_groups=4, head_size=32, intermediate_size=256)


class Layout(L.Callback):
    """The tensor manager's layout, as the run made it."""

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.state = trainer.strategy.tensor_manager.state


SAID: dict[str, list[str]] = {}
"""Each order's run: what it logged."""


class Said(logging.Handler):
    """Every message logged while it is attached (the start-of-run report, the end-of-fit summary)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def fit(schedule: str) -> tuple[GreedySnakeStrategy, LoRAModule, Any]:
    L.seed_everything(0, verbose=False)
    module, layout, said = LoRAModule(), Layout(), Said()
    strategy = GreedySnakeStrategy(auto=False, schedule=schedule, offload=OffloadConfig.everywhere("ssd"))
    root, level = logging.getLogger(), logging.getLogger().level
    root.addHandler(said)
    root.setLevel(logging.INFO)
    try:
        make_trainer(strategy, K, max_epochs=1, callbacks=[layout]).fit(module, token_loader(4 * K, vocab=VOCAB))
    finally:
        root.removeHandler(said)
        root.setLevel(level)
    SAID[schedule] = said.messages
    return strategy, module, layout.state


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[GreedySnakeStrategy, LoRAModule, Any]]:
    return {schedule: fit(schedule) for schedule in ("vertical", "horizontal")}


@pytest.fixture(scope="module")
def said(runs: dict[str, Any]) -> list[str]:
    """The vertical run's log."""
    return SAID["vertical"]


def test_frozen_weights_are_never_written_and_only_trained_parameters_have_state_and_gradients(runs):
    strategy, module, state = runs["vertical"]
    units = range(state.num_units)
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    assert trainable * 40 < total  # (the base is most of the model)
    prefix = [state.units[u].trained_numel for u in units]
    # the trained prefix: the trainable parameters and padding (up to a 2048-element boundary a unit)
    assert trainable <= sum(prefix) <= trainable + 2048 * state.num_units
    weights = sum(state.region_bytes(TensorKind.WEIGHTS, u) for u in units)
    prefix_weights = sum(b - a for u in units for a, b in state.byte_ranges(TensorKind.WEIGHTS, u, *state.bounds(u)))
    assert prefix_weights * 20 < weights
    for kind, room in ((TensorKind.GRADIENTS, 1), (TensorKind.OPTIMIZER_STATES, 2)):  # AdamW: two slots
        assert sum(state.region_bytes(kind, u) for u in units) == room * 4 * sum(prefix)
    steps = len(strategy.step_telemetry)
    assert steps == 4
    stats = strategy.io_stats()  # the whole fit's (a step's writes may land in the next step's telemetry)
    # the weights went to SSD once at the start; every step since wrote what it changed: the trained prefix of
    # each unit, never a frozen byte
    assert 0 < stats["ssd/weights/bytes_written"] - weights <= steps * prefix_weights
    assert 0 < stats["ssd/optimizer_states/bytes_written"] <= steps * 2 * 4 * sum(prefix)
    assert stats["ssd/optimizer_states/bytes_read"] <= steps * 2 * 4 * sum(prefix)
    assert stats["ssd/gradients/bytes_written"] <= steps * 4 * sum(prefix)


def test_the_start_of_run_report_says_how_many_parameters_are_frozen_and_where_they_went(runs, said):
    _, module, state = runs["vertical"]
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    read_only = sum(state.read_only_weight_bytes(u) for u in range(state.num_units))
    assert 0 < read_only < sum(state.region_bytes(TensorKind.WEIGHTS, u) for u in range(state.num_units))
    lines = [m for m in said if m.startswith("greedysnake: frozen (read-only) parameters:")]
    assert lines == [(f"greedysnake: frozen (read-only) parameters: {frozen:,} of {total:,} ({frozen / total:.1%}), "
                      f"in the weights: {human_bytes(read_only)} on SSD; read with their unit, never written back, "
                      "no gradient, optimizer state or master weights kept for them")], said


def test_the_end_of_fit_summary_shows_the_frozen_weights_read_and_none_written(runs, said):
    """Measured per transfer (the bytes of each weights read and write past the unit's trained prefix): every
    window reads each unit's frozen base at least once, the end reads it back into the module, and only the
    initial placement wrote it."""
    strategy, _, state = runs["vertical"]
    steps = len(strategy.step_telemetry)
    read_only = sum(state.read_only_weight_bytes(u) for u in range(state.num_units))
    stats = strategy.io_stats()
    read, written = stats["ssd/weights/read_only_read_bytes"], stats["ssd/weights/read_only_written_bytes"]
    placed = stats["ssd/weights/read_only_placed_bytes"]
    assert written == 0 and placed == read_only
    assert (steps + 1) * read_only <= read <= (2 * steps + 1) * read_only and read < stats["ssd/weights/bytes_read"]
    summary = [m for m in said if "what moved where" in m]
    assert len(summary) == 1, said
    lines = summary[0].splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[0] == "weights")
    assert lines[at + 1] == (f"    of which read-only (frozen): {human_bytes(read)} read, 0 B written by training, "
                             f"{human_bytes(placed)} when placed")
    # (the read-only bytes are not counted twice in the totals the summary and the loggers add up)
    assert not any(k.endswith("bytes_read") and "read_only" in k for k in stats)


def test_the_plan_counts_the_frozen_weights_as_read_only(runs):
    """The planner's unit costs of the LoRA layout, every kind on SSD: a step writes the trained prefix of the
    weights (about 2% of them here) and reads them whole; the fit's measured weight writes are that, per step,
    beside the initial placement."""
    strategy, _, state = runs["vertical"]
    costs = planned_costs(state, OffloadConfig.everywhere("ssd"), 0.0, False)
    terms = traffic(costs, "vertical", K).terms
    weights = sum(state.region_bytes(TensorKind.WEIGHTS, u) for u in range(state.num_units))
    prefix = sum(state.written_weight_bytes(u) for u in range(state.num_units))
    assert terms["write/weights"] == prefix and prefix * 20 < weights <= terms["read/weights"]
    steps = len(strategy.step_telemetry)
    assert strategy.io_stats()["ssd/weights/bytes_written"] == weights + steps * terms["write/weights"]


def test_the_vertical_order_reads_the_frozen_base_k_times_less_than_the_horizontal(runs):
    """A window of the vertical order reads each unit for its forward and again for its backward (the units at
    the turn kept between them), whatever K; the horizontal order does so for every micro-batch."""
    read, weights = {}, {}
    for schedule, (strategy, _, state) in runs.items():
        weights[schedule] = sum(state.region_bytes(TensorKind.WEIGHTS, u) for u in range(state.num_units))
        read[schedule] = [s.bytes_read.get("weights", 0) for s in strategy.step_telemetry[1:]]
    assert weights["vertical"] == weights["horizontal"]
    assert all(weights["vertical"] <= r <= 2 * weights["vertical"] for r in read["vertical"]), read
    assert all(h >= (K - 0.5) * v for h, v in zip(read["horizontal"], read["vertical"], strict=True)), read


def test_both_orders_train_alike(runs):
    a = {n: p.detach() for n, p in runs["vertical"][1].named_parameters()}
    b = {n: p.detach() for n, p in runs["horizontal"][1].named_parameters()}
    assert max_abs_diff(a, b) <= 1e-5


@pytest.mark.parametrize("change", ["unfreeze", "freeze"])
def test_a_requires_grad_changed_during_fit_is_refused(tmp_path, change):
    class Change(L.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == K:  # the second window
                name = "model.transformer.h.1.attn.qkv.linear.weight" if change == "unfreeze" else \
                    "model.transformer.h.1.attn.qkv.lora_A"
                module.get_parameter(name).requires_grad_(change == "unfreeze")

    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False), K, max_epochs=1, callbacks=[Change()],
                           default_root_dir=tmp_path)
    was = "False to True" if change == "unfreeze" else "True to False"
    with pytest.raises(ValueError, match=rf"parameter 'model\.transformer\.h\.1\.attn\.qkv\.\S+' changed "
                                         rf"requires_grad from {was} during fit.*Fix: set requires_grad before"):
        trainer.fit(LoRAModule(), token_loader(4 * K, vocab=VOCAB))
    assert trainer.global_step == 1
