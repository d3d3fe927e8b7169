"""Live telemetry: the progress bar, per-step token counts, and the Chrome trace of the lanes."""

from __future__ import annotations

import json

import lightning as L
import pytest

from lightning_greedysnake import GreedySnakeStrategy
from tests.helpers import TinyGPTModule, make_trainer, token_loader


def test_tokens_per_step_and_the_progress_bar():
    strategy = GreedySnakeStrategy(auto=False)
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(strategy, 2, max_epochs=1)
    trainer.fit(TinyGPTModule(), token_loader(8, batch_size=2, seq=8))
    assert [e.tokens for e in strategy.step_telemetry] == [2 * 2 * 8] * 4  # K x batch x sequence
    # each window's first micro-batch shows the step before it: at the end, the second to last
    bar, last = trainer.progress_bar_metrics, strategy.step_telemetry[-2]
    assert bar["gs/tok_s"] > 0 and bar["gs/ssd_GBps"] > 0
    # as measured: the bar prints three significant digits itself (rounded to places here, a loaded
    # machine's small traffic showed 0.0 and failed the check above)
    assert bar["gs/ssd_GBps"] == pytest.approx(last.ssd_gb_per_s, rel=1e-6)
    assert bar["gs/tok_s"] == pytest.approx(last.tokens_per_s, rel=1e-6)


def test_trace_of_the_first_steps_is_a_chrome_trace(tmp_path):
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False, trace_steps=2), 2, max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(TinyGPTModule(n_layer=3), token_loader(8))
    trace = json.loads((tmp_path / "greedysnake_trace.json").read_text())
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"compute", "optimizer", "ssd_read", "ssd_write"} <= set(tracks.values())
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] in tracks for e in spans)
    compute = {e["name"] for e in spans if tracks[e["tid"]] == "compute"}
    # the vertical order's ops by name: unit forwards, the fused last unit, recomputing backwards
    assert {"F0.0", "F1.1", "L2.0 forward", "L2.1 backward", "B1.1", "B0.0"} <= compute
    # two traced steps: unit 0's forward of micro-batch 0 ran once in each
    assert sum(1 for e in spans if e["name"] == "F0.0") == 2


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_trace_steps(value):
    with pytest.raises(ValueError, match=r"trace_steps=.*Fix"):
        GreedySnakeStrategy(auto=False, trace_steps=value)
