"""Export: a checkpoint's weights as one safetensors file that the plain model class loads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_greedysnake import GPT, GreedySnakeStrategy
from lightning_greedysnake.export import export_checkpoint
from tests.helpers import (
    SequentialModule,
    TinyGPTModule,
    make_trainer,
    max_abs_diff,
    regression_loader,
    token_loader,
)


def _train(tmp_path: Path, module: L.LightningModule, loader, precision: str = "32-true") -> Path:
    L.seed_everything(0, verbose=False)
    trainer = make_trainer(GreedySnakeStrategy(auto=False), 2, max_epochs=1, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
                           precision=precision)
    trainer.fit(module, loader)
    return tmp_path / "ckpt" / "last.ckpt"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_round_trips_into_the_plain_model(tmp_path, dtype):
    module = TinyGPTModule(lr=3e-3)
    ckpt = _train(tmp_path, module, token_loader(6))
    out = export_checkpoint(ckpt, tmp_path / "export", dtype=dtype)
    assert out == tmp_path / "export" / "model.safetensors"
    plain = GPT(module.model.config)
    torch_dtype = getattr(torch, dtype)
    plain.load_state_dict({k: v.float() for k, v in load_file(out).items()}, strict=True)
    trained = {k: v.to(torch_dtype).float() for k, v in module.model.state_dict().items()}
    assert max_abs_diff(dict(plain.state_dict()), trained) == 0
    assert all(v.dtype == torch_dtype for v in load_file(out).values() if v.is_floating_point())


def test_bf16_training_exports_the_fp32_master_weights(tmp_path):
    module = TinyGPTModule(lr=3e-3)
    ckpt = _train(tmp_path, module, token_loader(6), precision="bf16-mixed")
    exported = load_file(export_checkpoint(ckpt, tmp_path / "w.safetensors"))
    assert all(v.dtype == torch.float32 for v in exported.values())
    assert max_abs_diff(exported, dict(module.model.state_dict())) == 0  # the master copy, not the bf16 one


def test_the_cli_writes_a_file_that_loads_without_greedysnake(tmp_path):
    module = SequentialModule()
    ckpt = _train(tmp_path, module, regression_loader(6))
    out = tmp_path / "net.safetensors"
    done = subprocess.run([sys.executable, "-m", "lightning_greedysnake.export", str(ckpt), str(out)],
                          capture_output=True, text=True, check=True)
    assert "wrote" in done.stdout
    expected = tmp_path / "expected.pt"
    torch.save({k: v.clone() for k, v in module.net.state_dict().items()}, expected)
    # a fresh interpreter where importing greedysnake fails: torch and safetensors alone load it
    check = textwrap.dedent(f"""
        import sys
        sys.modules["lightning_greedysnake"] = None
        import torch
        from torch import nn
        from safetensors.torch import load_file
        net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.LayerNorm(12), nn.Linear(12, 3))
        net.load_state_dict(load_file({str(out)!r}), strict=True)
        expected = torch.load({str(expected)!r}, weights_only=True)
        assert all(torch.equal(net.state_dict()[k], v) for k, v in expected.items())
        print("LOADED")
    """)
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert "LOADED" in done.stdout, done.stderr


def test_a_plain_lightning_checkpoint_exports_too(tmp_path):
    L.seed_everything(0, verbose=False)
    module = SequentialModule()
    trainer = make_trainer("auto", 2, max_epochs=1, enable_checkpointing=True,
                           callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    trainer.fit(module, regression_loader(4))
    out = export_checkpoint(tmp_path / "last.ckpt", tmp_path / "o.safetensors", keep_prefix=True)
    assert max_abs_diff(load_file(out), dict(module.state_dict())) == 0


def test_bad_dtype_and_missing_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"dtype='int4'"):
        export_checkpoint(tmp_path, tmp_path / "o.safetensors", dtype="int4")
    with pytest.raises(Exception, match=r"neither a greedysnake checkpoint directory nor a checkpoint file"):
        export_checkpoint(tmp_path / "nope.ckpt", tmp_path / "o.safetensors")


def test_the_cli_refuses_a_missing_or_damaged_checkpoint_in_one_line(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "lightning_greedysnake.export", "/nonexistent", "out"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().count("\n") == 0 and "/nonexistent does not exist. Fix:" in missing.stderr
    ckpt = _train(tmp_path, SequentialModule(), regression_loader(6))
    (ckpt / "CURRENT").unlink()
    damaged = subprocess.run([sys.executable, "-m", "lightning_greedysnake.export", str(ckpt), "out"],
                             capture_output=True, text=True)
    assert damaged.returncode == 1 and "Traceback" not in damaged.stderr
    assert "CURRENT is missing" in damaged.stderr and "Fix" in damaged.stderr
