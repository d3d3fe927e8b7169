"""Peak host memory and step time of one model under several placements, measured side by side.

Each configuration runs in a fresh process (so peak RSS is its own), on the same model, data and K:

- ``lightning_auto``: Lightning's default strategy, everything in RAM (the baseline);
- ``greedysnake_cpu``: the vertical schedule with every tensor in host memory;
- ``greedysnake_ssd``: weights, master weights, optimizer state on SSD (O_DIRECT), model built eagerly
  (``return_weights=False`` for every SSD run: the point is not to hold the model in RAM);
- ``greedysnake_ssd_meta``: the same, model built on the meta device and materialized unit by unit;
- ``greedysnake_ssd_meta_bf16``: the same under bf16-mixed (16-bit compute weights on SSD);
- ``greedysnake_defaults``: ``GreedySnakeStrategy()`` as is (the planner places within half of the
  available memory; ``return_weights=True``: the end of fit is planned within that budget too);
- ``lightning_auto_bf16``, ``greedysnake_defaults_bf16``: those two under bf16-mixed.

    python benchmarks/memory.py                      # GPT 1024x20 (270M), vocab 8192, seq 128, K=4, 3 steps
    python benchmarks/memory.py --n-layer 4 --steps 2 --configs lightning_auto greedysnake_ssd_meta
    python benchmarks/memory.py --n-layer 12 --k 8 --steps 4 --rounds 3 --configs lightning_auto greedysnake_defaults
                                                     # a peak varies +-150 MB between runs: medians of rounds

Reports peak RSS (``train_peak_rss_mb``: by the end of the last step, before the end of fit hands the state
back; ``peak_rss_mb``: the whole run), its growth over the same process idle (torch, Lightning and this package imported),
and that growth as a fraction of the model state (16 bytes per parameter: fp32 weights, gradients, two
Adam moments), and the step time as compare.py takes it (``step_s``: the median of the steps after the second,
``_common.steady_step_s``). Prints a table and writes JSON (default ``benchmarks/results/memory.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = [
    "lightning_auto",
    "greedysnake_cpu",
    "greedysnake_ssd",
    "greedysnake_ssd_meta",
    "greedysnake_ssd_meta_bf16",
    "greedysnake_defaults",
    "lightning_auto_bf16",
    "greedysnake_defaults_bf16",
]


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from _common import gpt_module, steady_step_s, token_loader
    from lightning_greedysnake import GreedySnakeStrategy, OffloadConfig

    idle_mb = _rss_mb()  # an idle process with everything imported: the baseline of "growth"
    torch.set_num_threads(os.cpu_count() or 1)
    Module, config = gpt_module(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq)

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.train_peak_mb = 0.0
            self.times: list[float] = []
            self.peaks: list[float] = []
            """Peak RSS by the end of each step: where the run's peak was reached (warm-up or steady)."""
            self.io: list[dict[str, float]] = []
            self._t = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
            if (trainer.fit_loop.epoch_loop.batch_idx + 1) % args.k == 0:
                now = time.perf_counter()
                self.times.append(now - self._t)
                self._t = now
                self.peaks.append(round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
                manager = getattr(trainer.strategy, "tensor_manager", None)
                if manager is not None:
                    manager.flush()
                    self.io.append(manager.stats.flat())

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.train_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    name = args.child
    loader = token_loader(args.vocab, args.seq, args.k * args.steps * args.micro_batch, args.micro_batch)
    offload_root = Path(args.offload_dir)
    if name.startswith("lightning_auto"):
        strategy: Any = "auto"
    elif name.startswith("greedysnake_defaults"):
        budget = int(args.host_budget_gb * 2**30) if args.host_budget_gb else None
        strategy = GreedySnakeStrategy(offload_dir=offload_root / name, auto_host_budget_bytes=budget)
    elif name == "greedysnake_cpu":
        strategy = GreedySnakeStrategy(auto=False, offload=OffloadConfig.everywhere("host"))
    else:
        # return_weights=False: copying the trained model back into RAM at the end is what a model larger
        # than RAM cannot afford (and would dominate the peak here)
        strategy = GreedySnakeStrategy(auto=False, offload_dir=offload_root / name, offload={"return_weights": False})
    precision = "bf16-mixed" if name.endswith("bf16") else "32-true"
    timer = Timer()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=args.steps,
        accumulate_grad_batches=args.k, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer], default_root_dir=str(offload_root),
    )
    torch.manual_seed(0)
    with trainer.init_module(empty_init=name.endswith(("meta", "meta_bf16"))):
        module = Module()
    trainer.fit(module, loader)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    step_s = steady_step_s(timer.times)
    out: dict[str, Any] = {
        "config": name,
        "params": config.num_params,
        "state_mb": round(config.num_params * 16 / 2**20, 1),  # fp32 weights + gradients + two Adam moments
        "idle_rss_mb": round(idle_mb, 1),
        "train_peak_rss_mb": round(timer.train_peak_mb, 1),
        "peak_rss_mb": round(peak_mb, 1),
        "peak_rss_by_step_mb": timer.peaks,
        "growth_mb": round(peak_mb - idle_mb, 1),
        "growth_vs_state": round((peak_mb - idle_mb) / (config.num_params * 16 / 2**20), 3),
        "step_s": round(step_s, 3),
        "tokens_per_s": round(args.k * args.micro_batch * args.seq / step_s, 1),
    }
    if timer.io:
        first, last = timer.io[0], timer.io[-1]
        steps = max(1, len(timer.io) - 1)
        per = {k: (last.get(k, 0.0) - first.get(k, 0.0)) / steps for k in last}
        out["ssd_read_gb_per_step"] = round(sum(v for k, v in per.items() if k.endswith("bytes_read")) / 1e9, 3)
        out["ssd_written_gb_per_step"] = round(
            sum(v for k, v in per.items() if k.endswith("bytes_written")) / 1e9, 3)
        out["read_wait_s_per_step"] = round(sum(v for k, v in per.items() if k.endswith("wait_seconds")), 3)
    return out


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One config's rounds as one row: the median of every number that varies (peak RSS, step time, ...),
    the rest as the first round has it."""
    import statistics

    row: dict[str, Any] = {k: v for k, v in runs[0].items() if k != "round"}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "round":
            row[key] = round(statistics.median(r[key] for r in runs), 3)
    return {**row, "round": "median"}


def main() -> None:
    from _common import add_model_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, n_layer=20, seq=128)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    parser.add_argument("--host-budget-gb", type=float, default=0.0,
                        help="auto_host_budget_bytes of the greedysnake_defaults configs, in GiB (0: the default)")
    parser.add_argument("--offload-dir", default=None, help="where the SSD runs put their files (default: a temp dir)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    parser.add_argument("--rounds", type=int, default=1,
                        help="runs of every config, each round starting one config later; with more than one, the "
                             "median rows come first (a peak RSS varies by +-150 MB between runs of one command)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    from _common import MODEL_FLAGS, print_table, run_child, write_result

    rows = []
    flags = [*MODEL_FLAGS, "micro_batch", "k", "steps", "host_budget_gb"]
    configs = list(args.configs)
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as tmp:
        for round_ in range(args.rounds):
            shift = round_ % len(configs)
            for name in configs[shift:] + configs[:shift]:
                row = run_child(__file__, name, args, flags, ["--offload-dir", tmp])
                rows.append({**row, "round": round_} if args.rounds > 1 else row)
                print(f"  done {name} round {round_}", file=sys.stderr)
    if args.rounds > 1:
        rows = [_median_row([r for r in rows if r["config"] == name]) for name in configs] + rows
    for r in rows:
        same = [b for b in rows if b.get("round") == r.get("round")]
        base = next((b for b in same if b["config"].startswith("lightning_auto")), same[0])
        r["rss_vs_lightning"] = round(r["peak_rss_mb"] / base["peak_rss_mb"], 3)
        r["time_vs_lightning"] = round(r["step_s"] / base["step_s"], 3)
    cols = ["config", "state_mb", "train_peak_rss_mb", "peak_rss_mb", "growth_mb", "growth_vs_state", "rss_vs_lightning", "step_s", "time_vs_lightning", "tokens_per_s",
            "ssd_read_gb_per_step", "ssd_written_gb_per_step", "read_wait_s_per_step"]
    print_table(rows, cols)
    write_result(args.out, args, [*MODEL_FLAGS, "micro_batch", "k", "steps", "host_budget_gb"], rows)


if __name__ == "__main__":
    main()
