"""What a LoRA run's checkpoint costs (issue 70, item 5): LitGPT's LoRA model (``litgpt.lora.GPT``, only the
adapters trained), a full checkpoint (the base saved with every checkpoint, as Lightning saves it) against the
adapters only (LitGPT's ``lit_model.pth.lora``: ``{"model": {k: v for k, v in state_dict if lora_filter(k, v)}}``,
written inside ``trainer.strategy.parameters_readable(trainable_only=True)``), in bytes on disk and seconds to save,
under greedysnake (every kind on SSD) and under Lightning's own strategy. Each save runs ``--saves`` times from a
Callback after each of ``--saves`` optimizer steps (where ``ModelCheckpoint`` saves); the median is reported.

    python benchmarks/lora_checkpoint.py [--layers 4] [--embd 512] [--vocab 8192] [--r 8] [--saves 3]

Writes benchmarks/results/lora_checkpoint.json. Seconds, on a CPU; run on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bytes_under(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(strategy: Any, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from litgpt.lora import GPT, Config, lora_filter, mark_only_lora_as_trainable

    from tests.helpers import make_trainer, token_loader

    class LoRAModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = Config.from_name(
                "Llama-3.2-1B", n_layer=args.layers, n_embd=args.embd, n_head=8, n_query_groups=2,
                head_size=args.embd // 8, intermediate_size=args.embd * 4, vocab_size=args.vocab,
                padded_vocab_size=args.vocab, block_size=32, lora_r=args.r, lora_alpha=2 * args.r, lora_dropout=0.0,
                lora_query=True, lora_value=True, lora_projection=True)
            self.model = GPT(config)
            mark_only_lora_as_trainable(self.model)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    out: dict[str, Any] = {}

    full: list[float] = []
    lora: list[float] = []

    class Saves(L.Callback):
        """After every optimizer step (where ModelCheckpoint saves): a full checkpoint, then the adapters only.
        Each save is of a new step (greedysnake links the files of a save at the same step instead of writing)."""

        def on_train_batch_end(self, trainer: Any, module: Any, *rest: Any) -> None:
            if trainer.fit_loop.epoch_loop._should_accumulate():
                return
            step = trainer.global_step
            path = root / f"full{step}.ckpt"
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            full.append(time.perf_counter() - start)
            out["full_bytes"] = bytes_under(path)
            if path.is_dir():  # (greedysnake's directory: what its parts take)
                out["full_parts_bytes"] = {part.name: bytes_under(part) for part in
                                           next(p for p in path.iterdir() if p.is_dir()).iterdir()}
            lora_path = root / f"lit_model{step}.pth.lora"
            readable = getattr(trainer.strategy, "parameters_readable", None)
            start = time.perf_counter()
            with readable(trainable_only=True) if readable is not None else contextlib.nullcontext():
                state = {k: v.clone() for k, v in module.model.state_dict().items() if lora_filter(k, v)}
            torch.save({"model": state}, lora_path)
            lora.append(time.perf_counter() - start)
            out["adapters_bytes"] = bytes_under(lora_path)

    L.seed_everything(0, verbose=False)
    module = LoRAModule()
    params = list(module.parameters())
    out["base_params"] = sum(p.numel() for p in params if not p.requires_grad)
    out["adapter_params"] = sum(p.numel() for p in params if p.requires_grad)
    trainer = make_trainer(strategy, 2, max_epochs=1, callbacks=[Saves()], default_root_dir=root)
    trainer.fit(module, token_loader(2 * args.saves, vocab=args.vocab, seq=32))
    out["full_save_s"], out["adapters_save_s"] = statistics.median(full), statistics.median(lora)
    out["full_save_s_each"], out["adapters_save_s_each"] = full, lora
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "lora_checkpoint.json")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import torch

    from lightning_greedysnake import GreedySnakeStrategy, OffloadConfig

    torch.set_num_threads(max(1, torch.get_num_threads()))
    results: dict[str, Any] = {"model": vars(args) | {"out": None, "family": "litgpt.lora.GPT (Llama-3.2 config)",
                                                       "precision": "32-true"}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, strategy in (("greedysnake_ssd", GreedySnakeStrategy(auto=False,
                                                                        offload=OffloadConfig.everywhere("ssd"))),
                               ("lightning_auto", "auto")):
            root = Path(tmp) / name
            root.mkdir()
            results[name] = measure(strategy, args, root)
    for name in ("greedysnake_ssd", "lightning_auto"):
        r = results[name]
        print(f"{name:16s} full checkpoint {r['full_bytes'] / 2**20:8.2f} MiB in {r['full_save_s'] * 1e3:7.1f} ms; "
              f"adapters only {r['adapters_bytes'] / 2**20:6.3f} MiB in {r['adapters_save_s'] * 1e3:6.1f} ms "
              f"({r['full_bytes'] / r['adapters_bytes']:.0f}x smaller)")
    gs = results["greedysnake_ssd"]
    print(f"model: {gs['base_params'] / 1e6:.2f} M frozen base parameters, {gs['adapter_params'] / 1e6:.3f} M "
          "adapter parameters (fp32)")
    if "full_parts_bytes" in gs:
        print("greedysnake's checkpoint directory: " + ", ".join(
            f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(gs["full_parts_bytes"].items())))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/lora_checkpoint.py " + " ".join(sys.argv[1:])
    rows = [{"system": name, **results[name]} for name in ("greedysnake_ssd", "lightning_auto")]
    args.out.write_text(json.dumps({"command": command.strip(), "model": results["model"], "rows": rows},
                                   indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
