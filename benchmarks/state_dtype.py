"""Convergence of optimizer state in fewer bytes against fp32 state on the example, side by side in one run.

Runs ``examples/train_gpt.py`` on its defaults (the example's GPT, data, optimizer and Trainer settings)
with fp32 state, with ``strategy.offload.optimizer_state_dtype=bfloat16``, and (where torchao is
installed) with torchao's ``AdamW8bit`` and ``AdamW4bit`` (``module.optimizer=adamw8bit|adamw4bit``),
fresh processes one after the other, and reports each run's final validation loss (the mean over the
example's validation batches at its last validation), its ratio to fp32's, the SSD bytes per optimizer
step the example prints, and the wall time.

    python benchmarks/state_dtype.py                               # the example's defaults
    python benchmarks/state_dtype.py trainer.max_steps=200         # any example override, for every run
    python benchmarks/state_dtype.py --states float32 adamw8bit    # some of the variants

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
VARIANTS = {
    "float32": ["strategy.offload.optimizer_state_dtype=float32"],
    "bfloat16": ["strategy.offload.optimizer_state_dtype=bfloat16"],
    "adamw8bit": ["module.optimizer=adamw8bit"],
    "adamw4bit": ["module.optimizer=adamw4bit"],
}
"""The optimizer state's format -> the example's overrides that select it."""


def run(dtype: str, overrides: list[str], work: Path) -> dict[str, Any]:
    out = work / dtype
    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), f"hydra.run.dir={out}",
               *VARIANTS[dtype], "trainer.enable_progress_bar=false", *overrides]
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


def _available() -> list[str]:
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        return ["float32", "bfloat16"]
    return list(VARIANTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    parser.add_argument("--states", nargs="+", choices=list(VARIANTS), default=None,
                        help="the variants (default: all; torchao's only where it is installed); float32 first")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "state_dtype.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from _common import print_table, write_result

    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(dtype, args.overrides, Path(tmp)) for dtype in args.states or _available()]
    fp32 = rows[0]["val_loss"]
    ssd32 = (rows[0]["ssd_MB_read_per_step"] or 0) + (rows[0]["ssd_MB_written_per_step"] or 0)
    for row in rows:
        row["val_loss_vs_fp32"] = round(row["val_loss"] / fp32, 4)
        ssd = (row["ssd_MB_read_per_step"] or 0) + (row["ssd_MB_written_per_step"] or 0)
        row["ssd_bytes_vs_fp32"] = round(ssd / ssd32, 3) if ssd32 else None
    print_table(rows, ["optimizer_state_dtype", "val_loss", "val_loss_vs_fp32", "wall_s", "ssd_MB_read_per_step",
                       "ssd_MB_written_per_step", "ssd_bytes_vs_fp32"])
    write_result(args.out, args, ["overrides"], rows)


if __name__ == "__main__":
    main()
