"""Small LightningModules, data and a recording logger shared by the tests."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_greedysnake import GPT, GPTConfig


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call in memory: the real logger path, nothing written to disk."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def series(self, key: str) -> list[tuple[int | None, float]]:
        return [(step, m[key]) for step, m in self.records if key in m]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> dict[str, Any]:
    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps)

    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}


class OptimizerMixin:
    optimizer_name = "adamw"
    lr = 1e-2
    weight_decay = 0.1
    warmup_steps = 3
    scheduler_interval = "step"

    def configure_optimizers(self) -> Any:
        groups = param_groups(self, self.weight_decay)  # type: ignore[arg-type]
        if self.optimizer_name == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=self.lr)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(groups, lr=self.lr)
        elif self.optimizer_name == "sgd":
            opt = torch.optim.SGD(groups, lr=self.lr, momentum=0.9)
        else:
            raise ValueError(self.optimizer_name)
        if self.scheduler_interval == "epoch":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}
        return {"optimizer": opt, "lr_scheduler": warmup_scheduler(opt, self.warmup_steps)}


class TinyGPTModule(OptimizerMixin, L.LightningModule):
    def __init__(self, n_layer: int = 3, dropout: float = 0.0, **overrides: Any) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=32, block_size=8,
                                   dropout=dropout))
        for key, value in overrides.items():
            setattr(self, key, value)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("val_loss", loss)
        return loss


class SequentialModule(OptimizerMixin, L.LightningModule):
    def __init__(self, **overrides: Any) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.LayerNorm(12), nn.Linear(12, 3)
        )
        for key, value in overrides.items():
            setattr(self, key, value)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("val_loss", loss)
        return loss


def token_loader(num_batches: int, batch_size: int = 2, seq: int = 8, vocab: int = 32, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (num_batches * batch_size, seq + 1), generator=g)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch_size, shuffle=False)


def regression_loader(num_batches: int, batch_size: int = 4, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_batches * batch_size, 6, generator=g)
    y = torch.randn(num_batches * batch_size, 3, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class UnitGradients(L.Callback):
    """Every window's gradient as the tensor manager's stepper steps it (``param.grad`` is never populated
    with offloading), through the strategy's public :meth:`register_gradient_hook`, installed at the start
    of training. :meth:`windows` gives one dict per optimizer step."""

    def __init__(self) -> None:
        self.per_name: dict[str, list[torch.Tensor]] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        if getattr(trainer.strategy, "tensor_manager", None) is None:
            return
        trainer.strategy.register_gradient_hook(
            lambda name, grad: self.per_name.setdefault(name, []).append(grad.clone()))  # on the lane

    def windows(self) -> list[dict[str, torch.Tensor]]:
        if not self.per_name:
            return []
        steps = len(next(iter(self.per_name.values())))
        assert all(len(calls) == steps for calls in self.per_name.values()), "a unit missed a window"
        return [{n: calls[s] for n, calls in self.per_name.items()} for s in range(steps)]


class Grads(UnitGradients):
    """Every window's gradient: ``param.grad`` where Lightning steps resident parameters, else the tensor
    manager's accumulators (through the strategy's gradient hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.resident: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.resident.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})

    @property
    def grads(self) -> list[dict[str, torch.Tensor]]:
        return self.windows() if self.per_name else self.resident


NOISE = 1e-6
"""A reference gradient this small in every window is rounding noise: an attention's key bias, which
softmax does not see (one shift of all of a query's scores), or, under rotary embeddings, the part of it in
the slowest rotary pair, which over a short sequence barely rotates. Adam normalizes noise into lr-sized
steps, differently for any order of summation (and any CPU's kernels), so such weights are compared by
their gradients only."""


def assert_weights_match(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                         ref_windows: list[dict[str, torch.Tensor]], noisy: str, most: int) -> None:
    """Every weight to 1e-5, but those whose reference gradient is noise in every window (:data:`NOISE`,
    not exactly zero): only in parameters whose name ends with ``noisy`` (an attention's q/k/v bias), at
    most ``most`` elements of each. Compare the windows' gradients too: they hold these weights to account."""
    peak = {n: torch.stack([w[n].abs() for w in ref_windows]).amax(0) for n in ref if n in ref_windows[0]}
    noise_only = {n: (g < NOISE) & (g > 0) for n, g in peak.items()}
    skipped = {n: int(m.sum()) for n, m in noise_only.items() if m.any()}
    assert all(n.endswith(noisy) for n in skipped), skipped
    assert all(count <= most for count in skipped.values()), skipped
    for name in ref:
        diff = (got[name] - ref[name]).abs()
        if name in noise_only:
            diff = diff.masked_fill(noise_only[name], 0)
        assert diff.max() <= 1e-5, (name, diff.max().item())


