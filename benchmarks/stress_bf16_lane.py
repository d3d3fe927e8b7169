"""Reproduces the bf16-mixed race with a background optimizer lane: trains the bf16 test configuration
14 times in one process and prints each run's max parameter difference from the plain-PyTorch policy
reference (0.0 when exact). Under bf16-mixed the strategy currently forces lag=0, so to see the race
edit ``GreedySnakeStrategy._effective_lag`` to return ``self.config.lag``; then about 2 in 14 runs
differ (measured 2026-11-30: lag=2 alpha=0.25 -> 0.013 and 0.0043; lag=0 -> always 0.0).

    python benchmarks/stress_bf16_lane.py LAG ALPHA        # e.g. 2 0.25
"""
import os, sys, tempfile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))); os.chdir(tempfile.mkdtemp())
from tests.integration.test_bf16 import policy_reference, greedysnake_bf16
from tests.helpers import max_abs_diff
from lightning_greedysnake import GreedySnakeStrategy
ref = policy_reference()
for i in range(14):
    got, _ = greedysnake_bf16(GreedySnakeStrategy(schedule="vertical", lag=int(sys.argv[1]), alpha=float(sys.argv[2])))
    print(i, max_abs_diff(got, ref), flush=True)
