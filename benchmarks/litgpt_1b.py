"""A ~1B LitGPT model fine-tuned with greedysnake from the meta device with its state on SSD: peak RSS,
SSD bytes per step and step time (issue 38's "how we will know"; run it on a quiet machine).

    pip install -e ".[litgpt]"
    python benchmarks/litgpt_1b.py --offload-dir /mnt/nvme/gs          # Llama-3.2-1B, seq 256, K=4, 2 steps
    python benchmarks/litgpt_1b.py --name Qwen2.5-0.5B --precision bf16-mixed
    python benchmarks/litgpt_1b.py --n-layer 2 --n-embd 64 --vocab 256  # a smoke run (tiny override)

The model (``LitGPTModule``, random weights) is built inside ``trainer.init_module(empty_init=True)`` and
materialized unit by unit into the offload directory; weights, master weights, optimizer state and
gradients on SSD (``auto=False``), ``return_weights=False`` (a model larger than RAM is not copied back).
Peak RSS is this process's (``ru_maxrss``); SSD bytes per step are the tensor manager's counters over each
optimizer step; the first step includes the warm-up. Prints the rows and writes JSON (default
``benchmarks/results/litgpt_1b.json``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def run(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.recipes.litgpt_module import LitGPTModule

    overrides = {k: v for k, v in {"n_layer": args.n_layer, "n_embd": args.n_embd, "vocab_size": args.vocab,
                                   "padded_vocab_size": args.vocab}.items() if v is not None}
    if args.n_embd is not None:  # keep the heads' shape consistent with a smaller width
        overrides.update(n_head=4, n_query_groups=2, head_size=args.n_embd // 4, intermediate_size=2 * args.n_embd)

    class Steps(L.Callback):
        def __init__(self) -> None:
            self.rows: list[dict[str, float]] = []
            self._t, self._io = time.perf_counter(), {}

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self._t, self._io = time.perf_counter(), self._counters(trainer)

        def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
            if (trainer.fit_loop.epoch_loop.batch_idx + 1) % args.k:
                return
            now, io = time.perf_counter(), self._counters(trainer)
            delta = {k: v - self._io.get(k, 0.0) for k, v in io.items()}
            self.rows.append({
                "step": len(self.rows) + 1, "step_s": round(now - self._t, 3),
                "ssd_read_gb": round(sum(v for k, v in delta.items() if k.endswith("bytes_read")) / 1e9, 3),
                "ssd_written_gb": round(sum(v for k, v in delta.items() if k.endswith("bytes_written")) / 1e9, 3),
                "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)})
            self._t, self._io = time.perf_counter(), io

        @staticmethod
        def _counters(trainer: Any) -> dict[str, float]:
            manager = trainer.strategy.tensor_manager
            manager.flush()  # (the step's writes are counted once they land)
            return {k: v for k, v in manager.stats.flat().items() if k.startswith("ssd/")}

    root = Path(args.offload_dir or tempfile.mkdtemp(prefix="greedysnake_litgpt_"))
    strategy = GreedySnakeStrategy(auto=False, offload_dir=root / "offload", offload={"return_weights": False})
    steps = Steps()
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, accumulate_grad_batches=args.k, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[steps], default_root_dir=str(root))
    with trainer.init_module(empty_init=True):
        module = LitGPTModule(args.name, overrides=overrides, block_size=args.seq, lr=1e-5, warmup_steps=0)
    vocab = min(module.config.vocab_size, 32000)
    data = torch.randint(0, vocab, (args.k * args.steps, args.seq + 1), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=1))
    params = sum(p.numel() for p in module.parameters())
    return {"settings": {"model": module.config.name, "params": params, "seq": args.seq, "k": args.k,
                         "precision": args.precision, "offload_dir": str(root / "offload")},
            "rows": steps.rows,  # (one per optimizer step: its seconds and its own SSD bytes)
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="Llama-3.2-1B", help="a LitGPT config name")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--offload-dir", default=None, help="the SSD directory (default: a temp dir)")
    parser.add_argument("--n-layer", type=int, default=None, help="override (a smoke run)")
    parser.add_argument("--n-embd", type=int, default=None, help="override (a smoke run)")
    parser.add_argument("--vocab", type=int, default=None, help="override (a smoke run)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "litgpt_1b.json"))
    args = parser.parse_args()
    result = run(args)
    settings = result["settings"]
    print(f"{settings['model']}: {settings['params'] / 1e9:.2f}B parameters, peak RSS {result['peak_rss_gb']} GB")
    for row in result["rows"]:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
