"""Measured step time against the roofline, per schedule and K, side by side in one run.

The roofline (the paper's): a step takes at least the largest of its compute (K micro-batches through
every unit, forward plus recomputing backward, timed per op in this run), its SSD time (the bytes the
tensor manager moves, from the traffic model, over this machine's measured O_DIRECT bandwidth) and its
optimizer time (trainable elements over the measured fused-AdamW rate). Reports measured/predicted.

    python benchmarks/roofline.py                         # GPT 1024x4, seq 32, K in 1 2 4 8, fp32
    python benchmarks/roofline.py --seq 128 --ks 1 4 --schedules vertical
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any


def child(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L

    from _common import gpt_module, token_loader
    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.planner import Machine, predict
    from lightning_greedysnake.planner.measure import unit_times
    from lightning_greedysnake.strategy.planning.placement import unit_costs

    schedule, k = args.child.split(":")
    k = int(k)
    Module, _ = gpt_module(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq)
    strategy = GreedySnakeStrategy(auto=False, schedule=schedule, offload_dir=Path(args.offload_dir) / args.child.replace(":", "_"),
                                   offload={"return_weights": False})
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.offload_dir)
    captured: dict[str, Any] = {}

    class Capture(L.Callback):
        def on_train_end(self, trainer: Any, module: Any) -> None:
            manager = trainer.strategy.tensor_manager
            manager.drain()
            spans = manager.stats.lanes.spans(0.0, float("inf"))
            fwd, bwd = unit_times(spans, manager.num_units)
            captured["units"] = unit_costs(manager, fwd, bwd)

    trainer.callbacks.append(Capture())
    with trainer.init_module(empty_init=True):
        module = Module()
    trainer.fit(module, token_loader(args.vocab, args.seq, k * args.steps))
    measured = statistics.median(e.wall_s for e in strategy.step_telemetry[1:])
    machine = Machine(args.read_bps, args.write_bps, args.opt_rate)
    pred = predict(captured["units"], machine, schedule, k)
    return {
        "schedule": schedule, "k": k, "measured_s": round(measured, 3), "predicted_s": round(pred.step_s, 3),
        "measured_over_predicted": round(measured / pred.step_s, 3), "bound": pred.bound,
        "compute_s": round(pred.compute_s, 3), "ssd_s": round(pred.ssd_s, 3), "optimizer_s": round(pred.optimizer_s, 3),
        "ssd_gb": round((pred.traffic.read_bytes + pred.traffic.write_bytes) / 1e9, 3),
        "tokens_per_s": round(k * args.seq / measured, 1),
    }


def main() -> None:
    from _common import add_machine_args, add_model_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, n_layer=4, seq=32)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--schedules", nargs="+", default=["vertical", "horizontal"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "roofline.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_machine_args(parser)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    from _common import MODEL_FLAGS, measure_machine, print_table, run_child, write_result

    rows = []
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as tmp:
        measure_machine(args, tmp)
        flags = [*MODEL_FLAGS, "steps", "precision", "read_bps", "write_bps", "opt_rate"]
        for k in args.ks:  # interleaved: each K runs every schedule back to back
            for schedule in args.schedules:
                rows.append(run_child(__file__, f"{schedule}:{k}", args, flags, ["--offload-dir", tmp]))
                print(f"  done {schedule} K={k}", file=sys.stderr)
    print_table(rows, ["schedule", "k", "measured_s", "predicted_s", "measured_over_predicted", "bound",
                       "compute_s", "ssd_s", "optimizer_s", "ssd_gb", "tokens_per_s"])
    write_result(args.out, args, [*MODEL_FLAGS, "steps", "precision"], rows,
                 {"read_GBps": args.read_bps / 1e9, "write_GBps": args.write_bps / 1e9,
                  "optimizer_Melem_per_s": args.opt_rate / 1e6, "optimizer_threads": args.opt_threads})


if __name__ == "__main__":
    main()
