"""``benchmarks/gpu_session.sh``'s plan, checked on the CPU before a GPU lease spends it: its stages fit
400 s and each benchmark stage fits its configurations' expected times; the CUDA tests' count in its
header is the count there is, the smoke test first; and a configuration made to hang costs its own
timeout while every other configuration of the stage still writes its row (a dry run, in child processes
as on the GPU), which the summary and ``benchmarks/report.py``'s GPU table then show."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SESSION = (BENCH / "gpu_session.sh").read_text()


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"greedysnake_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    sys.path.insert(0, str(BENCH))  # (their own imports: _common)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


gpu = _module("gpu")
gpu_deepspeed = _module("gpu_deepspeed")


def _budgets() -> dict[str, int]:
    line = next(ln for ln in SESSION.splitlines() if ln.startswith("DISK_S="))
    return {k[:-2].lower(): int(v) for k, v in re.findall(r"(\w+_S)=(\d+)", line)}


def test_the_stages_fit_400_s_and_each_benchmark_stage_fits_its_expected_times():
    budgets = _budgets()
    assert set(budgets) == {"disk", "tests", "headline", "resident", "rest", "deepspeed", "summary"}
    script_s = 10  # (the machine's record, the offload directory's choice, python's starts between stages)
    assert sum(budgets.values()) + script_s <= 400, budgets  # (the DeepSpeed build runs beside the tests)
    # without .gpu_wheels the DeepSpeed stage gives its time to the benchmark stages: the same total
    given = dict(re.findall(r"(\w+)_S=\$\(\(\w+_S \+ (\d+)\)\)", SESSION))
    kept = int(re.search(r"DEEPSPEED_S=(\d+)\n", SESSION).group(1))
    assert sum(int(v) for v in given.values()) + kept == budgets["deepspeed"], given
    for stage, configs in gpu.STAGES.items():  # (the stage's gpu.py gets its budget less 3 s)
        expected = sum(c.expected_s for c in configs)
        assert budgets[stage] - 3 >= 1.1 * expected, (stage, budgets[stage], expected)
        assert f"#   {stage:<9}{budgets[stage]:>3} s  (expect ~{math.ceil(expected)})" in SESSION, stage
    assert budgets["deepspeed"] - 3 >= 1.1 * gpu_deepspeed.RUN_EXPECTED_S
    assert budgets["tests"] - 3 >= gpu_deepspeed.BUILD_EXPECTED_S  # (the build, beside the tests)
    # at least 3 steps timed after the warm-step plan, on both systems
    assert gpu.TIMED_STEPS >= 3 and gpu.WARMUP_STEPS == 2


def test_the_header_counts_the_cuda_tests_there_are_and_the_smoke_test_runs_first():
    from tests.gpu import test_cuda

    count = 0
    tests = [f for name, f in vars(test_cuda).items() if name.startswith("test_") and callable(f)]
    for f in tests:
        n = 1
        for mark in getattr(f, "pytestmark", []):
            if mark.name == "parametrize":
                n *= len(mark.args[1])
        count += n
    assert f"tests/gpu, {count} tests" in SESSION, count
    assert tests[0].__name__.startswith("test_smoke_"), tests[0].__name__


def test_the_configuration_timeouts_are_twice_the_expected_and_keep_the_later_ones_time():
    assert gpu.config_timeout_s(10, left=200, later=50) == 20  # twice its expected
    assert gpu.config_timeout_s(10, left=65, later=50) == 15  # the later configurations' time kept
    assert gpu.config_timeout_s(10, left=55, later=50) == 10  # but never under its own expected,
    assert gpu.config_timeout_s(10, left=8, later=50) == 8  # nor over what is left
    assert gpu.expected_s("horizontal_ssd", 8) == next(c.expected_s for c in gpu.STAGES["rest"]
                                                       if c.name == "horizontal_ssd")
    assert gpu.datasheet_flops("NVIDIA H100 80GB HBM3") == gpu.datasheet_flops("NVIDIA H200") > 0
    assert gpu.datasheet_flops("NVIDIA H100 PCIe") < gpu.datasheet_flops("NVIDIA H100 80GB HBM3")


@pytest.mark.timeout(120)
def test_a_configuration_made_to_hang_costs_its_timeout_and_the_others_still_write_their_rows(tmp_path):
    """The ``rest`` stage's dry run with ``vertical_ssd`` hanging: it is killed at twice its expected
    seconds, recorded with its timeout, and ``horizontal_ssd`` still runs and writes its row; the summary
    derives MFU and the roofline from the machine's rates and writes gpu.json, which the report renders."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "GREEDYSNAKE_SIMULATE_DEVICE": "1", gpu.HANG_ENV: "vertical_ssd", "PYTHONUNBUFFERED": "1"}
    (tmp_path / "offload").mkdir()  # (the disk stage makes it in a session)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "rest", "--dry-run", "--out", str(out),
                           "--offload-dir", str(tmp_path / "offload"), "--budget-s", "100"],
                          env=env, capture_output=True, text=True, timeout=110, check=False)
    wall = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]  # (a configuration failed)
    rows = {r["config"]: r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}
    hung, other = rows["vertical_ssd"], rows["horizontal_ssd"]
    timeout = gpu.TIMEOUT_FACTOR * gpu.DRY_RUN_EXPECTED_S
    assert hung["error"] == f"timed out after {timeout:.0f} s" and hung["timeout_s"] == timeout, hung
    assert hung["wall_s"] < timeout + 5 and "hanging" in hung["log_tail"]
    assert "error" not in other, other.get("log_tail", other)
    assert other["timeout_s"] == timeout and other["expected_s"] == gpu.DRY_RUN_EXPECTED_S
    assert len(other["step_times"]) == gpu.TIMED_STEPS and other["step_s"] > 0
    for key in ("peak_rss_gb", "ssd_read_GB_per_step", "ssd_write_GB_per_step", "pcie_GB_per_step", "TFLOPs"):
        assert key in other, key
    assert other["peak_rss_gb"] > 0.1 and other["pcie_GB_per_step"] > 0  # (the simulated device copies)
    assert wall < timeout + 60

    (out / "machine.json").write_text(json.dumps({"peak_flops": 1e6, "datasheet_flops": 2e6, "read_bps": 1e9,
                                                  "write_bps": 2e9, "pcie_bps": 1e10, "opt_rate": 1e8}))
    proc = subprocess.run([sys.executable, str(BENCH / "gpu.py"), "summary", "--dry-run", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "gpu.json").read_text())
    derived = next(r for r in data["rows"] if r["config"] == "horizontal_ssd")
    assert derived["mfu"] == pytest.approx(2 * derived["mfu_datasheet"], rel=0.02)
    assert derived["binds"] in ("disk", "pcie", "optimizer") and derived["of_roofline"] > 0
    assert data["settings"]["timed_steps"] == gpu.TIMED_STEPS
    report = _module("report")
    table = report.gpu_table(data)
    assert "| horizontal_ssd | 2 |" in table and "timed out after" in table and "MFU (datasheet)" in table
    assert "**gpu**" in report.render_gpu_result(out / "gpu.json")
