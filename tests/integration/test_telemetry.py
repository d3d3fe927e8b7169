"""Live telemetry: the progress bar, per-step token counts, and the Chrome trace of the lanes."""

from __future__ import annotations

import json
import logging
from typing import Any

import lightning as L
import pytest
import torch

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


class OwnModule(L.LightningModule):
    """A user's own module, written as for any strategy: no greedysnake callback, nothing to read the
    counters with."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                                       torch.nn.Tanh(), torch.nn.Linear(64, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_end_of_fit_summary_says_what_moved_where_for_a_users_own_module(tmp_path, caplog):
    """``fit_summary`` (``progress.end_of_fit``, from teardown): printed once by the strategy itself at the
    end of fit, a line per kind with the bytes read and written and where (the tier, the offload
    directory), then the SSD traffic in all and per step; the numbers are ``io_stats()``'s, final after fit.
    Not after an evaluation."""
    from lightning_greedysnake.offload.preflight import human_bytes
    from tests.helpers import regression_loader

    offload = tmp_path / "offload"
    strategy = GreedySnakeStrategy(auto=False, offload_dir=str(offload),
                                   offload={"weights": "ssd", "master_weights": "ssd", "optimizer_states": "ssd",
                                            "gradients": "host", "activations": "host"})
    L.seed_everything(0, verbose=False)
    module = OwnModule()
    trainer = make_trainer(strategy, 2, max_epochs=1, default_root_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        trainer.fit(module, regression_loader(6))
    said = [r.getMessage() for r in caplog.records if "what moved where" in r.getMessage()]
    assert len(said) == 1, said
    text = said[0]
    stats = strategy.io_stats()  # (after fit: the whole fit's, as the summary says)
    assert trainer.global_step == 3 and f"in this fit (3 optimizer steps" in text
    lines = {line.split()[0]: line for line in text.splitlines()[1:-1]}
    read_total = written_total = 0
    for kind in ("weights", "master_weights", "optimizer_states"):
        read, written = int(stats[f"ssd/{kind}/bytes_read"]), int(stats[f"ssd/{kind}/bytes_written"])
        assert read > 0 and (written > 0 or kind == "master_weights")
        master = " (the weights' region: under 32-true the weights are the master copy)"
        assert lines[kind] == (f"  {kind:<17} {human_bytes(read)} read, {human_bytes(written)} written, "
                               f"ssd in {offload}" + (master if kind == "master_weights" else ""))
        read_total += read
        written_total += written
    assert lines["gradients"] == f"  {'gradients':<17} host: used in place, no I/O"
    assert lines["activations"] == f"  {'activations':<17} host: used in place, no I/O"
    assert read_total == sum(v for k, v in stats.items() if k.startswith("ssd/") and k.endswith("/bytes_read"))
    assert text.splitlines()[-1] == (
        f"SSD traffic: {read_total / 1e6:.1f} MB read, {written_total / 1e6:.1f} MB written "
        f"({read_total / 3 / 1e6:.2f} / {written_total / 3 / 1e6:.2f} MB per optimizer step)")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer.validate(module, regression_loader(2), verbose=False)
    assert not [r for r in caplog.records if "what moved where" in r.getMessage()]


def test_where_the_step_waits_every_kind_on_ssd():
    """The breakdown issue 54 asks for, per step: the disk's requests (bytes, count, in flight), the lane's CPU
    time apart from its waits on reads. Invariants that hold on any machine, not timings: every byte the SSD
    counters moved went through the disk's requests; the disk is never busy longer than the step, reads and
    writes each within the union; a queue depth of at least one while busy; a thread's CPU time within its
    wall time; the lane's waits within its busy time."""
    strategy = GreedySnakeStrategy(auto=False)  # every kind on SSD
    L.seed_everything(0, verbose=False)
    make_trainer(strategy, 2, max_epochs=1).fit(TinyGPTModule(n_layer=3), token_loader(8))
    steps = strategy.step_telemetry
    assert len(steps) == 4
    manager_ssd = strategy.io_stats()
    requested = sum(s.request_bytes_read + s.request_bytes_written for s in steps)
    assert requested > 0 and all(s.read_requests > 0 and s.write_requests > 0 for s in steps[1:])
    assert requested <= sum(v for k, v in manager_ssd.items() if k.startswith("ssd/") and k.endswith(("bytes_read",
                                                                                                       "bytes_written")))
    for s in steps[1:]:  # (the first step reads no optimizer state)
        assert sum(s.bytes_read.values()) > 0
        assert 0 < s.disk_busy_s <= s.wall_s + 1e-6
        assert s.disk_read_busy_s <= s.disk_busy_s + 1e-9 and s.disk_write_busy_s <= s.disk_busy_s + 1e-9
        assert max(s.disk_read_busy_s, s.disk_write_busy_s) > 0
        assert s.queue_depth >= 1.0 - 1e-9
        assert s.read_gb_per_s_busy > 0 and s.write_gb_per_s_busy > 0
        assert 0 < s.optimizer_cpu_s <= s.optimizer_busy_s + 1e-3
        assert s.optimizer_read_wait_s <= s.optimizer_busy_s + 1e-3
        assert s.mean_request_bytes > 0
        # the forward phase: up to the first backward op, within the step; its disk time within both
        assert 0 < s.forward_s < s.wall_s
        assert s.forward_disk_busy_s <= min(s.forward_s, s.disk_busy_s) + 1e-6
        assert s.forward_io_wait_s <= s.forward_s + 1e-6
        assert 0 <= s.backward_disk_busy_fraction <= 1 + 1e-6
        metrics = s.as_metrics()
        assert metrics["disk_busy_fraction"] == pytest.approx(s.disk_busy_s / s.wall_s)