class ResumableLoader:
    """A DataLoader that resumes mid-epoch (Lightning's ``state_dict``/``load_state_dict`` protocol for
    stateful loaders): it remembers how many batches it handed out and skips them after a restore."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.served, self._skip = loader, 0, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        for _ in range(self._skip):
            next(it)
        self.served, self._skip = self._skip, 0
        for batch in it:
            self.served += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"served": self.served}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["served"]


def make_trainer(strategy: Any, k: int, logger: Logger | None = None, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=k,
        logger=logger if logger is not None else False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
    )
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, **defaults)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def assert_series_close(a: list[tuple[Any, float]], b: list[tuple[Any, float]], atol: float) -> None:
    assert len(a) == len(b) and len(a) > 0, (len(a), len(b))
    for (step_a, va), (step_b, vb) in zip(a, b, strict=True):
        assert step_a == step_b, (step_a, step_b)
        assert math.isclose(va, vb, rel_tol=0.0, abs_tol=atol), (step_a, va, vb)


@contextlib.contextmanager
def mounted(path: Path, fstype: str = "tmpfs", size: str | None = None) -> Iterator[Path]:
    """A real small filesystem at ``path`` for the body (tmpfs of ``size``, or ramfs, which refuses
    O_DIRECT); skips the test where mounting is not permitted; unmounted afterwards."""
    path.mkdir()
    options = ["-o", f"size={size}"] if size else []
    if subprocess.run(["mount", "-t", fstype, *options, fstype, str(path)], capture_output=True).returncode != 0:
        pytest.skip(f"mounting a {fstype} is not permitted here")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def mixed_policy_start(module: Any, dtype: torch.dtype) -> tuple[Any, Any, list[nn.Parameter], nn.Module]:
    """The start of a plain-PyTorch mixed-precision reference loop: the module's optimizer and LR
    scheduler, its fp32 parameters (the master weights) and a copy of its model to compute with whose
    parameters are ``dtype`` (only the parameters, as under the strategy: buffers such as a rope cache
    keep their dtype)."""
    config = module.configure_optimizers()
    master = list(module.model.parameters())
    compute = copy.deepcopy(module.model)
    for p in compute.parameters():
        p.data = p.data.to(dtype)
    return config["optimizer"], config["lr_scheduler"]["scheduler"], master, compute


def policy_window(compute: nn.Module, master: list[nn.Parameter], window: list[Any], dtype: torch.dtype,
                  backward_of: Callable[[int, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """One window of a plain-PyTorch mixed-precision reference: the ``dtype`` ``compute`` copy takes the
    fp32 ``master`` weights, each micro-batch ``i`` runs under autocast and ``backward_of(i, loss)`` is
    backpropagated, and the ``dtype`` gradients are accumulated in fp32: the sums, per master weight."""
    with torch.no_grad():
        for c, m in zip(compute.parameters(), master, strict=True):
            c.copy_(m)
    acc = [torch.zeros_like(m) for m in master]
    for i, (x, y) in enumerate(window):
        with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
            logits = compute(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        backward_of(i, loss).backward()
        for a, c in zip(acc, compute.parameters(), strict=True):
            a += c.grad
            c.grad = None
    return acc


def bf16_policy_run(module: Any, batches: list[Any], k: int, epochs: int = 1) -> list[dict[str, torch.Tensor]]:
    """The plain-PyTorch bf16-mixed reference policy over ``batches`` in windows of ``k``
    (:func:`policy_window`, the loss over ``k``); the module's own optimizer and LR scheduler step the
    fp32 master weights. Returns every window's accumulated gradient (the module ends trained)."""
    optimizer, scheduler, master, compute = mixed_policy_start(module, torch.bfloat16)
    grads = []
    for _ in range(epochs):
        for start in range(0, len(batches), k):
            sums = policy_window(compute, master, batches[start : start + k], torch.bfloat16, lambda i, loss: loss / k)
            for m, a in zip(master, sums, strict=True):
                m.grad = a
            grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    return grads


@functools.cache
def example_val_loss(optimizer: str = "adamw", state_dtype: str = "float32", steps: int = 200) -> float:
    """The example's GPT and data on a small config, trained ``steps`` optimizer steps with greedysnake's
    fixed defaults and ``optimizer`` / ``offload.optimizer_state_dtype``: the validation loss after it
    (cached: the fp32 reference is shared by the tests of every state format)."""
    import tempfile

    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.recipes import GPTLightningModule, StdlibBytesDataModule

    L.seed_everything(0, verbose=False)
    module = GPTLightningModule(GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=64),
                                warmup_steps=10, optimizer=optimizer)
    data = StdlibBytesDataModule(block_size=64, batch_size=8, max_bytes=300_000, seed=0)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=2,
                            gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=16,
                            check_val_every_n_epoch=10**6, num_sanity_val_steps=0, default_root_dir=root,
                            strategy=GreedySnakeStrategy(auto=False, offload={"optimizer_state_dtype": state_dtype}))
        trainer.fit(module, data)
        return trainer.validate(module, data, verbose=False)[0]["val_loss"]
