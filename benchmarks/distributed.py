"""Data parallel on CPU: one process against two (gloo), same model, K micro-batches per rank per step.

Each configuration runs in a fresh process tree launched by Lightning (``devices=N``); each process
gets ``cores / N`` intra-op threads, so both use the same cores (two processes process twice the
tokens per step). Two processes run with partitioned state (``sharded``: each rank steps its chunk,
the new 16-bit weights are all-gathered per unit) and replicated (every rank steps everything).
Reports the step time, tokens/s over all ranks, and the payload bytes each rank contributes to
collectives per optimizer step (the fp32 gradient all-reduce, plus its chunk of the weights
all-gather), whatever K is, against the model's fp32 gradient size.

    python benchmarks/distributed.py                    # GPT 512 x 4, seq 64, K in {2, 8}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    from _common import gpt_module, token_loader
    from lightning_greedysnake import GreedySnakeStrategy

    devices, k = args.devices, args.k
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // devices))
    Module, _ = gpt_module(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq)
    times: list[float] = []

    class Timer(L.Callback):
        t = 0.0

        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            if not self.t:
                self.t = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if (trainer.fit_loop.epoch_loop.batch_idx + 1) % k == 0:
                now = time.perf_counter()
                times.append(now - self.t)
                self.t = now

    where = Path(args.dir) / f"offload_{devices}_{k}_{args.mode}"
    where.mkdir(parents=True, exist_ok=True)
    strategy = GreedySnakeStrategy(auto=False, offload_dir=where, shard_state=args.mode == "sharded")
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.steps, accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()],
                        default_root_dir=args.dir)
    module = Module()
    # each rank reads K micro-batches of its shard per step
    trainer.fit(module, token_loader(args.vocab, args.seq, devices * k * args.steps))
    if trainer.global_rank == 0:
        steady = sorted(times[1:] or times)
        step_s = steady[len(steady) // 2]
        params = sum(p.numel() for p in module.parameters())
        print("RESULT " + json.dumps({
            "devices": devices, "mode": args.mode if devices > 1 else "-", "k": k, "step_s": round(step_s, 3),
            "tokens_per_s": round(devices * k * args.seq / step_s, 1),
            "collective_bytes_per_step": strategy.collective_bytes // max(1, trainer.global_step),
            "fp32_grad_bytes": 4 * params,
        }))


def main() -> None:
    from _common import add_model_args, print_table, write_result

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, n_layer=4, seq=64)
    parser.set_defaults(n_embd=512, n_head=8)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--devices", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="sharded", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "distributed.json"))
    args = parser.parse_args()
    if args.devices:
        child(args)
        return
    import subprocess

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.ks:
            for devices, mode in ((1, "sharded"), (2, "sharded"), (2, "replicated")):
                cmd = [sys.executable, __file__, "--devices", str(devices), "--k", str(k), "--dir", tmp, "--mode", mode,
                       "--steps", str(args.steps), "--n-embd", str(args.n_embd), "--n-layer", str(args.n_layer),
                       "--n-head", str(args.n_head), "--vocab", str(args.vocab), "--seq", str(args.seq)]
                proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent)
                line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if not line:
                    print(proc.stderr[-4000:], file=sys.stderr)
                    raise SystemExit(f"devices={devices} K={k} failed")
                rows.append(json.loads(line[0][len("RESULT "):]))
                print(f"  done devices={devices} {mode} K={k}", file=sys.stderr)
    for row in rows:
        one = next(r for r in rows if r["k"] == row["k"] and r["devices"] == 1)
        row["speedup_vs_1"] = round(row["tokens_per_s"] / one["tokens_per_s"], 2)
        row["collective_over_grad"] = round(row["collective_bytes_per_step"] / row["fp32_grad_bytes"], 3)
    print_table(rows, ["devices", "mode", "k", "step_s", "tokens_per_s", "speedup_vs_1", "collective_bytes_per_step",
                       "collective_over_grad"])
    write_result(args.out, args, ["n_embd", "n_layer", "n_head", "vocab", "seq", "ks", "steps"], rows)


if __name__ == "__main__":
    main()
