"""greedysnake's own host time per unit op, with the compute taken out (issue 72, item 1: the measurement; the
cuts are still to come).

A model of many tiny blocks (``--blocks`` of ``Linear(16, 16)`` + ``Tanh``, micro-batches of 8 rows, K
micro-batches a window, one intra-op thread), whose compute is negligible, so a window's time is the host's:
Lightning's own strategy against greedysnake's planned defaults (every kind in RAM here), its vertical and
horizontal orders with every kind in RAM and on SSD (``auto=False``), one block a unit. Reported per window
(the median after warm-up) and per unit op, a unit op being one unit's forward or backward for one micro-batch
(2 x K x units a window; recompute, where a run does it, is inside its backward); "over Lightning" is the
window's time less Lightning's on the same layers, over those ops. ``--profile NAME`` prints where one
system's host time goes (cProfile, by function's own time).

    python benchmarks/host_overhead.py [--blocks 48] [--k 8] [--windows 10] [--profile gs_vertical_ssd]

Run on a quiet machine: every system runs in this process, one after the other.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WARMUP_WINDOWS = 3


def systems() -> dict[str, Any]:
    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.config import OffloadConfig

    return {
        "lightning": lambda: "auto",
        "gs_default": lambda: GreedySnakeStrategy(),
        "gs_vertical_ram": lambda: GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("host")),
        "gs_vertical_ssd": lambda: GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("ssd")),
        "gs_horizontal_ram": lambda: GreedySnakeStrategy(auto=False, schedule="horizontal",
                                                         offload=OffloadConfig.everywhere("host")),
        "gs_horizontal_ssd": lambda: GreedySnakeStrategy(auto=False, schedule="horizontal",
                                                         offload=OffloadConfig.everywhere("ssd")),
    }


def run(name: str, blocks: int, k: int, windows: int, profile: bool = False) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(blocks)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.units = blocks

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.ends.append(time.perf_counter())
            manager = getattr(trainer.strategy, "tensor_manager", None)
            if manager is not None:
                self.units = manager.num_units

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % k == 0:
                self.ends.append(time.perf_counter())

    g = torch.Generator().manual_seed(0)
    n = windows * k * 8
    data = TensorDataset(torch.randn(n, 16, generator=g), torch.randn(n, 16, generator=g))
    clock = Clock()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=k, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, default_root_dir=root, strategy=systems()[name](),
                            callbacks=[clock])
        L.seed_everything(0, verbose=False)
        module = Tiny()
        if profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            trainer.fit(module, DataLoader(data, batch_size=8))
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        else:
            trainer.fit(module, DataLoader(data, batch_size=8))
    window = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return {"system": name, "window_ms": round(statistics.median(window[WARMUP_WINDOWS:]) * 1e3, 2),
            "units": clock.units, "unit_ops": 2 * k * clock.units}


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--systems", nargs="*", default=list(systems()))
    parser.add_argument("--profile", help="a system to profile (cProfile, by own time) instead of timing")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for logger in ("lightning", "lightning.pytorch", "lightning_greedysnake", "lightning.fabric"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    if args.profile:
        run(args.profile, args.blocks, args.k, args.windows, profile=True)
        return 0
    rows = [run(name, args.blocks, args.k, args.windows) for name in args.systems]
    base = next((r for r in rows if r["system"] == "lightning"), None)
    for row in rows:
        row["per_unit_op_us"] = round(row["window_ms"] * 1e3 / row["unit_ops"], 1)
        if base is not None:
            row["over_lightning_per_unit_op_us"] = round((row["window_ms"] - base["window_ms"]) * 1e3 / row["unit_ops"], 1)
    print(f"{'system':>20} {'window ms':>10} {'units':>6} {'us / unit op':>13} {'over Lightning':>15}")
    for row in rows:
        print(f"{row['system']:>20} {row['window_ms']:>10} {row['units']:>6} {row['per_unit_op_us']:>13} "
              f"{row.get('over_lightning_per_unit_op_us', '-'):>15}")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "blocks": args.blocks, "k": args.k,
                                        "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
