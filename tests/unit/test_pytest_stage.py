"""``benchmarks/pytest_stage.py``, the GPU session's test runner: a test hung where no signal reaches
costs that test (pytest killed and started again on the rest), a test hung in Python fails by
pytest-timeout in the same process, and every outcome is on disk as it happens."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[2] / "benchmarks" / "pytest_stage.py"

TESTS = '''
import signal
import threading
import time


def test_a_passes():
    pass


def test_b_hangs_where_no_signal_reaches():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # (as a CUDA synchronize would)
    time.sleep(60)


def test_c_hangs_in_python():
    threading.Event().wait()


def test_d_runs_after_the_restart():
    pass
'''


def test_a_hang_costs_one_test_and_the_rest_run(tmp_path):
    (tmp_path / "test_hangs.py").write_text(TESTS)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(RUNNER), "--out", str(out), "--budget-s", "60", "--test-timeout-s", "2",
                           "--grace-s", "1", "--", "-c", "/dev/null", str(tmp_path / "test_hangs.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    events = [json.loads(line) for line in (out / "tests.jsonl").read_text().splitlines()]
    outcomes = {e["nodeid"].split("::")[1]: e["outcome"] for e in events if e["event"] == "end"}
    python_hang = "failed" if importlib.util.find_spec("pytest_timeout") else "hung"
    assert outcomes == {"test_a_passes": "passed", "test_b_hangs_where_no_signal_reaches": "hung",
                        "test_c_hangs_in_python": python_hang, "test_d_runs_after_the_restart": "passed"}, proc.stderr
    assert proc.returncode == 1
