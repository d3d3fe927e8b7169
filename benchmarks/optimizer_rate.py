"""The host optimizer's element rate per optimizer class and per intra-op thread count: fused AdamW
against torchao's AdamW8bit and AdamW4bit (where torchao is installed), each at 1 and 2 threads (the
optimizer lane's counts on a CPU run and on a small GPU box; ``--threads`` for others), measured one after
the other in one process with the rate the plans use
(:func:`lightning_greedysnake.planner.measure.optimizer_rate` with ``threads=``: on a thread of its own
with that many intra-op threads, as the lane runs it; the best of a few steps after a first one that
creates the state and compiles). Also prints the count greedysnake plans for the lane on this machine.
Run it on a quiet machine: other processes on the cores move the numbers.

    python benchmarks/optimizer_rate.py                 # 8M elements, 1 and 2 threads
    python benchmarks/optimizer_rate.py --numel 1048576 --threads 1 2 4 8
    python benchmarks/optimizer_rate.py --numel 4096 --repeats 1 --fused-only --out /tmp/x.json  # a smoke run

Writes ``benchmarks/results/optimizer_rate.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 23)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fused-only", action="store_true", help="skip torchao's optimizers (they compile first)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "optimizer_rate.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from _common import print_table, write_result

    from lightning_greedysnake.planner.measure import available_cores, optimizer_rate
    from lightning_greedysnake.planner.threads import optimizer_threads

    one = [torch.nn.Parameter(torch.zeros(1))]
    optimizers = {"AdamW (fused)": torch.optim.AdamW(one, lr=1e-4, fused=True)}
    try:
        if args.fused_only:
            raise ImportError
        import torchao.optim

        optimizers.update({name: getattr(torchao.optim, name)(one, lr=1e-4) for name in ("AdamW8bit", "AdamW4bit")})
    except ImportError:
        print("fused AdamW only (--fused-only, or torchao is not installed)")
    rows = []
    for name, opt in optimizers.items():
        for threads in args.threads:
            rate = optimizer_rate(args.numel, repeats=args.repeats, optimizer=opt, threads=threads)
            rows.append({"optimizer": name, "threads": threads, "M_elements_per_s": round(rate / 1e6, 1)})
    fused = {row["threads"]: row["M_elements_per_s"] for row in rows if row["optimizer"] == "AdamW (fused)"}
    for row in rows:
        row["vs_fused_adamw"] = round(row["M_elements_per_s"] / fused[row["threads"]], 3)
        row["vs_one_thread"] = round(row["M_elements_per_s"] / next(
            r["M_elements_per_s"] for r in rows if r["optimizer"] == row["optimizer"] and r["threads"] == args.threads[0]), 3)
    cores = available_cores()
    planned = {"cpu_run": optimizer_threads(cores, device_tier=False),
               "gpu_run": optimizer_threads(cores, device_tier=True)}
    print_table(rows, ["optimizer", "threads", "M_elements_per_s", "vs_fused_adamw", "vs_one_thread"])
    print(f"the lane's planned threads on this machine ({cores} cores): CPU run {planned['cpu_run']}, "
          f"with a GPU {planned['gpu_run']}")
    write_result(args.out, args, ["numel", "threads", "repeats"], rows,
                 {"cores": cores, "planned_optimizer_threads": planned})


if __name__ == "__main__":
    main()
