"""Optimizer overlap, measured side by side: the same model, data and K with

- ``sync``: every unit stepped synchronously as its gradient completes (``lag=0, alpha=0``);
- ``backward``: steps on the background lane, trailing backward by two units (``lag=2, alpha=0``);
- ``alpha``: the same plus a quarter of each update deferred into the next forward (``lag=2, alpha=0.25``).

Runs are interleaved (sync, backward, alpha, sync, ...) in fresh processes so machine drift hits all
alike. Reports the median steady-state step time, the optimizer time the training thread could not hide
(``optimizer_unhidden_s``: waits for a unit's update, a full queue, a drain) and its share of the step,
the optimizer lane's busy time, and the optimizer's SSD traffic against compute time.

    python benchmarks/overlap.py                  # GPT 1024x4 (vocab 8192), seq 128, K=8, fp32, SSD
    python benchmarks/overlap.py --k 4 --rounds 1 --steps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

CONFIGS = {"sync": (0.0, 0), "backward": (0.0, 2), "alpha": (0.25, 2)}


def child(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from _common import gpt_module, token_loader
    from lightning_greedysnake import GreedySnakeStrategy

    alpha, lag = CONFIGS[args.child]
    Module, _ = gpt_module(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq)
    loader = token_loader(args.vocab, args.seq, args.k * args.steps)
    strategy = GreedySnakeStrategy(auto=False, alpha=alpha, lag=lag, offload_dir=Path(args.offload_dir) / args.child,
                                   offload={"return_weights": False})
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, accumulate_grad_batches=args.k, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=args.offload_dir)
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True):
        module = Module()
    trainer.fit(module, loader)
    steady = strategy.step_telemetry[1:]  # the first step includes warm-up and the first state reads
    optimizer_kinds = ("optimizer_states", "master_weights")

    def opt_bytes(e: Any) -> int:
        written = sum(v for k, v in e.bytes_written.items() if k in optimizer_kinds or k == "weights")
        return sum(v for k, v in e.bytes_read.items() if k in optimizer_kinds) + written

    return {
        "config": args.child,
        "alpha": alpha,
        "lag": lag,
        "steps": [e.as_metrics() for e in steady],
        "optimizer_ssd_bytes": statistics.mean(opt_bytes(e) for e in steady),
    }


def main() -> None:
    from _common import add_model_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, n_layer=4, seq=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "overlap.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    from _common import MODEL_FLAGS, print_table, run_child, write_result

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    flags = [*MODEL_FLAGS, "k", "steps", "precision"]
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as tmp:
        for r in range(args.rounds):
            for name in CONFIGS:
                runs[name].append(run_child(__file__, name, args, flags, ["--offload-dir", tmp]))
                print(f"  round {r + 1}: {name} done", file=sys.stderr)
    rows = []
    for name, results in runs.items():
        steps = [s for res in results for s in res["steps"]]
        wall = statistics.median(s["wall_s"] for s in steps)
        unhidden = statistics.median(s["optimizer_unhidden_s"] for s in steps)
        rows.append({
            "config": name,
            "alpha": results[0]["alpha"],
            "lag": results[0]["lag"],
            "step_s": round(wall, 3),
            "optimizer_unhidden_s": round(unhidden, 3),
            "unhidden_share": round(unhidden / wall, 3),
            "optimizer_busy_s": round(statistics.median(s["optimizer_busy_s"] for s in steps), 3),
            "compute_s": round(statistics.median(s["compute_s"] for s in steps), 3),
            "io_wait_s": round(statistics.median(s["io_wait_s"] for s in steps), 3),
            "optimizer_ssd_gb": round(statistics.mean(res["optimizer_ssd_bytes"] for res in results) / 1e9, 3),
            "steps_measured": len(steps),
        })
    base = rows[0]["step_s"]
    for row in rows:
        row["time_vs_sync"] = round(row["step_s"] / base, 3)
    cols = ["config", "alpha", "lag", "step_s", "time_vs_sync", "optimizer_unhidden_s", "unhidden_share",
            "optimizer_busy_s", "compute_s", "io_wait_s", "optimizer_ssd_gb"]
    print_table(rows, cols)
    write_result(args.out, args, [*MODEL_FLAGS, "k", "steps", "rounds", "precision"], rows)


if __name__ == "__main__":
    main()
