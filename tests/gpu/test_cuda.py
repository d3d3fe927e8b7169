"""greedysnake on a real CUDA device (marked ``gpu``, skipped without one; about a minute on an H100 or an
H200): the device tier (pinned staging, copy streams, events) against ``strategy="auto"`` on the same GPU.

In the order of their value (``benchmarks/gpu_session.sh`` runs them first to last under a budget, so the
first ones are the ones a short lease still gets): a smoke test of the device tier's base (an O_DIRECT
buffer registered with ``cudaHostRegister``, a round trip host -> device -> host through ``CudaCopies``, a
failed registration's CUDA error cleared); the raw copies' ordering; the steady state with no hidden sync
(``torch.cuda.set_sync_debug_mode("error")``, which lets through only the once-per-window reads the code
names, :func:`~lightning_greedysnake.offload.device.named_sync`, and no ``torch.cuda.synchronize``);
GPU memory back at its level after ``fit`` (measured after a warm-up fit: cuBLAS's workspaces and the
CUDA context's first allocations are not the strategy's); then a trimmed equivalence matrix.

Comparisons: the first window's gradients, relative to their norm (1e-6 in fp32 against ``auto``'s
``param.grad``; 1e-5 in bf16-mixed against the same precision policy in plain PyTorch on the GPU),
before any optimizer step can amplify rounding; the logged losses; fp32 weights after training (not
bf16's: Adam turns last-bit gradient noise, an attention key bias's say, into lr-sized steps). The tight
comparisons run deterministic (``torch.use_deterministic_algorithms``, with ``CUBLAS_WORKSPACE_CONFIG``
set before cuBLAS starts: the :func:`deterministic` fixture), so a difference is the strategy's, not a
kernel's atomics.

Every test writes under its ``tmp_path`` (the working directory, where the default offload directory
goes): run them with ``--basetemp`` on an O_DIRECT-capable disk, never a tmpfs (``gpu_session.sh`` passes
the offload disk's). Run: ``python -m pytest -q -m gpu tests/gpu --basetemp /mnt/nvme/gs-tests``.
"""

from __future__ import annotations

import gc
import os
from collections import Counter
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (read when cuBLAS starts: before any test)

import lightning as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lightning_greedysnake import GPT, GPTConfig, GreedySnakeStrategy  # noqa: E402
from lightning_greedysnake.config import OffloadConfig  # noqa: E402
from lightning_greedysnake.io.aligned import AlignedBuffer  # noqa: E402
from lightning_greedysnake.io.engine import IOConfig, ThreadedIOEngine  # noqa: E402
from lightning_greedysnake.offload.device import NAMED_SYNCS, CudaCopies  # noqa: E402
from lightning_greedysnake.precision import GreedySnakePrecision  # noqa: E402
from tests.helpers import RecordingLogger, UnitGradients, token_loader  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

K = 4
STEPS = 3
LR = 3e-3


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=64))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)


class Grads(UnitGradients):
    """The first window's gradients: ``param.grad`` under ``auto``, the stepper's under greedysnake."""

    def __init__(self) -> None:
        super().__init__()
        self.resident: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if self.resident is None:
            self.resident = {n: p.grad.detach().float().cpu() for n, p in module.named_parameters()
                             if p.grad is not None}

    def first(self) -> dict[str, torch.Tensor]:
        windows = self.windows()
        if windows:
            return {n: g.float().cpu() for n, g in windows[0].items()}
        assert self.resident is not None
        return self.resident


class DeviceTierSeen(L.Callback):
    def on_train_start(self, trainer: Any, module: Any) -> None:
        manager = trainer.strategy.tensor_manager
        assert manager is not None and isinstance(manager.copies, CudaCopies)


