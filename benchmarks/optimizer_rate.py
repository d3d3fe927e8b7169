"""The host optimizer's element rate per optimizer class: fused AdamW against torchao's AdamW8bit and
AdamW4bit (where torchao is installed), measured one after the other in one process with the rate the
first-step plan uses (:func:`lightning_greedysnake.planner.measure.optimizer_rate`: the best of a few
steps after a first one that creates the state and compiles).

    python benchmarks/optimizer_rate.py                 # 8M elements
    python benchmarks/optimizer_rate.py --numel 1048576

Writes ``benchmarks/results/optimizer_rate.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 23)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "optimizer_rate.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from _common import print_table, write_result

    from lightning_greedysnake.planner.measure import optimizer_rate

    one = [torch.nn.Parameter(torch.zeros(1))]
    optimizers = {"AdamW (fused)": torch.optim.AdamW(one, lr=1e-4, fused=True)}
    try:
        import torchao.optim

        optimizers.update({name: getattr(torchao.optim, name)(one, lr=1e-4) for name in ("AdamW8bit", "AdamW4bit")})
    except ImportError:
        print("torchao is not installed: fused AdamW only")
    rows = [{"optimizer": name, "M_elements_per_s": round(optimizer_rate(args.numel, optimizer=opt) / 1e6, 1)}
            for name, opt in optimizers.items()]
    fused = rows[0]["M_elements_per_s"]
    for row in rows:
        row["vs_fused_adamw"] = round(row["M_elements_per_s"] / fused, 3)
    print_table(rows, ["optimizer", "M_elements_per_s", "vs_fused_adamw"])
    write_result(args.out, args, ["numel"], rows)


if __name__ == "__main__":
    main()
