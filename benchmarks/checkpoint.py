"""Checkpoint save and load with SSD-resident state, against Lightning's default checkpoint, side by side.

Each system runs in a fresh process on the same model: one training step, then ``trainer.save_checkpoint``
twice at the same step (as ``ModelCheckpoint`` with ``save_last=True`` does), then a resume from the
checkpoint (``trainer.fit(ckpt_path=...)`` for one more step).

- ``lightning_auto``: the default strategy, everything in RAM, one ``torch.save`` file;
- ``greedysnake``: state on SSD (bf16 weights, fp32 master and moments), saved by streaming each unit
  into the checkpoint directory (the second save hard-links the first's files).

Reports: save seconds (first and second save), load seconds, the checkpoint's bytes on disk (hard links
counted once) relative to the model state (weights, master weights and Adam moments as the offload
files hold them), the peak RSS of the process, and the ratios to Lightning's.

    python benchmarks/checkpoint.py                      # GPT 1024x12 (168M), bf16-mixed
    python benchmarks/checkpoint.py --n-layer 4
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

SYSTEMS = ["lightning_auto", "greedysnake"]


def disk_bytes(*paths: Path) -> int:
    """Bytes of the files under ``paths`` (files or directories), each inode once (hard links)."""
    seen: set[int] = set()
    total = 0
    for path in paths:
        files = [str(path)] if path.is_file() else [os.path.join(r, n) for r, _, ns in os.walk(path) for n in ns]
        for name in files:
            st = os.stat(name)
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def run(args: argparse.Namespace, system: str) -> dict[str, Any]:
    import lightning as L

    from _common import gpt_module, token_loader
    from lightning_greedysnake import GreedySnakeStrategy

    Module, _ = gpt_module(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq)
    root = Path(args.dir) / system
    root.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    extra: dict[str, Any] = {}

    class Save(L.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if trainer.global_step == 1 and "save_s" not in times:
                for key, name in (("save_s", "first.ckpt"), ("second_save_s", "last.ckpt")):
                    t0 = time.perf_counter()
                    trainer.save_checkpoint(root / name)
                    times[key] = time.perf_counter() - t0
                manager = getattr(trainer.strategy, "tensor_manager", None)
                if manager is not None:
                    extra["state_bytes"] = sum(v for k, v in manager.placement.ssd_bytes().items()
                                               if k in ("weights", "master_weights", "optimizer_states"))

    def trainer(max_steps: int, callbacks: list) -> L.Trainer:
        strategy: Any = "auto" if system == "lightning_auto" else GreedySnakeStrategy(auto=False,
            offload_dir=root / "offload", offload={"return_weights": False})
        return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed",
                         max_steps=max_steps, accumulate_grad_batches=args.k, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, default_root_dir=root)

    t = trainer(1, [Save()])
    with t.init_module(empty_init=system != "lightning_auto"):
        module = Module()
    n_params = sum(p.numel() for p in module.parameters())
    t.fit(module, token_loader(args.vocab, args.seq, 2 * args.k))
    del t, module
    first, last = root / "first.ckpt", root / "last.ckpt"
    ckpt_bytes = disk_bytes(first)
    both_bytes = disk_bytes(first, last)

    t = trainer(2, [])
    with t.init_module(empty_init=system != "lightning_auto"):
        module = Module()
    t0 = time.perf_counter()

    class Loaded(L.Callback):
        def on_train_start(self, trainer: Any, *a: Any) -> None:
            times.setdefault("load_s", time.perf_counter() - t0)

    t.callbacks.append(Loaded())
    t.fit(module, token_loader(args.vocab, args.seq, 2 * args.k), ckpt_path=str(last))
    state = extra.get("state_bytes", 14 * n_params)  # bf16 weights + fp32 master + two fp32 moments
    return {
        "system": system, "params": n_params, "save_s": round(times["save_s"], 3),
        "second_save_s": round(times["second_save_s"], 3), "load_s": round(times["load_s"], 3),
        "unit_input_bytes": ckpt_bytes, "model_state_bytes": state,
        "checkpoint_over_state": round(ckpt_bytes / state, 3),
        "two_saves_bytes": both_bytes, "two_saves_over_state": round(both_bytes / state, 3),
        "save_GBps": round(ckpt_bytes / times["save_s"] / 1e9, 2),
        "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


def main() -> None:
    from _common import MODEL_FLAGS, add_model_args, print_table, run_child, write_result

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, n_layer=12, seq=128)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where checkpoints and offload files go (default: a temp dir)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "checkpoint.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run(args, args.child)))
        return
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for system in SYSTEMS:
            rows.append(run_child(__file__, system, args, [*MODEL_FLAGS, "k"], ["--dir", tmp]))
            print(f"  done {system}", file=sys.stderr)
    base = rows[0]
    for row in rows:
        row["save_vs_lightning"] = round(row["save_s"] / base["save_s"], 2)
        row["load_vs_lightning"] = round(row["load_s"] / base["load_s"], 2)
    print_table(rows, ["system", "save_s", "second_save_s", "load_s", "checkpoint_over_state",
                       "two_saves_over_state", "save_GBps", "peak_rss_MB", "save_vs_lightning", "load_vs_lightning"])
    write_result(args.out, args, [*MODEL_FLAGS, "k"], rows)


if __name__ == "__main__":
    main()