def fit(strategy: Any, precision: str = "32-true", callbacks: tuple = (), **trainer_kwargs: Any) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = Module()
    logger, grads = RecordingLogger(), Grads()
    if "plugins" not in trainer_kwargs:  # (a precision plugin passed explicitly decides it)
        trainer_kwargs["precision"] = precision
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu", devices=1, max_epochs=1,
        accumulate_grad_batches=K, logger=logger, log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[grads, *callbacks], **trainer_kwargs,
    )
    trainer.fit(module, token_loader(K * STEPS, batch_size=4, seq=64, vocab=256))
    return {
        "grads": grads.first(),
        "losses": [v for _, v in logger.series("train_loss_step")] or [v for _, v in logger.series("train_loss")],
        "params": {n: p.detach().float().cpu() for n, p in module.named_parameters()},
        "steps": trainer.global_step,
    }


_references: dict[tuple, dict[str, Any]] = {}
_policy: list[dict[str, torch.Tensor]] = []


def _policy_grads() -> dict[str, torch.Tensor]:
    if not _policy:
        _policy.append(policy_first_window())
    return _policy[0]


def reference(precision: str, **trainer_kwargs: Any) -> dict[str, Any]:
    key = (precision, tuple(sorted(trainer_kwargs.items())))
    if key not in _references:
        _references[key] = fit("auto", precision, **trainer_kwargs)
    return _references[key]


def policy_first_window() -> dict[str, torch.Tensor]:
    """bf16-mixed as greedysnake computes it (16-bit compute copies of the fp32 master weights under
    autocast, each micro-batch's bf16 gradient accumulated in fp32): the first window's gradients, in
    plain PyTorch on the GPU. (``auto``'s bf16-mixed keeps fp32 weights, so its embedding output and
    LayerNorm parameters differ in the last bits of bf16: the losses are compared with it, loosely.)"""
    L.seed_everything(0, verbose=False)
    module = Module()
    compute = module.model.to("cuda", torch.bfloat16)
    acc = {n: torch.zeros(p.shape, device="cuda") for n, p in compute.named_parameters()}
    for i, (x, y) in enumerate(token_loader(K * STEPS, batch_size=4, seq=64, vocab=256)):
        if i == K:
            break
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = compute(x.cuda())
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.cuda().view(-1))
        (loss / K).backward()
        for n, p in compute.named_parameters():
            acc[n] += p.grad
            p.grad = None
    return {f"model.{n}": g.cpu() for n, g in acc.items()}


def assert_matches(got: dict[str, Any], ref: dict[str, Any], precision: str) -> None:
    rel = 1e-6 if precision == "32-true" else 1e-5
    assert got["steps"] == ref["steps"] == STEPS
    ref_grads = ref["grads"] if precision == "32-true" else _policy_grads()
    assert got["grads"].keys() == ref_grads.keys()
    for name, g in got["grads"].items():
        r = ref_grads[name]
        assert (g - r).norm() <= rel * r.norm() + 1e-12, (name, float((g - r).norm() / r.norm()))
    assert len(got["losses"]) == len(ref["losses"]) > 0
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= (1e-5 if precision == "32-true" else 2e-2) * max(1.0, abs(b)), (a, b)
    if precision == "32-true":
        for name, p in got["params"].items():
            assert torch.allclose(p, ref["params"][name], rtol=0, atol=1e-4), name


PLACEMENTS = {
    "ssd": None,
    "ssd-everything": OffloadConfig.everywhere("ssd"),
    "host": OffloadConfig.everywhere("host", activations="device"),
    "host-weights-ssd-state": {"weights": "host", "activations": "host", "prefetch_units": 2},
    "device-weights": {"weights": "device"},  # resident compute weights beside the host optimizer, state on SSD
    "device-host-ssd-weights": {"weights": {"device": 0.4, "host": 0.3, "ssd": 0.3}},
}


