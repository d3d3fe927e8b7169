"""greedysnake on one CUDA GPU with every kind of state on the disk, against in-memory Lightning.

A GPT of a few hundred million parameters in bf16-mixed; a short K sweep; the vertical order, the
horizontal order (the ZeRO-Infinity order, K=4 only: it loads the weights 2K times per step) and
Lightning's own ``strategy="auto"`` with everything on the GPU, the vertical order with the 16-bit
compute weights resident on the GPU (``resident_weights``: no weight traffic on the disk, one H2D copy
of each unit's new weights per step), and ``GreedySnakeStrategy()`` as is
(``default``: the device plan keeps a model that fits on the GPU; ``offloaded`` says whether it did
not). Each configuration runs in a fresh
process; the steady state is timed from the end of the first optimizer step to the end of the last
(``torch.cuda.synchronize`` there: the benchmark's, not the strategy's).

Printed per row: tokens/s, achieved TFLOP/s (model FLOPs: 6 x parameters x tokens plus attention, not
counting recomputation), the roofline's bound (the largest of: compute = the FLOPs done, recompute
included, over the measured bf16 matmul rate; SSD = the bytes moved (read and write, from the traffic
model) over the measured O_DIRECT bandwidth; PCIe = the bytes the device tier copied (counted) over the
measured pinned bandwidth; optimizer = trainable elements over the measured CPU fused-AdamW rate), the
fraction of that roofline achieved, and the GPU's idle share (1 - the in-memory run's time for the same
tokens, recompute included, over the measured time: an estimate from the run where the GPU is busy).

Sized to finish in about 5 minutes on one H200 with a ~1.2 GB/s disk:

    python benchmarks/gpu.py                         # GPT 1536x12 (~0.4 B), seq 1024, mb 4, K 4 16
    python benchmarks/gpu.py --ks 8 --n-layer 6      # smaller
    python benchmarks/gpu.py --ks 8 --fp16-ks 8      # and 16-mixed (loss scaling) beside bf16-mixed
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _model_flops(args: argparse.Namespace, params: int, tokens: int) -> float:
    """6 x parameters x tokens (the embedding lookup excluded) plus causal attention's matmuls."""
    dense = params - args.vocab * args.n_embd
    attention = 6 * args.n_layer * args.seq * args.n_embd * tokens  # QK^T and AV, forward+backward, causal half
    return 6.0 * dense * tokens + attention


def child(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from _common import gpt_module, token_loader

    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.config import OffloadConfig
    from lightning_greedysnake.planner import roofline
    from lightning_greedysnake.planner.measure import unit_costs

    name, k = args.child.split(":")
    k = int(k)
    precision = "16-mixed" if name == "vertical_fp16" else "bf16-mixed"
    schedule = "vertical" if name in ("vertical_fp16", "resident_weights") else name
    Module, _ = gpt_module(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq)
    if name == "lightning":
        strategy: Any = "auto"
    elif name == "default":  # GreedySnakeStrategy() as is: the device plan keeps a model that fits on the GPU
        strategy = GreedySnakeStrategy(offload_dir=Path(args.offload_dir) / args.child.replace(":", "_"))
    else:  # every kind on SSD; resident_weights: but the 16-bit compute weights stay on the GPU
        weights = "device" if name == "resident_weights" else "ssd"
        strategy = GreedySnakeStrategy(auto=False,
            schedule=schedule, offload_dir=Path(args.offload_dir) / args.child.replace(":", "_"),
            offload=OffloadConfig.everywhere("ssd", weights=weights, return_weights=False), alpha=0.25, lag=1)
    marks: list[float] = []
    captured: dict[str, Any] = {}

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % k == 0:  # a window's end
                torch.cuda.synchronize()  # (the benchmark's clock)
                marks.append(time.perf_counter())

        def on_train_end(self, trainer: Any, module: Any) -> None:
            manager = getattr(trainer.strategy, "tensor_manager", None)
            if manager is not None:
                manager.drain()
                captured["units"] = unit_costs(manager)
                captured["pcie_bytes"] = manager.copies.counts.bytes_to_device + manager.copies.counts.bytes_to_host
            torch.cuda.synchronize()
            marks.append(time.perf_counter())

    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision=precision,
                        max_steps=args.steps, accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()],
                        default_root_dir=args.offload_dir)
    with trainer.init_module(empty_init=name not in ("lightning", "default")):
        module = Module()
    params = sum(p.numel() for p in module.parameters())
    trainer.fit(module, token_loader(args.vocab, args.seq, k * args.steps * args.micro_batch, args.micro_batch))
    # the steady state: from the first step's end to the last one's (drained)
    measured_steps = args.steps - 1
    wall = (marks[-1] - marks[0]) / measured_steps
    tokens = k * args.micro_batch * args.seq
    flops = _model_flops(args, params, tokens)
    row: dict[str, Any] = {
        "config": name, "k": k, "params_M": round(params / 1e6, 1), "step_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1), "TFLOPs": round(flops / wall / 1e12, 1),
    }
    if name == "default":
        row["offloaded"] = trainer.strategy.tensor_manager is not None
    if "units" in captured:  # (a run with a tensor manager)
        recompute = 8.0 / 6.0
        # (16-mixed waits for the whole backward before stepping, as norm clipping does)
        traffic = roofline.traffic(captured["units"], schedule, k, clip_norm=name == "vertical_fp16")
        bounds = {
            "compute": flops * recompute / args.peak_flops,
            "ssd": traffic.read_bytes / args.read_bps + traffic.write_bytes / args.write_bps,
            "pcie": captured["pcie_bytes"] / args.steps / args.pcie_bps,
            "optimizer": params / args.opt_rate,
        }
        bound = max(bounds, key=bounds.get)  # type: ignore[arg-type]
        row.update({"bound": bound, "roofline_s": round(bounds[bound], 3),
                    "of_roofline": round(bounds[bound] / wall, 3),
                    **{f"{key}_s": round(v, 3) for key, v in bounds.items()}})
    return row


