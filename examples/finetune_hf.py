"""Fine-tune a Hugging Face Llama-style model with greedysnake, entirely offline, and export it back.

    pip install -e ".[hf]"
    python examples/finetune_hf.py                       # in a temporary directory, removed at the end
    python examples/finetune_hf.py --steps 60 --layers 8 --work-dir /mnt/nvme/ft   # kept there

1. Creates a small Llama config locally and saves a randomly initialized model with ``save_pretrained``:
   the stand-in for a downloaded checkpoint (nothing is fetched from the hub).
2. Builds :class:`HFCausalLMModule` on the meta device and fine-tunes it with ``strategy="greedysnake"``:
   the pretrained weights stream from the safetensors file into the tensor manager one unit at a time,
   weights, master weights and optimizer state live in the offload directory (placed there explicitly:
   left to the planner, a model this small would stay in RAM), on a byte-level corpus of the Python
   standard library. The SSD traffic is printed at the end.
3. Exports the result with ``export_hf`` and loads it back with ``AutoModelForCausalLM.from_pretrained``,
   checking that it gives the trained model's loss.

Without ``--work-dir`` everything (base model, offload files, checkpoints, export) goes to a temporary
directory that is removed at the end, also when the run fails.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_greedysnake import GreedySnakeStrategy
from lightning_greedysnake.recipes.data import StdlibBytesDataModule
from lightning_greedysnake.recipes.hf_module import HFCausalLMModule, export_hf


def mean_loss(model: torch.nn.Module, loader: torch.utils.data.DataLoader, batches: int = 8) -> float:
    model.eval()
    losses = []
    with torch.no_grad():
        for i, (x, y) in enumerate(loader):
            if i == batches:
                break
            logits = model(input_ids=x).logits
            losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)).item())
    return sum(losses) / len(losses)


class SSDTraffic(L.Callback):
    """The offload directory's traffic, read before teardown closes the tensor manager."""

    def __init__(self) -> None:
        self.read_bytes = self.written_bytes = 0

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        stats = trainer.strategy.io_stats()
        self.read_bytes = int(sum(v for k, v in stats.items() if k.startswith("ssd/") and k.endswith("/bytes_read")))
        self.written_bytes = int(sum(v for k, v in stats.items()
                                     if k.startswith("ssd/") and k.endswith("/bytes_written")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=None, help="where the base model, checkpoints and export go")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    if args.work_dir is not None:
        work = Path(args.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        finetune(args, work)
        return
    work = Path(tempfile.mkdtemp(prefix="greedysnake_hf_"))
    try:
        finetune(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        print(f"removed {work} (pass --work-dir to keep the base model, checkpoints and export)")


def finetune(args: argparse.Namespace, work: Path) -> None:
    config = {"model_type": "llama", "vocab_size": 256, "hidden_size": args.hidden,
              "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 8,
              "num_key_value_heads": 4, "max_position_embeddings": args.seq, "tie_word_embeddings": False}
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    base.save_pretrained(work / "base")
    print(f"base model: {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters in {work / 'base'}")

    data = StdlibBytesDataModule(block_size=args.seq, batch_size=1, max_bytes=400_000)
    data.setup()
    before = mean_loss(base, data.val_dataloader())
    del base

    # the state on SSD (the offload directory: <work>/greedysnake_offload); gradients and saved
    # activations are left to the planner
    strategy = GreedySnakeStrategy(offload={"weights": "ssd", "master_weights": "ssd", "optimizer_states": "ssd"})
    traffic = SSDTraffic()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", precision="bf16-mixed", max_steps=args.steps,
        accumulate_grad_batches=args.accumulate, default_root_dir=work, logger=False, limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=work / "checkpoints", save_last=True), traffic],
    )
    with trainer.init_module(empty_init=True):  # parameters on meta: materialized unit by unit
        module = HFCausalLMModule(config, pretrained=str(work / "base"), lr=1e-3, warmup_steps=5)
    trainer.fit(module, data)
    print(f"SSD traffic: {traffic.read_bytes / 1e6:.1f} MB read, {traffic.written_bytes / 1e6:.1f} MB written "
          f"({traffic.read_bytes / max(1, trainer.global_step) / 1e6:.2f} MB read per optimizer step)")

    out = export_hf(work / "checkpoints" / "last.ckpt", work / "finetuned")
    finetuned = AutoModelForCausalLM.from_pretrained(out)
    after = mean_loss(finetuned, data.val_dataloader())
    print(f"validation loss: {before:.3f} before, {after:.3f} after {args.steps} steps")
    print(f"exported to {out} (loads with AutoModelForCausalLM.from_pretrained)")


if __name__ == "__main__":
    main()
