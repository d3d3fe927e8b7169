"""Issue 69 item 7: nonsense settings do not pass silently. ``layers_per_unit`` above the model's blocks
and ``lag`` above the run's units are clamped to what is in effect, said once at setup with why, and every
figure the run prints (the plan table, the staging estimate) is the clamped value's, not the user's number;
the training is exact against ``strategy="auto"``."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_greedysnake import GreedySnakeStrategy
from tests.helpers import TinyGPTModule, make_trainer, max_abs_diff, token_loader
from tests.integration.test_start_report import Captured

K = 2
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def fit(strategy: Any, root: Path) -> tuple[dict[str, torch.Tensor], str]:
    """A 4-block GPT fitted 3 optimizer steps (past the warm-step plan): its parameters and the log."""
    logger, handler = logging.getLogger("lightning.pytorch"), Captured()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        L.seed_everything(0, verbose=False)
        module = TinyGPTModule(n_layer=4, lr=3e-3)
        trainer = make_trainer(strategy, K, max_epochs=1, default_root_dir=root)
        trainer.fit(module, token_loader(3 * K))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, "\n".join(handler.lines)


def staging_bytes(report: str) -> float:
    found = re.findall(r"up to ([\d.]+) (B|KiB|MiB|GiB|TiB) of staging", report)
    assert len(found) == 1, report
    value, unit = found[0]
    return float(value) * UNITS[unit]


def table_value(report: str, name: str) -> str:
    found = re.findall(rf"^{name}\s+(\S+)$", report, flags=re.M)
    assert found, report
    return found[-1]


def test_lag_and_layers_per_unit_beyond_the_model_are_clamped_said_and_used(tmp_path):
    ref, _ = fit("auto", tmp_path / "auto")
    got, report = fit(GreedySnakeStrategy(lag=1000, layers_per_unit=100), tmp_path / "gs")
    # said once at setup, with the value in effect and why
    said = [line for line in report.splitlines() if "in effect" in line]
    assert any(re.search(r"layers_per_unit=100 on 4 blocks: 4 in effect \(one unit of all 4 blocks", line)
               for line in said), report
    assert any(re.search(r"lag=1000 on 1 unit: 1 in effect \(the optimizer lane holds at most one step per unit",
                         line) for line in said), report
    assert len(said) == 2, said
    # the figures printed are the clamped values'
    assert table_value(report, "lag") == "1" and table_value(report, "layers_per_unit") == "4", report
    assert "lag 1000" not in report, report
    # the staging estimate is the one of the settings in effect (the same run, set to them)
    _, in_effect = fit(GreedySnakeStrategy(lag=1, layers_per_unit=4), tmp_path / "same")
    assert "in effect" not in in_effect, in_effect
    assert staging_bytes(report) == staging_bytes(in_effect) < 64 * UNITS["MiB"], (report, in_effect)
    # and the training is exact against strategy="auto"
    assert max_abs_diff(got, ref) <= 1e-5
