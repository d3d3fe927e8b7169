"""``benchmarks/scale.py --smoke`` (the ladder's CI size, so the script does not rot): each system's row says
it trained, with its phases, peak memory and disk record; a size whose state cannot fit the free disk is
refused by greedysnake before any work, and the row says so. No timing is asserted: only that the numbers
are there and sane."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scale.py"
GS_SYSTEMS = ["gs_default", "gs_bf16_state", "gs_ssd"]


def _run(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--offload-dir", str(tmp_path), "--out", str(out),
                           "--memory-limit-gb", "6", "--timeout-min", "5", *flags],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(out.with_suffix(".rows.jsonl").read_text().splitlines()) == len(result["rows"])  # (as they landed)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("greedysnake_scale_")], "scratch left behind"
    return result


def _check_trained(row: dict) -> None:
    assert row["status"] == "trained", row.get("log_tail", row)
    assert len(row["step_times"]) == 3 and all(t > 0 for t in row["step_times"])
    assert row["time_to_first_step_s"] >= row["first_step_s"] > 0
    assert row["time_to_first_step_s"] == pytest.approx(row["build_s"] + row["setup_s"] + row["first_step_s"], abs=0.05)
    assert 0 < row["peak_rss_gb"] < 6 and row["returncode"] == 0
    assert row["disk_used_gb"] >= 0 and row["ssd_read_gb_per_step"] >= 0 and row["ssd_written_gb_per_step"] >= 0


def test_smoke_rows_of_the_greedysnake_systems(tmp_path: Path) -> None:
    result = _run(tmp_path, "--systems", *GS_SYSTEMS)
    rows = {r["system"]: r for r in result["rows"]}
    assert list(rows) == GS_SYSTEMS and all(r["size"] == "smoke" for r in rows.values())
    for row in rows.values():
        _check_trained(row)
    assert rows["gs_ssd"]["offload"] == dict.fromkeys(["weights", "master_weights", "optimizer_states", "gradients"], "ssd")
    assert rows["gs_ssd"]["gs_ssd_read_gb_per_step"] > 0  # (its state is on the disk under test)
    assert result["headline"] == {s: {**result["headline"][s], "largest_trained": "smoke"} for s in GS_SYSTEMS}
    machine, settings = result["machine"], result["settings"]
    assert machine["disk_free_gb"] > 0 and machine["read_GBps"] > 0 and machine["write_GBps"] > 0
    assert settings["seq"] == 32 and settings["k"] == 2 and settings["steps"] == 3
    assert settings["greedysnake_offload"]["return_weights"] is True and "--smoke" in result["command"]


def test_a_size_past_the_free_disk_is_refused_before_any_work(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    per_layer = 12 * 16384**2 * 12  # parameters of one 16384-wide block, at 12+ bytes each on SSD
    layers = max(1, math.ceil(2 * free / per_layer))
    result = _run(tmp_path, "--systems", "gs_ssd", "--sizes", f"16384x{layers}")
    (row,) = result["rows"]
    assert row["status"].startswith("refused: ") and "Fix:" in row["status"], row.get("log_tail", row)
    assert "free" in row["status"] and row["phase"] == "setup"
    assert row["disk_used_gb"] < 0.1 and row["peak_rss_gb"] < 6  # nothing written, nothing materialized
    assert result["headline"]["gs_ssd"]["largest_trained"] is None


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (not a dependency)")
def test_smoke_row_of_deepspeed_beside_greedysnake(tmp_path: Path) -> None:
    result = _run(tmp_path, "--systems", "gs_ssd", "deepspeed")
    gs, ds = result["rows"]
    for row in (gs, ds):
        _check_trained(row)
    assert ds["system"] == "deepspeed" and ds["deepspeed_zero"]["offload_param"]["device"] == "nvme"
    assert ds["deepspeed_zero"]["offload_optimizer"]["device"] == "nvme"
    first = result["headline"]["time_to_first_step_at_deepspeeds_largest"]  # (item 6: the same table)
    assert first["size"] == "smoke" and first["gs_ssd"]["time_to_first_step_s"] == gs["time_to_first_step_s"]
    assert first["deepspeed"]["time_to_first_step_s"] == ds["time_to_first_step_s"]
