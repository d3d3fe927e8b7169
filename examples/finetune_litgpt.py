"""Full fine-tuning of a LitGPT model with greedysnake, on the byte corpus (no download), exported back for
LitGPT.

    pip install -e ".[litgpt]"
    python examples/finetune_litgpt.py                                   # tiny Llama-3.2-1B-shaped model, CPU
    python examples/finetune_litgpt.py model.name=Qwen2.5-0.5B model.overrides=null \\
        strategy.offload.path=/mnt/nvme/gs trainer=gpu                   # the real size, state on the SSD
    python examples/finetune_litgpt.py model.checkpoint_dir=checkpoints/meta-llama/Llama-3.2-1B \\
        model.overrides=null trainer=gpu                                 # from `litgpt download` weights

The model is built on the meta device (``trainer.init_module(empty_init=True)``): greedysnake materializes
it unit by unit, from ``model.checkpoint_dir``'s ``lit_model.pth`` when given, so it never exists whole in
RAM. The placement (what went to RAM, what to SSD) is printed at the start; at the end the last checkpoint
is exported to a LitGPT checkpoint directory (``lit_model.pth``, ``model_config.yaml`` and the tokenizer
files of ``checkpoint_dir``) that ``litgpt generate`` and ``litgpt chat`` load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

import lightning_greedysnake  # noqa: F401  (registers the strategy names)
from lightning_greedysnake.recipes.litgpt_module import LitGPTModule, export_litgpt


class PlacementReport(L.Callback):
    """Prints where greedysnake put each kind of state (the planner's table when it placed them)."""

    def on_train_start(self, trainer: Any, module: Any) -> None:
        strategy = trainer.strategy
        plan = getattr(strategy, "placement_plan", None)
        if plan is not None:
            print(f"placement (planned):\n{plan.table()}")
        elif hasattr(strategy, "config"):
            offload = strategy.config.offload
            kinds = ("weights", "master_weights", "optimizer_states", "gradients", "activations")
            print("placement: " + ", ".join(f"{k}={getattr(offload, k)}" for k in kinds))
        else:
            print(f"placement: everything on the device ({type(strategy).__name__})")


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune_litgpt")
def main(cfg: DictConfig) -> dict[str, Any]:
    print(OmegaConf.to_yaml(cfg))
    L.seed_everything(cfg.seed)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    strategy = instantiate(cfg.strategy) if "_target_" in cfg.strategy else cfg.strategy.name
    checkpoints = ModelCheckpoint(dirpath=out_dir / "checkpoints", save_last=True)
    trainer = L.Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), strategy=strategy,
                        default_root_dir=out_dir, logger=False, callbacks=[PlacementReport(), checkpoints])
    model = OmegaConf.to_container(cfg.model, resolve=True)
    with trainer.init_module(empty_init=strategy != "auto"):  # parameters on meta: materialized unit by unit
        module = LitGPTModule(**model, **OmegaConf.to_container(cfg.module, resolve=True))
    print(f"{module.config.name}: {sum(p.numel() for p in module.parameters()) / 1e6:.1f}M parameters")
    trainer.fit(module, instantiate(cfg.data))
    export = export_litgpt(out_dir / "checkpoints" / "last.ckpt", cfg.export_dir or out_dir / "litgpt",
                           copy_from=model["checkpoint_dir"])
    loss = trainer.callback_metrics.get("val_loss")
    print(f"trained {trainer.global_step} optimizer steps"
          + (f", validation loss {float(loss):.3f}" if loss is not None else "")
          + f"\nexported for LitGPT to {export.parent} (litgpt generate {export.parent})")
    return {"steps": trainer.global_step, "export": str(export)}


if __name__ == "__main__":
    main()
