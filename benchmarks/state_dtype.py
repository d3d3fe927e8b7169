"""Convergence of bf16 optimizer state against fp32 state on the example, side by side in one run.

Runs ``examples/train_gpt.py`` on its defaults (the example's GPT, data, optimizer and Trainer settings)
once with ``strategy.offload.optimizer_state_dtype=float32`` and once with ``bfloat16`` (fresh processes,
one after the other), and reports each run's final validation loss (the mean over the example's
validation batches at its last validation), the ratio of the two, the SSD bytes per optimizer step the
example prints, and the wall time.

    python benchmarks/state_dtype.py                               # the example's defaults
    python benchmarks/state_dtype.py trainer.max_steps=200         # any example override, for both runs

Writes ``benchmarks/results/state_dtype.json``.
"""

from __future__ import annotations

import argparse
import csv
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16")


def run(dtype: str, overrides: list[str], work: Path) -> dict[str, Any]:
    out = work / dtype
    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), f"hydra.run.dir={out}",
               f"strategy.offload.optimizer_state_dtype={dtype}", "trainer.enable_progress_bar=false", *overrides]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=work, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{dtype} run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    val = [float(r["val_loss"]) for f in (out / "logs").rglob("metrics.csv")
           for r in csv.DictReader(f.open()) if r.get("val_loss")]
    if not val:
        raise SystemExit(f"the {dtype} run logged no val_loss: validate at least once (trainer.val_check_interval)")
    ssd = re.search(r"\(([\d.]+) / ([\d.]+) MB per optimizer step\)", done.stdout)
    return {"optimizer_state_dtype": dtype, "val_loss": round(val[-1], 4), "wall_s": round(wall, 1),
            "ssd_MB_read_per_step": float(ssd.group(1)) if ssd else None,
            "ssd_MB_written_per_step": float(ssd.group(2)) if ssd else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for both runs")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "state_dtype.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import print_table, write_result

    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(dtype, args.overrides, Path(tmp)) for dtype in DTYPES]
    fp32 = rows[0]["val_loss"]
    for row in rows:
        row["val_loss_vs_fp32"] = round(row["val_loss"] / fp32, 4)
    print_table(rows, ["optimizer_state_dtype", "val_loss", "val_loss_vs_fp32", "wall_s", "ssd_MB_read_per_step",
                       "ssd_MB_written_per_step"])
    write_result(args.out, args, ["overrides"], rows)


if __name__ == "__main__":
    main()
