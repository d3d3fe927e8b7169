"""LoRA fine-tuning with greedysnake: LitGPT's LoRA or Hugging Face PEFT's, on the byte corpus (no download).

    pip install -e ".[litgpt]"                  # family=litgpt;  family=peft: pip install -e ".[hf]" "peft>=0.13"
    python examples/finetune_lora.py                                 # litgpt.lora.GPT, tiny Llama-shaped, CPU (~2 min)
    python examples/finetune_lora.py family=peft                     # transformers Llama + get_peft_model, bf16 base
    python examples/finetune_lora.py lora.r=16 lora.alpha=32 lora.targets=[query,value]
    python examples/finetune_lora.py litgpt.checkpoint_dir=checkpoints/meta-llama/Llama-3.2-1B \\
        litgpt.overrides=null trainer=gpu                            # from `litgpt download` weights
    python examples/finetune_lora.py family=peft peft.pretrained=path/to/save_pretrained/dir trainer=gpu

The base is frozen and read-only under greedysnake (read with its unit, never written, no gradient, optimizer
state or master copy); AdamW steps the adapters only. With no checkpoint the base is built from its config
with random weights. At the start it prints the trainable and frozen parameter counts; at the end the
training loss, first and last, and where the adapters went, saved after ``trainer.fit`` returns (the trained
parameters are back in the module then), each family's own way: LitGPT's ``lit_model.pth.lora`` (only the
``lora_`` tensors, under ``"model"``, as ``litgpt finetune_lora`` writes it and ``litgpt merge_lora`` reads
it) beside ``model_config.yaml``; PEFT's ``save_pretrained`` directory (``adapter_config.json``,
``adapter_model.safetensors``; ``PeftModel.from_pretrained(base, path)`` loads it). docs/how-to/lora.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import lightning_greedysnake  # noqa: F401  (registers the strategy names)

TARGETS = ("query", "key", "value", "projection", "mlp", "head")
"""``lora.targets``' names, the same for both families."""

HF_MODULES = {"query": ["q_proj"], "key": ["k_proj"], "value": ["v_proj"], "projection": ["o_proj"],
              "mlp": ["gate_proj", "up_proj", "down_proj"], "head": ["lm_head"]}
"""Each name's modules in a Llama-style transformers model (Llama, Qwen2, Mistral, ...); PEFT takes any other
module name as it is."""


class LoRAModule(L.LightningModule):
    """A causal LM whose trainable parameters are its adapters: AdamW over those only."""

    def __init__(self, model: torch.nn.Module, family: str, lr: float, weight_decay: float) -> None:
        super().__init__()
        self.model, self.family, self.lr, self.weight_decay = model, family, lr, weight_decay

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch  # y is x shifted by one token (the data module's convention)
        logits = self.model(x) if self.family == "litgpt" else self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr,
                                 weight_decay=self.weight_decay)


class LossHistory(L.Callback):
    """The training loss of every micro-batch, for the closing summary."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if outputs is not None:  # (Lightning hands back the loss divided by accumulate_grad_batches)
            self.losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)


def litgpt_lora(cfg: DictConfig) -> tuple[torch.nn.Module, Any]:
    """``litgpt.lora.GPT`` with ``mark_only_lora_as_trainable``, as ``litgpt finetune_lora`` sets it up."""
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    lora = cfg.lora
    unknown = sorted(set(lora.targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"lora.targets has {unknown} for family=litgpt. Fix: names among {list(TARGETS)}.")
    fields = dict(lora_r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                  **{f"lora_{t}": t in lora.targets for t in TARGETS})
    overrides = OmegaConf.to_container(cfg.litgpt.overrides, resolve=True) if cfg.litgpt.overrides else {}
    checkpoint_dir = cfg.litgpt.checkpoint_dir
    if checkpoint_dir is not None:
        config = Config.from_file(Path(checkpoint_dir) / "model_config.yaml", **overrides, **fields)
    else:
        config = Config.from_name(cfg.litgpt.name, **overrides, **fields)
    model = GPT(config)
    model.max_seq_length = cfg.block_size  # (sizes the rope cache)
    if checkpoint_dir is not None:  # the base's weights; the adapters keep their init (B = 0: the base's output)
        state = torch.load(Path(checkpoint_dir) / "lit_model.pth", mmap=True, weights_only=True)
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if "lora_" not in k]
        if missing or result.unexpected_keys:
            raise ValueError(f"{checkpoint_dir}/lit_model.pth does not fit its model_config.yaml: missing {missing[:5]}, "
                             f"unexpected {result.unexpected_keys[:5]}. Fix: a directory `litgpt download` wrote.")
    mark_only_lora_as_trainable(model)
    return model, config


def peft_lora(cfg: DictConfig) -> torch.nn.Module:
    """A transformers causal LM, its base in ``peft.base_dtype``, with ``peft.get_peft_model``'s adapters in fp32."""
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, cfg.peft.base_dtype)
    if cfg.peft.pretrained is not None:
        base = AutoModelForCausalLM.from_pretrained(cfg.peft.pretrained)
    else:
        config = OmegaConf.to_container(cfg.peft.config, resolve=True)
        base = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    base = base.to(dtype)
    targets = [m for t in cfg.lora.targets for m in HF_MODULES.get(t, [t])]
    lora = peft.LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                           target_modules=targets, task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lora)
    for p in model.parameters():  # the adapters in fp32 (greedysnake steps trained parameters on fp32 masters)
        if p.requires_grad:
            p.data = p.data.float()
    return model


