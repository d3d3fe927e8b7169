"""Train a small GPT with the greedysnake strategy on a byte-level corpus of the Python stdlib.

    python examples/train_gpt.py                                  # defaults: CPU, weights and optimizer state on SSD
    python examples/train_gpt.py trainer.max_steps=20 trainer.accumulate_grad_batches=4 \
        strategy.schedule=horizontal model.n_layer=4
    python examples/train_gpt.py strategy=greedysnake             # the planner places the state (here: in RAM)
    python examples/train_gpt.py strategy=lightning_auto           # Lightning's default, for comparison

The default strategy is ``conf/strategy/greedysnake_ssd.yaml``: the model's weights, master weights and
optimizer state live in the offload directory (``<run dir>/greedysnake_offload``; ``strategy.offload.path``
to put it on an NVMe), and the closing summary prints the SSD traffic: the strategy's own end-of-fit summary
(what moved where, per kind of tensor, in all and per optimizer step; any LightningModule gets it), then
the losses.
"""

from __future__ import annotations

import os
from typing import Any

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

import lightning_greedysnake  # noqa: F401  (registers the strategy names)
from lightning_greedysnake.recipes import GPTLightningModule


class LossHistory(L.Callback):
    """Keeps the training loss of every micro-batch, for the closing summary."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if outputs is not None:
            # Lightning hands back the loss already divided by accumulate_grad_batches (what it
            # back-propagates); undo that to report the training_step's own loss
            self.losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)


def build_strategy(cfg: DictConfig) -> Any:
    if "_target_" in cfg:
        return instantiate(cfg)
    return cfg.name


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> dict[str, float]:
    print(OmegaConf.to_yaml(cfg))
    # the strategy first: a bad setting (strategy.schedule=diagonal) is refused in a second, before the
    # data and the model are built
    strategy = build_strategy(cfg.strategy)
    L.seed_everything(cfg.seed)
    module = GPTLightningModule(instantiate(cfg.model), **cfg.module)
    datamodule = instantiate(cfg.data)
    out_dir = HydraConfig.get().runtime.output_dir
    history = LossHistory()
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    if trainer_args.get("precision") == "machine":
        # bf16-mixed where this CPU computes bf16 natively, 32-true where it would be ~100x slower
        from lightning_greedysnake.precision import SLOW_BF16_FACTOR, cpu_bf16_slowdown

        trainer_args["precision"] = "bf16-mixed" if cpu_bf16_slowdown() < SLOW_BF16_FACTOR else "32-true"
        print(f"precision=machine: {trainer_args['precision']} on this CPU")
    trainer = L.Trainer(
        **trainer_args,
        strategy=strategy,
        default_root_dir=out_dir,
        logger=CSVLogger(out_dir, name="logs"),
        callbacks=[history],
    )
    trainer.fit(module, datamodule)
    losses = history.losses
    n = max(1, min(20, len(losses) // 4))
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    result = {"first_train_loss": first, "last_train_loss": last, "steps": trainer.global_step}
    val = trainer.callback_metrics
    if "val_ppl" in val:
        result["val_ppl"] = float(val["val_ppl"])
    print(
        f"\ntrained {trainer.global_step} optimizer steps with strategy={type(trainer.strategy).__name__}: "
        f"train loss {first:.3f} -> {last:.3f} (mean of first/last {n} micro-batches)"
        + (f", validation perplexity {result['val_ppl']:.2f}" if "val_ppl" in result else "")
        + f"\nlogs: {os.path.join(out_dir, 'logs')}"
    )
    return result


if __name__ == "__main__":
    main()