@pytest.fixture
def deterministic():
    """Deterministic kernels for a tight comparison (where torch has none, a warning, not an error: the
    strategy's own ops are not this test's subject); restored after."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


# ---- 1. the smoke test: the device tier's base on this machine ----

def test_smoke_an_o_direct_buffer_registered_round_trips_and_a_failed_registration_leaves_no_error(tmp_path):
    """A page-aligned buffer (what O_DIRECT reads into) registered with ``cudaHostRegister``
    (``CudaCopies.pin``), filled by an O_DIRECT read from ``tmp_path``'s disk, copied host -> device ->
    host through ``CudaCopies`` equals what was written (doubled on the device); registering it again fails
    with a ``RuntimeError`` and leaves no CUDA error behind (the next kernel launch is clean)."""
    nbytes = 4 << 20
    numel = nbytes // 4
    copies = CudaCopies(torch.device("cuda"))
    engine = ThreadedIOEngine(IOConfig(num_threads=2, chunk_bytes=1 << 20))
    written, staging = AlignedBuffer(nbytes), AlignedBuffer(nbytes)
    host = device = back = None
    try:
        expected = torch.arange(numel, dtype=torch.float32)
        written.view(torch.float32, numel).copy_(expected)
        file = engine.open(tmp_path / "smoke.bin", nbytes)
        assert file.direct, f"{tmp_path} refuses O_DIRECT: run with --basetemp on the offload disk (not a tmpfs)"
        engine.write(file, 0, written, 0, nbytes)
        staging.pin(copies.pin, copies.unpin)
        assert staging.tensor is not None and staging.tensor.is_pinned() and copies.counts.registrations == 1
        engine.read(file, 0, staging, 0, nbytes)  # (O_DIRECT: the disk's DMA into the registered pages)
        host = staging.view(torch.float32, numel)
        device = copies.empty(numel, torch.float32)
        copies.wait(copies.to_device(host, device))
        device.mul_(2.0)
        back = copies.empty_host(numel, torch.float32)
        copies.to_host(device, back).result()
        assert torch.equal(back, 2.0 * expected)

        # registered already (cudaErrorHostMemoryAlreadyRegistered)
        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            copies.pin(staging.tensor.data_ptr(), staging.nbytes)
        assert copies.counts.registrations == 1
        x = torch.full((1024,), 3.0, device="cuda") * 2  # (a kernel launch checks the last CUDA error)
        assert float(x.sum()) == 6.0 * 1024
    finally:
        del host, device, back  # (the views into the buffer first)
        staging.close()  # (unregisters first)
        written.close()
        engine.close()
        copies.close()


# ---- 2. the raw copies' ordering ----

def test_cuda_copies_are_ordered_by_events():
    """A copy on the side stream of a tensor the compute stream is still writing sees its final value."""
    copies = CudaCopies(torch.device("cuda"))
    try:
        x = torch.zeros(1 << 22, device="cuda")
        for _ in range(20):
            x.add_(1.0)  # queued on the compute stream
        host = copies.empty_host(x.numel(), x.dtype)
        copies.to_host(x, host).result()
        assert bool((host == 20.0).all())
        back = copies.empty(x.numel(), x.dtype)
        copy = copies.to_device(host, back)
        copies.wait(copy)
        assert bool((back == 20.0).all())
    finally:
        copies.close()


# ---- 3. no hidden sync in the steady state ----

ALLOWED_SYNCS = frozenset({"window losses finite", "window inputs equal", "window gradients finite",
                           "window gradient norms finite", "clipping norm"})
"""The host reads of device values the steady state makes on purpose, each at most once per window."""


class QuietModule(Module):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))  # (no self.log: a read)


class SyncDebug(L.Callback):
    """From the second window on, every host sync is an error but the named ones."""

    def __init__(self) -> None:
        self.start: Counter[str] | None = None

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == K:
            self.start = Counter(NAMED_SYNCS)
            torch.cuda.set_sync_debug_mode("error")

    def on_train_end(self, trainer: Any, module: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)


class CountSynchronize(L.Callback):
    """Counts ``torch.cuda.synchronize`` calls from the second window on (the steady state)."""

    def __init__(self, monkeypatch: Any) -> None:
        self.calls = 0
        self.counting = False
        original = torch.cuda.synchronize

        def counted(*args: Any, **kwargs: Any) -> None:
            if self.counting:
                self.calls += 1
            original(*args, **kwargs)

        monkeypatch.setattr(torch.cuda, "synchronize", counted)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.counting = batch_idx >= K

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.counting = False


@pytest.mark.parametrize(("weights", "clip"), [("ssd", None), ("device", None), ("ssd", 0.05)])
def test_no_hidden_sync_in_the_steady_state(monkeypatch, weights, clip):
    """From the second window on: no ``torch.cuda.synchronize`` (counted), and no other host sync but the
    named ones, each at most once per window (``set_sync_debug_mode("error")``)."""
    sync, counter = SyncDebug(), CountSynchronize(monkeypatch)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=GreedySnakeStrategy(auto=False, alpha=0.25, lag=1, offload={"weights": weights}), accelerator="gpu",
        devices=1, precision="bf16-mixed", max_epochs=1, accumulate_grad_batches=K, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[sync, counter],
        gradient_clip_val=clip)
    try:
        trainer.fit(QuietModule(), token_loader(K * STEPS, batch_size=4, seq=64, vocab=256))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert trainer.global_step == STEPS and sync.start is not None
    assert counter.calls == 0
    seen = Counter(NAMED_SYNCS) - sync.start
    assert set(seen) <= ALLOWED_SYNCS, seen
    assert all(n <= STEPS - 1 for n in seen.values()), seen  # (once per steady window at most)


# ---- 4. GPU memory back at its level ----

@pytest.mark.parametrize("weights", ["ssd", "device"])
def test_gpu_memory_returns_to_its_starting_level_after_fit(weights):
    """Measured after a warm-up fit of the same configuration (the CUDA context's and cuBLAS's lazily made
    workspaces are not the strategy's): a second fit leaves ``memory_allocated`` where it found it."""
    fit(GreedySnakeStrategy(auto=False, offload={"weights": weights}))  # (the warm-up)
    gc.collect()
    torch.cuda.synchronize()  # (test code: settle before measuring)
    before = torch.cuda.memory_allocated()
    fit(GreedySnakeStrategy(auto=False, offload={"weights": weights}))
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


# ---- 5. the equivalence matrix, trimmed: each placement once, the planned defaults in both precisions ----

MATRIX = [("32-true", "ssd"), ("32-true", "host"), ("32-true", "device-host-ssd-weights"),
          ("32-true", "planned"), ("bf16-mixed", "ssd-everything"), ("bf16-mixed", "host-weights-ssd-state"),
          ("bf16-mixed", "device-weights"), ("bf16-mixed", "planned")]


@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize(("precision", "placement"), MATRIX)
def test_matches_auto_on_cuda(placement, precision):
    # "planned": the defaults (auto=True) with a host budget of 8 MiB of staging and 3 MiB of room for the
    # kinds (a 0.8 MB block's weights each in fp32): the planner splits them between RAM and SSD
    # (auto_device_budget_bytes=0: the model would fit the GPU, where the device plan keeps it all)
    planned = {"auto_host_budget_bytes": ((8 << 20) + (3 << 20)) * 8 // 7 + 8, "offload": {"buffer_budget_bytes": 8 << 20},
               "auto_device_budget_bytes": 0}
    strategy = GreedySnakeStrategy(**planned) if placement == "planned" else GreedySnakeStrategy(
        auto=False, offload=PLACEMENTS[placement])
    got = fit(strategy, precision, callbacks=(DeviceTierSeen(),))
    assert_matches(got, reference(precision), precision)
    if placement == "planned":
        kinds = strategy.placement_plan.kinds.values()
        assert any(k.host_units for k in kinds) and any(k.host_units < k.num_units for k in kinds)


@pytest.mark.usefixtures("deterministic")
def test_with_the_whole_state_over_the_budget_the_plan_keeps_the_compute_weights_on_the_gpu():
    """auto=True with a device budget under twice the model's state: offloaded, but the compute weights
    stay on the GPU (the device's share of setup's placement), exact against Lightning."""
    from lightning_greedysnake.strategy.planning.device import model_state_bytes

    strategy = GreedySnakeStrategy(auto_device_budget_bytes=2 * model_state_bytes(Module()) - 1, layers_per_unit=1)
    got = fit(strategy, "bf16-mixed", callbacks=(DeviceTierSeen(),))
    assert_matches(got, reference("bf16-mixed"), "bf16-mixed")
    assert strategy.placement_plan.kinds["weights"].device_units == strategy.placement_plan.kinds["weights"].num_units


@pytest.mark.usefixtures("deterministic")
def test_the_defaults_keep_a_model_that_fits_the_gpu_on_it():
    """auto=True with the GPU's free memory as the device budget: this small model's state stays on the
    device (no tensor manager) and trains as Lightning's own strategy does."""
    strategy = GreedySnakeStrategy()
    got = fit(strategy, "32-true")
    assert_matches(got, reference("32-true"), "32-true")
    assert strategy.tensor_manager is None and not strategy.config.offload.uses_tensor_manager


@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize(("alpha", "lag", "schedule"), [(0.0, 0, "vertical"), (0.5, 2, "vertical"),
                                                        (0.25, 1, "horizontal")])
def test_alpha_lag_and_schedules_match_auto_on_cuda(alpha, lag, schedule):
    got = fit(GreedySnakeStrategy(auto=False, alpha=alpha, lag=lag, schedule=schedule), "32-true")
    assert_matches(got, reference("32-true"), "32-true")


@pytest.mark.usefixtures("deterministic")
def test_norm_clipping_matches_auto_on_cuda():
    got = fit(GreedySnakeStrategy(auto=False), "32-true", gradient_clip_val=0.05)
    assert_matches(got, reference("32-true", gradient_clip_val=0.05), "32-true")


class LossScale(L.Callback):
    """The loss scale after each optimizer step (greedysnake's LossScaler, or Lightning's GradScaler)."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if (trainer.fit_loop.epoch_loop.batch_idx + 1) % K:
            return
        plugin = trainer.precision_plugin
        scaler = getattr(plugin, "loss_scaler", None)
        self.scales.append(float(scaler.scale) if scaler is not None else float(plugin.scaler.get_scale()))


@pytest.mark.usefixtures("deterministic")
def test_fp16_mixed_matches_lightnings_own_16_mixed_on_cuda():
    """fp16 compute weights with dynamic loss scaling against Lightning's 16-mixed (fp32 parameters under
    autocast, torch.amp.GradScaler): the same loss-scale history, and the losses within fp16's rounding."""
    ours, theirs = LossScale(), LossScale()
    got = fit(GreedySnakeStrategy(auto=False), "16-mixed", callbacks=(DeviceTierSeen(), ours))
    ref = fit("auto", "16-mixed", callbacks=(theirs,))
    assert got["steps"] == ref["steps"] == STEPS
    assert ours.scales == theirs.scales and ours.scales
    assert len(got["losses"]) == len(ref["losses"]) > 0
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert abs(a - b) <= 2e-2 * max(1.0, abs(b)), (a, b)


@pytest.mark.usefixtures("deterministic")
def test_a_precision_plugin_passed_explicitly_autocasts_on_the_gpu():
    """``plugins=[GreedySnakePrecision("bf16-mixed")]``: its autocast device is the accelerator's (a fixed
    "cpu" default ran the CUDA forward wholly in bf16, LayerNorm and softmax too, with no error)."""
    plugin = GreedySnakePrecision("bf16-mixed")
    got = fit(GreedySnakeStrategy(auto=False), "bf16-mixed", callbacks=(DeviceTierSeen(),), plugins=[plugin])
    assert plugin.device == "cuda"
    assert_matches(got, reference("bf16-mixed"), "bf16-mixed")
