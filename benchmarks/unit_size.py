"""Is the unit size chosen at setup a good one? The planned ``layers_per_unit`` (unset, ``auto=True``)
side by side with each fixed size, on the same model, data, K and placement, alternating in fresh
processes, rounds apart.

    python benchmarks/unit_size.py                                    # GPT 512 x 8, seq 32, K=8, on SSD
    python benchmarks/unit_size.py --n-embd 1024 --n-layer 12 --seq 128 --placement ssd --rounds 2
    python benchmarks/unit_size.py --n-embd 1024 --n-layer 12 --n-head 16 --seq 32 --precision bf16-mixed --sizes 1 8

Every kind is on SSD (``--placement ssd``; ``host``: in RAM), the rest as the defaults plan it (alpha,
lag, recompute and the staging budget after the second step, which may also suggest larger units). Reports each system's step time (the median of steps 2..N, rounds' median), its ratio to the
fastest fixed size, the wall time of steps 2..N, the size setup chose, the plan's predicted step for it, and the first step's report on larger units. Prints a table and writes JSON (default ``benchmarks/results/unit_size.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = [1, 2, 4, 8]


def child(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from _common import gpt_module, token_loader

    from lightning_greedysnake import GreedySnakeStrategy

    Module, _ = gpt_module(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq)
    torch.manual_seed(0)
    module = Module()
    marks: list[float] = []
    at_setup: list[int] = []  # the unit size setup chose

    class Timer(L.Callback):
        def on_train_start(self, trainer: Any, *_: Any) -> None:
            at_setup.append(trainer.strategy.config.layers_per_unit)

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step > len(marks):
                marks.append(time.perf_counter())

    placement = {k: args.placement for k in ("weights", "master_weights", "optimizer_states", "gradients")}
    lpu = None if args.child == "planned" else int(args.child.split("_")[1])
    notes: list[str] = []  # the warm step's suggestion of larger units

    class Notes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "larger units" in record.getMessage():
                notes.append(record.getMessage())

    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(Notes())
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as d:
        strategy = GreedySnakeStrategy(layers_per_unit=lpu, offload=dict(placement, path=d, activations="host"))
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=args.steps, logger=False,
                            precision=args.precision,
                            accumulate_grad_batches=args.k, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[Timer()])
        trainer.fit(module, token_loader(args.vocab, args.seq, args.k * args.steps))
    steps = [b - a for a, b in itertools.pairwise(marks)]
    return {"system": args.child, "layers_per_unit": strategy.config.layers_per_unit, "setup_layers_per_unit": at_setup[0],
            "step_s": statistics.median(steps), "after_first_s": sum(steps),
            "predicted_s": strategy.plan_choice.step_s if strategy.plan_choice is not None else None,
            "first_step_note": " ".join(notes)}


def main() -> None:
    from _common import add_model_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, n_layer=8, seq=32)
    parser.set_defaults(n_embd=512, n_head=8, vocab=8192)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="the fixed sizes run beside the planned one")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--placement", choices=["ssd", "host"], default="ssd")
    parser.add_argument("--precision", default="32-true", help="the Trainer's (e.g. bf16-mixed, as compare.py's)")
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "unit_size.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    from _common import MODEL_FLAGS, print_table, run_child, write_result

    systems = ["planned"] + [f"fixed_{s}" for s in args.sizes if s <= args.n_layer]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(dir=args.offload_dir or None) as d:
        args.offload_dir = d
        for r in range(args.rounds):
            for system in systems:
                row = run_child(__file__, system, args, [*MODEL_FLAGS, "k", "steps", "placement", "precision",
                                                                    "offload_dir"], [])
                runs[system].append(row)
                print(f"  round {r} {system}: layers_per_unit {row['layers_per_unit']}, {row['step_s']:.3f} s",
                      file=sys.stderr)
    rows = []
    for system, got in runs.items():
        rows.append({"system": system, "layers_per_unit": "/".join(str(g["layers_per_unit"]) for g in got),
                     "setup_layers_per_unit": "/".join(str(g["setup_layers_per_unit"]) for g in got),
                     "step_s": round(statistics.median(g["step_s"] for g in got), 3),
                     "after_first_s": round(statistics.median(g["after_first_s"] for g in got), 3),
                     "per_round": [round(g["step_s"], 3) for g in got],
                     "predicted_s": [g["predicted_s"] and round(g["predicted_s"], 3) for g in got],
                     "first_step_note": [g["first_step_note"] for g in got]})
    fastest = min(r["step_s"] for r in rows if r["system"] != "planned")
    fastest_total = min(r["after_first_s"] for r in rows if r["system"] != "planned")
    for r in rows:
        r["vs_fastest_fixed"] = round(r["step_s"] / fastest, 3)
        r["after_first_vs_fastest"] = round(r["after_first_s"] / fastest_total, 3)
    print_table(rows, ["system", "setup_layers_per_unit", "layers_per_unit", "step_s", "vs_fastest_fixed", "after_first_s",
                       "after_first_vs_fastest", "per_round"])
    write_result(args.out, args, [*MODEL_FLAGS, "k", "steps", "rounds", "placement", "precision"], rows)


if __name__ == "__main__":
    main()
