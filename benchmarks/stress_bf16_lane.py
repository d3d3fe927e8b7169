"""Stress test of the background optimizer lane under bf16-mixed: trains the bf16 test configuration 14
times in one process and prints each run's max parameter difference from the plain-PyTorch policy
reference (0.0 when exact). It found a race (the master buffer was read for the 16-bit cast after it
had been handed back to the pool; about 2 runs in 14 differed); since the fix, 28 of 28 runs are exact.

    python benchmarks/stress_bf16_lane.py LAG ALPHA        # e.g. 2 0.25
"""
import os, sys, tempfile
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))); os.chdir(tempfile.mkdtemp())
from tests.integration.test_bf16 import policy_reference, greedysnake_bf16
from tests.helpers import max_abs_diff
from lightning_greedysnake import GreedySnakeStrategy
ref = policy_reference()
for i in range(14):
    got, _ = greedysnake_bf16(GreedySnakeStrategy(auto=False, schedule="vertical", lag=int(sys.argv[1]), alpha=float(sys.argv[2])))
    print(i, max_abs_diff(got, ref), flush=True)