def save_adapters(family: str, model: torch.nn.Module, config: Any, out: Path) -> Path:
    """Only the adapters, each family's way. Called after fit: the trained parameters are in the module."""
    out.mkdir(parents=True, exist_ok=True)
    if family == "litgpt":
        from litgpt.lora import lora_filter
        from litgpt.utils import save_config

        lora = {k: v.detach().cpu() for k, v in model.state_dict().items() if lora_filter(k, v)}
        path = out / "lit_model.pth.lora"
        torch.save({"model": lora}, path)  # litgpt finetune_lora's format, read by litgpt merge_lora
        save_config(config, out)
        return path
    # adapter_config.json + adapter_model.safetensors; save_embedding_layers=False: the adapters only (PEFT would
    # add the frozen lm_head's whole weight when it is a target)
    model.save_pretrained(out, save_embedding_layers=False)
    return out / "adapter_model.safetensors"


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune_lora")
def main(cfg: DictConfig) -> dict[str, Any]:
    print(OmegaConf.to_yaml(cfg))
    if cfg.family not in ("litgpt", "peft"):
        raise ValueError(f"family={cfg.family!r} is not one of litgpt, peft. Fix: family=litgpt or family=peft.")
    # the strategy first: a bad setting is refused before the model is built
    strategy = instantiate(cfg.strategy) if "_target_" in cfg.strategy else cfg.strategy.name
    L.seed_everything(cfg.seed)
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    model, config = litgpt_lora(cfg) if cfg.family == "litgpt" else (peft_lora(cfg), None)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    base_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if not p.requires_grad})
    print(f"{cfg.family} LoRA (r={cfg.lora.r}, alpha={cfg.lora.alpha}, targets={list(cfg.lora.targets)}): "
          f"{trainable:,} trainable parameters ({100 * trainable / (trainable + frozen):.2f}%), "
          f"{frozen:,} frozen ({'/'.join(base_dtypes)}, read-only)")
    module = LoRAModule(model, cfg.family, cfg.lora.lr, cfg.lora.weight_decay)
    history = LossHistory()
    trainer = L.Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), strategy=strategy,
                        default_root_dir=out_dir, logger=False, callbacks=[history])
    trainer.fit(module, instantiate(cfg.data))
    # after fit: greedysnake has put the trained adapters back into the module
    path = save_adapters(cfg.family, model, config, Path(cfg.out_dir) if cfg.out_dir else out_dir / "adapters")
    losses = history.losses
    n = max(1, min(20, len(losses) // 4))
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    print(f"trained {trainer.global_step} optimizer steps: train loss {first:.3f} (first {n} micro-batches) -> "
          f"{last:.3f} (last {n})")
    print(f"adapters saved to {path}")
    return {"steps": trainer.global_step, "first_train_loss": first, "last_train_loss": last, "adapters": str(path)}


if __name__ == "__main__":
    main()