def measure_gpu(args: argparse.Namespace) -> None:
    """bf16 matmul rate and pinned host<->device bandwidth, onto ``args`` (once, in the parent)."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    args.peak_flops = 20 * 2 * n**3 / (time.perf_counter() - t0)
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
        host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    args.pcie_bps = 6 * (1 << 30) / (time.perf_counter() - t0)
    print(f"  gpu: bf16 matmul {args.peak_flops / 1e12:.0f} TFLOP/s, pinned copies {args.pcie_bps / 1e9:.1f} GB/s",
          file=sys.stderr)


def main() -> None:
    from _common import add_machine_args, add_model_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, n_layer=12, seq=1024)
    parser.set_defaults(n_embd=1536, n_head=12, vocab=32000)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--ks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--horizontal-ks", type=int, nargs="*", default=[4])
    parser.add_argument("--default-ks", type=int, nargs="*", default=[4],
                        help="Ks at which GreedySnakeStrategy() runs as is (the device plan: all on the GPU where it fits)")
    parser.add_argument("--resident-ks", type=int, nargs="*", default=[4],
                        help="Ks at which the vertical order also runs with the compute weights resident on the GPU "
                             "(offload.weights='device'), everything else on SSD")
    parser.add_argument("--fp16-ks", type=int, nargs="*", default=[],
                        help="also run the vertical order in 16-mixed (loss scaling) at these K")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peak-flops", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--pcie-bps", type=float, default=0.0, help=argparse.SUPPRESS)
    add_machine_args(parser)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    from _common import MODEL_FLAGS, measure_machine, print_table, run_child, write_result

    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first step is not timed)")
    rows = []
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as tmp:
        measure_machine(args, tmp)
        measure_gpu(args)
        flags = [*MODEL_FLAGS, "micro_batch", "steps", "read_bps", "write_bps", "opt_rate", "peak_flops", "pcie_bps"]
        for k in args.ks:
            configs = ["lightning", "vertical", *(["horizontal"] if k in args.horizontal_ks else []),
                       *(["resident_weights"] if k in args.resident_ks else []),
                       *(["default"] if k in args.default_ks else []),
                       *(["vertical_fp16"] if k in args.fp16_ks else [])]
            for name in configs:
                rows.append(run_child(__file__, f"{name}:{k}", args, flags, ["--offload-dir", tmp]))
                print(f"  done {name} K={k}", file=sys.stderr)
    in_memory = {r["k"]: r["step_s"] for r in rows if r["config"] == "lightning"}
    for r in rows:
        if r["config"] != "lightning":
            busy = in_memory[r["k"]] * 8.0 / 6.0  # the same tokens on a busy GPU, recompute included
            r["gpu_idle"] = round(max(0.0, 1.0 - busy / r["step_s"]), 3)
            r["vs_in_memory"] = round(in_memory[r["k"]] / r["step_s"], 3)
        bf16 = next((b for b in rows if b["config"] == "vertical" and b["k"] == r["k"]), None)
        if r["config"] == "vertical_fp16" and bf16 is not None:
            r["fp16_vs_bf16_time"] = round(r["step_s"] / bf16["step_s"], 3)
    print_table(rows, ["config", "k", "params_M", "step_s", "tokens_per_s", "TFLOPs", "offloaded", "bound", "roofline_s",
                       "of_roofline", "gpu_idle", "vs_in_memory", "fp16_vs_bf16_time", "compute_s", "ssd_s", "pcie_s", "optimizer_s"])
    write_result(args.out, args, [*MODEL_FLAGS, "micro_batch", "steps"], rows,
                 {"read_GBps": args.read_bps / 1e9, "write_GBps": args.write_bps / 1e9,
                  "optimizer_Melem_per_s": args.opt_rate / 1e6, "bf16_TFLOPs": args.peak_flops / 1e12,
                  "pcie_GBps": args.pcie_bps / 1e9})


if __name__ == "__main__":
    main()
