"""The README's example runs end to end (a few steps) and its overrides work."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["trainer.accumulate_grad_batches=4", "strategy.schedule=horizontal", "model.n_layer=3"],
        ["strategy=lightning_auto"],
        ["strategy=greedysnake_cpu"],
        ["strategy.offload.activations=ssd", "strategy.offload.path=${hydra:runtime.output_dir}/offload"],
        ["trainer.precision=machine"],
    ],
    ids=["defaults", "horizontal-overrides", "lightning-auto", "cpu-preset", "offload-overrides", "machine-precision"],
)
def test_train_gpt_example(tmp_path, overrides):
    command = [
        sys.executable,
        str(ROOT / "examples" / "train_gpt.py"),
        "trainer.max_steps=6",
        "trainer.val_check_interval=5",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "data.max_bytes=200000",
        f"hydra.run.dir={tmp_path}",
        *overrides,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trained 6 optimizer steps" in result.stdout
    if "strategy=lightning_auto" not in overrides and "strategy=greedysnake_cpu" not in overrides:
        # the example's default strategy puts the weights and optimizer state on SSD: it shows real traffic,
        # in the strategy's own end-of-fit summary (Lightning's log, on stderr)
        said = result.stdout + result.stderr
        assert said.count("greedysnake: what moved where in this fit (6 optimizer steps") == 1, said[-3000:]
        traffic = re.search(r"SSD traffic: ([0-9.]+) MB read, ([0-9.]+) MB written", said)
        assert traffic and float(traffic[1]) > 0 and float(traffic[2]) > 0, said[-3000:]
    if "trainer.precision=machine" in overrides:
        assert "precision=machine: bf16-mixed on this CPU" in result.stdout or "32-true on this CPU" in result.stdout
    assert (tmp_path / "logs").is_dir()
    metrics = list((tmp_path / "logs").rglob("metrics.csv"))
    assert metrics and "train_loss" in metrics[0].read_text()


def test_bad_override_is_a_clear_error_before_data_and_model_are_built(tmp_path):
    """The strategy's settings are checked first: with a data module that cannot even be built, the
    refusal is still the strategy's (the data and the model are built after it)."""
    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "strategy.schedule=diagonal",
               "data._target_=no.such.DataModule", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode != 0
    said = result.stderr + result.stdout
    assert "schedule='diagonal' is not valid. Fix:" in said, said[-3000:]
    assert "Error locating target 'no.such.DataModule'" not in said, said[-3000:]


@pytest.mark.parametrize("work_dir", [True, False], ids=["work-dir", "temporary"])
def test_finetune_hf_example(tmp_path, work_dir):
    """Trains with the state on SSD (non-zero traffic); what it wrote stays in --work-dir, and without one
    its temporary directory is removed at the end (nothing left in TMPDIR)."""
    pytest.importorskip("transformers")
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    tmp.mkdir()
    command = [sys.executable, str(ROOT / "examples" / "finetune_hf.py"), *(["--work-dir", str(work)] if work_dir else []),
               "--steps", "4", "--layers", "2", "--hidden", "64", "--accumulate", "2", "--seq", "32"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env={**os.environ, "TMPDIR": str(tmp)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "validation loss:" in result.stdout and "from_pretrained" in result.stdout
    traffic = re.search(r"SSD traffic: ([0-9.]+) MB read, ([0-9.]+) MB written", result.stdout)
    assert traffic and float(traffic[1]) > 0 and float(traffic[2]) > 0, result.stdout[-3000:]
    if work_dir:
        assert (work / "finetuned" / "model.safetensors").is_file()
    else:
        # (torch's own caches, torchinductor_<user>, may stay in TMPDIR: they are not the example's)
        assert "removed " in result.stdout and not list(tmp.glob("greedysnake_hf_*")), list(tmp.iterdir())


def test_finetune_litgpt_example(tmp_path):
    pytest.importorskip("litgpt")
    import torch
    from litgpt.config import Config
    from litgpt.model import GPT

    command = [sys.executable, str(ROOT / "examples" / "finetune_litgpt.py"), "trainer.max_steps=4",
               "trainer.val_check_interval=4", "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false",
               "data.max_bytes=200000", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "placement" in result.stdout and "trained 4 optimizer steps" in result.stdout
    model = GPT(Config.from_file(tmp_path / "litgpt" / "model_config.yaml"))
    model.load_state_dict(torch.load(tmp_path / "litgpt" / "lit_model.pth", weights_only=True), strict=True)


LORA_QUICK = ["trainer.max_steps=4", "trainer.accumulate_grad_batches=2", "trainer.enable_progress_bar=false",
              "data.max_bytes=200000", "data.batch_size=2", "block_size=64"]


@pytest.mark.parametrize("family", ["litgpt", "peft"])
def test_finetune_lora_example(tmp_path, family):
    """Both families train (the loss goes down) with the base frozen, and the adapters are saved each family's
    way holding the LoRA tensors only: LitGPT's lit_model.pth.lora (every trainable tensor of the model its
    model_config.yaml builds, nothing else), PEFT's save_pretrained directory (fp32 lora_ tensors)."""
    pytest.importorskip("litgpt" if family == "litgpt" else "peft")
    import torch

    command = [sys.executable, str(ROOT / "examples" / "finetune_lora.py"), f"family={family}", *LORA_QUICK,
               f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    counts = re.search(r"LoRA .*: ([0-9,]+) trainable parameters .*, ([0-9,]+) frozen \((\w+), read-only\)",
                       result.stdout)
    assert counts, result.stdout[-3000:]
    trainable, frozen = (int(counts[i].replace(",", "")) for i in (1, 2))
    assert 0 < trainable < frozen
    assert counts[3] == ("float32" if family == "litgpt" else "bfloat16")
    loss = re.search(r"trained 4 optimizer steps: train loss ([0-9.]+) .* -> ([0-9.]+)", result.stdout)
    assert loss and float(loss[2]) < float(loss[1]), result.stdout[-3000:]
    out = tmp_path / "adapters"
    if family == "litgpt":
        from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

        saved = torch.load(out / "lit_model.pth.lora", weights_only=True)["model"]
        model = GPT(Config.from_file(out / "model_config.yaml"))
        mark_only_lora_as_trainable(model)
        assert set(saved) == {n for n, p in model.named_parameters() if p.requires_grad}
        assert all("lora_" in n for n in saved) and sum(t.numel() for t in saved.values()) == trainable
        assert not model.load_state_dict(saved, strict=False).unexpected_keys
    else:
        from safetensors.torch import load_file

        saved = load_file(out / "adapter_model.safetensors")
        assert (out / "adapter_config.json").is_file()
        assert saved and all("lora_" in n and t.dtype == torch.float32 for n, t in saved.items()), list(saved)
        assert sum(t.numel() for t in saved.values()) == trainable
