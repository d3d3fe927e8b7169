"""Where one training step's CPU time goes, greedysnake's defaults or Lightning's own strategy, by op
(``torch.profiler``, self CPU time): for finding what a step costs beyond the model's own compute.

    python benchmarks/profile_step.py --system greedysnake --precision 32-true
    python benchmarks/profile_step.py --system lightning --precision 32-true
    python benchmarks/profile_step.py --system greedysnake_ssd --precision bf16-mixed --seq 32 --no-profile

``greedysnake_ssd`` puts every kind on SSD (``auto=False``) and prints, per step, where the step waits: the
training thread on reads (weights, saved activations) and on the optimizer, the optimizer lane's CPU time
apart from its waits on reads, the disk's busy fraction (a request in flight), the bandwidth it achieved while
busy against the probe's, the mean queue depth and request size, and the forward phase apart (its wall
time, the training thread's waits on reads in it, the disk's busy fraction in it and in the rest of the
step: ``StepTelemetry``). ``--alpha`` sets ``greedysnake_ssd``'s deferred share (the fixed 0.25 by default).

The GPT 1024 x 12 of ``compare.py`` (168M parameters), sequence 128, K=8; the last of ``--steps`` steps is
profiled (greedysnake's warm-step plan applies after step 2). One process per system: run them one after
the other on a quiet machine. A single step varies by more than 10% between runs here (the same 792
matmuls took 3.6 s in one run and 5.5 s in the next), so compare op shares, not totals.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning as L
from _common import gpt_module, token_loader
from torch.profiler import ProfilerActivity, profile

from lightning_greedysnake import GreedySnakeStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=["greedysnake", "greedysnake_ssd", "lightning"], default="greedysnake")
    parser.add_argument("--no-profile", action="store_true", help="the per-step breakdown only (no torch.profiler)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--offload-dir", default="/tmp/greedysnake_profile")
    parser.add_argument("--alpha", type=float, default=None,
                        help="greedysnake_ssd's alpha (default: auto=False's fixed 0.25)")
    args = parser.parse_args()
    module_cls, _ = gpt_module(1024, 12, 16, 8192, args.seq, optimizer="AdamW")

    class Profiled(L.Callback):
        """Profiles the last optimizer step (its K micro-batches and the step)."""

        def __init__(self) -> None:
            self.profiler: Any = None
            self.t0 = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            if i == args.k * (args.steps - 1) and not args.no_profile:
                self.profiler = profile(activities=[ProfilerActivity.CPU])
                self.profiler.__enter__()
                self.t0 = time.perf_counter()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            breakdown(getattr(trainer.strategy, "step_telemetry", []))
            if self.profiler is None:
                return
            self.profiler.__exit__(None, None, None)
            print(f"{args.system}, {args.precision}: the profiled step took {time.perf_counter() - self.t0:.3f} s")
            print(self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))

    fixed = {} if args.alpha is None else {"alpha": args.alpha}
    strategy: Any = ("auto" if args.system == "lightning" else
                     GreedySnakeStrategy(auto=False, offload={"return_weights": False}, **fixed)
                     if args.system == "greedysnake_ssd" else GreedySnakeStrategy(offload={"return_weights": False}))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, accumulate_grad_batches=args.k, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Profiled()], default_root_dir=args.offload_dir)
    with trainer.init_module(empty_init=args.system != "lightning"):
        module = module_cls()
    trainer.fit(module, token_loader(8192, args.seq, args.k * args.steps))


def breakdown(steps: list[Any]) -> None:
    """Where each step waited (``StepTelemetry``), one line per step."""
    if not steps:
        return
    print("step  wall_s  wait_reads  wait_opt  lane_busy  lane_cpu  lane_wait_reads  disk_busy  read_GBps  "
          "write_GBps  depth  request_MiB  GB_read  GB_written  fwd_s  fwd_wait  fwd_disk  bwd_disk")
    for s in steps:
        print(f"{s.step:>4}  {s.wall_s:6.3f}  {s.io_wait_s:10.3f}  {s.optimizer_unhidden_s:8.3f}  "
              f"{s.optimizer_busy_s:9.3f}  {s.optimizer_cpu_s:8.3f}  {s.optimizer_read_wait_s:15.3f}  "
              f"{s.disk_busy_fraction:9.1%}  {s.read_gb_per_s_busy:9.2f}  {s.write_gb_per_s_busy:10.2f}  "
              f"{s.queue_depth:5.2f}  {s.mean_request_bytes / 2**20:11.2f}  {s.request_bytes_read / 1e9:7.3f}  "
              f"{s.request_bytes_written / 1e9:10.3f}  {s.forward_s:5.3f}  {s.forward_io_wait_s:8.3f}  "
              f"{s.forward_disk_busy_fraction:8.1%}  {s.backward_disk_busy_fraction:8.1%}")


if __name__ == "__main__":
    main()
