"""Data parallel on CPU (gloo), two processes launched by Lightning: greedysnake equals
``Trainer(strategy="ddp", devices=2, accumulate_grad_batches=K)``, and checkpoints move between world sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_greedysnake.offload.device import simulate_device_enabled
from tests.helpers import max_abs_diff

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import argparse, json, os, warnings
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.errors import ReadAheadGivenBackWarning
    from tests.helpers import TinyGPTModule, UnitGradients, make_trainer, token_loader

    # as tests/conftest.py in the test process: a gap in the staging budget's accounting fails the run (every
    # rank runs this script: Lightning launches the others with the same command)
    warnings.simplefilter("error", ReadAheadGivenBackWarning)

    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy")
    parser.add_argument("--devices", type=int)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--root")
    parser.add_argument("--out")
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--settings", default="{}")
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--huge", type=int, default=None)
    parser.add_argument("--freeze", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = json.loads(args.settings)
    strategy = GreedySnakeStrategy(**{"auto": False, **settings}) if args.strategy == "greedysnake" else args.strategy
    precision = {"precision": args.precision}
    if args.precision == "16-mixed":  # fp16 on a CPU: greedysnake's own plugin (Lightning would run bf16)
        from lightning_greedysnake import GreedySnakePrecision
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        precision = {"plugins": [GreedySnakePrecision("16-mixed", scaler=scaler)]}
    L.seed_everything(0, verbose=False)

    class Module(TinyGPTModule):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if self.global_rank == 1 and self.trainer.current_epoch == 0 and batch_idx == args.huge:
                loss = loss * 1e6  # an fp16 overflow on this rank only
            return loss

    module = Module(lr=3e-3, dropout=0.0)
    for name, p in module.named_parameters():
        if args.freeze and args.freeze in name:
            p.requires_grad_(False)

    class Record(UnitGradients):
        resident_grads = []

        def on_before_optimizer_step(self, trainer, module, optimizer):
            grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
            if grads:
                self.resident_grads.append(grads)

        def window_grads(self):  # every window's gradient as the optimizer steps it (averaged)
            return self.windows() if self.per_name else self.resident_grads

        def on_train_start(self, trainer, module):
            super().on_train_start(trainer, module)
            manager = getattr(trainer.strategy, "tensor_manager", None)
            where = manager.offload_dirs[0].name if manager is not None and manager.offload_dirs else None
            self.disk = {}
            if manager is not None and manager.offload_dirs:  # bytes really allocated per file
                self.disk = {p.name: [os.stat(p).st_blocks * 512, os.stat(p).st_size] for p in manager.files}
            names = [where] * trainer.world_size
            if trainer.world_size > 1:
                torch.distributed.all_gather_object(names, where)
            self.dirs = names

        def on_train_end(self, trainer, module):
            import torchmetrics
            self.world = trainer.world_size
            rank = float(trainer.global_rank)
            gathered = trainer.strategy.all_gather(torch.tensor([rank]))
            self.ranks = gathered.flatten().tolist()
            self.sum = float(trainer.strategy.reduce(torch.tensor(rank), reduce_op="sum"))
            self.from_zero = trainer.strategy.broadcast(rank)
            trainer.strategy.barrier()
            metric = torchmetrics.MeanMetric()
            metric.update(torch.tensor(rank))
            self.metric = float(metric.compute())  # synced over the ranks by torchmetrics
            scaler = getattr(trainer.precision_plugin, "loss_scaler", None)
            skipped = [list(scaler.skipped_steps) if scaler is not None else []] * trainer.world_size
            if trainer.world_size > 1:
                torch.distributed.all_gather_object(skipped, skipped[0])
            self.skipped = skipped

    record = Record()
    trainer = make_trainer(strategy, args.k, max_epochs=args.epochs, devices=args.devices, default_root_dir=args.root,
                           enable_checkpointing=True, gradient_clip_val=args.clip, **precision,
                           callbacks=[ModelCheckpoint(dirpath=args.root, save_last=True), record])
    trainer.fit(module, token_loader(12), ckpt_path=args.ckpt)
    if trainer.global_rank == 0:
        torch.save({n: p.detach().clone() for n, p in module.named_parameters()}, args.out)
        torch.save(record.window_grads(), args.out + ".grads")
        with open(args.out + ".json", "w") as f:
            json.dump({"world": record.world, "ranks": record.ranks, "step": trainer.global_step,
                       "dirs": record.dirs, "sum": record.sum, "from_zero": record.from_zero,
                       "metric": record.metric, "disk": record.disk, "skipped": record.skipped,
                       "io": trainer.strategy.io_stats() if args.strategy == "greedysnake" else {}}, f)
    # Under pytest, about one run in twenty of gloo processes aborted in interpreter finalization after
    # everything had finished ("terminate called without an active exception"), with the process groups
    # already destroyed; leave without finalization, as the results are written.
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
""")


def _run(tmp_path: Path, name: str, strategy: str, devices: int, epochs: int = 2, ckpt: str | None = None,
         settings: dict | None = None, clip: float | None = None, root: Path | None = None,
         precision: str = "32-true", huge: int | None = None, freeze: str = "") -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / f"{name}.pt"
    root = root or tmp_path / name
    cmd = [sys.executable, str(script), "--strategy", strategy, "--devices", str(devices), "--epochs", str(epochs),
           "--root", str(root), "--out", str(out), "--settings", json.dumps(settings or {}), "--precision", precision]
    if ckpt:
        cmd += ["--ckpt", ckpt]
    if clip:
        cmd += ["--clip", str(clip)]
    if huge is not None:
        cmd += ["--huge", str(huge)]
    if freeze:
        cmd += ["--freeze", freeze]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    info = json.loads(Path(str(out) + ".json").read_text())
    grads = torch.load(str(out) + ".grads", weights_only=True)
    return {"params": torch.load(out, weights_only=True), "grads": grads, **info}


_DDP: dict[tuple[float | None, str], dict] = {}


def _ddp(tmp_path_factory: pytest.TempPathFactory, clip: float | None, freeze: str = "") -> dict:
    """DDP's run, the reference, which depends only on the norm clipping and the frozen parameters: once per
    session and ``(clip, freeze)``."""
    if (clip, freeze) not in _DDP:
        _DDP[clip, freeze] = _run(tmp_path_factory.mktemp("ddp"), "ddp", "ddp", 2, clip=clip, freeze=freeze)
    return _DDP[clip, freeze]


def _device_reduce_scatters(settings: dict, clip: float | None) -> bool:
    """On the simulated device with partitioned state, each rank's gradient is reduce-scattered on the
    device: rank 0 steps (and its observer sees) its chunk only. (Norm clipping averages the whole
    gradient for its norm first.)"""
    resident = settings.get("offload", {}).get("optimizer_states") == "device"  # (then every kind is)
    return (simulate_device_enabled() and settings.get("shard_state", True) and clip is None and not resident)


@pytest.mark.parametrize("settings, clip", [
    ({}, None),  # auto=False: state on SSD and partitioned, background lane, alpha 0.25
    ({"shard_state": False}, None),  # every rank steps the whole model (DDP's way)
    ({"alpha": 0.5, "lag": 2, "layers_per_unit": 2}, None),
    ({"alpha": 0.0, "lag": 0}, None),
    ({}, 0.5),  # norm clipping: the global norm of the averaged gradient
    ({"offload": {"path": "offload_{rank}"}}, None),  # one directory per rank from the config
    ({"offload": {"weights": "device", "master_weights": "device", "optimizer_states": "device",
                  "gradients": "device", "activations": "device"}}, None),  # everything resident
    ({"offload": {"weights": "device"}}, None),  # resident compute weights, partitioned state offloaded
    # auto=True (the defaults): rank 0's placement plan, a split under this budget, on both ranks
    ({"auto": True, "auto_host_budget_bytes": ((1 << 20) + (96 << 10)) * 8 // 7 + 8,
      "offload": {"buffer_budget_bytes": 1 << 20}}, None),
], ids=["fixed_defaults", "replicated", "alpha_half", "synchronous", "norm_clipping", "path_per_rank", "resident",
        "device_weights", "planned"])
def test_two_processes_equal_ddp(tmp_path, tmp_path_factory, settings, clip):
    ddp = _ddp(tmp_path_factory, clip)
    got = _run(tmp_path, "gs", "greedysnake", 2, settings=settings, clip=clip)
    assert got["world"] == 2 and got["ranks"] == [0.0, 1.0]  # launched by Lightning, all_gather works
    assert got["sum"] == 1.0 and got["from_zero"] == 0.0 and got["metric"] == 0.5  # reduce, broadcast, torchmetrics
    if not settings and clip is None:  # partitioned: rank 0's optimizer-state file holds its half only
        allocated, size = got["disk"]["optimizer_states.bin"]
        assert allocated <= 0.6 * size, (allocated, size)
    assert got["step"] == ddp["step"]
    assert max_abs_diff(got["params"], ddp["params"]) <= 1e-5
    # and every window's averaged gradient (Adam, and norm clipping, hide a gradient summed over the
    # ranks instead of averaged: the weights alone would not show it)
    assert len(got["grads"]) == len(ddp["grads"]) == ddp["step"]
    chunk_only = _device_reduce_scatters(settings, clip)
    for step, (g, r) in enumerate(zip(got["grads"], ddp["grads"], strict=True)):
        assert g.keys() == r.keys(), step
        if chunk_only:
            # rank 0 received its chunk of the averaged gradient only (the rest of its buffer is zero)
            mine = {n: v != 0 for n, v in g.items()}
            assert sum(int(m.sum()) for m in mine.values()) >= 0.4 * sum(v.numel() for v in g.values())
            g = {n: v[mine[n]] for n, v in g.items() if mine[n].any()}
            r = {n: v[mine[n]] for n, v in r.items() if mine[n].any()}
        assert max_abs_diff(g, r) <= 1e-5, step
    if "path" in settings.get("offload", {}):
        assert got["dirs"] == ["offload_0", "offload_1"]


def test_partitioned_state_with_frozen_parameters_equals_ddp_and_never_writes_them(tmp_path, tmp_path_factory):
    """Issue 70 with partitioned state: each rank steps its chunk of the trained prefix and gathers the others';
    the frozen MLPs are read-only on every rank (no frozen byte written after placement)."""
    ddp = _ddp(tmp_path_factory, None, freeze="mlp")
    got = _run(tmp_path, "gs", "greedysnake", 2, freeze="mlp")
    assert got["step"] == ddp["step"]
    assert max_abs_diff(got["params"], ddp["params"]) <= 1e-5
    assert got["io"]["ssd/weights/read_only_read_bytes"] > 0
    assert got["io"]["ssd/weights/read_only_written_bytes"] == 0
    for step, (g, r) in enumerate(zip(got["grads"], ddp["grads"], strict=True)):
        assert g.keys() == r.keys() and not any("mlp" in n for n in g), step
        assert max_abs_diff(g, r) <= 1e-5, step


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_partitioned_state_equals_replicated_under_bf16(tmp_path, state_dtype):
    """bf16-mixed keeps 16-bit compute weights (a policy DDP does not have): partitioned state, whose
    16-bit weights travel in the gather, must give exactly what every rank stepping everything gives;
    so must bf16 optimizer state, each rank rounding its chunk as the whole would be rounded."""
    offload = {"optimizer_state_dtype": state_dtype}
    replicated = _run(tmp_path, "rep", "greedysnake", 2, settings={"shard_state": False, "offload": offload},
                      precision="bf16-mixed")
    sharded = _run(tmp_path, "shard", "greedysnake", 2, settings={"alpha": 0.25, "offload": offload},
                   precision="bf16-mixed")
    assert max_abs_diff(sharded["params"], replicated["params"]) == 0


def test_an_fp16_overflow_on_one_rank_skips_that_step_on_every_rank(tmp_path):
    """16-mixed: a gradient that overflows on rank 1 alone is averaged into every rank's gradient, so
    every rank skips the step and backs off, partitioned or replicated, and they stay equal."""
    replicated = _run(tmp_path, "rep", "greedysnake", 2, settings={"shard_state": False}, precision="16-mixed",
                      huge=2)
    sharded = _run(tmp_path, "shard", "greedysnake", 2, precision="16-mixed", huge=2)
    assert replicated["skipped"] == sharded["skipped"] == [[2], [2]]  # (the second step, on both ranks)
    assert max_abs_diff(sharded["params"], replicated["params"]) == 0


def test_checkpoints_move_between_world_sizes(tmp_path):
    """Saved with 2 ranks, resumed with 1 (and the other way): where DDP's checkpoint lands when it takes
    the same path (Lightning's default strategy for the one-process part)."""
    for first, then, name in ((2, 1, "two_then_one"), (1, 2, "one_then_two")):
        single = {1: "auto", 2: "ddp"}
        ref_root, gs_root = tmp_path / f"ref_{name}", tmp_path / f"gs_{name}"
        _run(tmp_path, f"ref_a_{name}", single[first], first, epochs=1, root=ref_root)
        ref = _run(tmp_path, f"ref_b_{name}", single[then], then, epochs=2, ckpt=str(ref_root / "last.ckpt"),
                   root=ref_root)
        _run(tmp_path, f"gs_a_{name}", "greedysnake", first, epochs=1, root=gs_root)
        got = _run(tmp_path, f"gs_b_{name}", "greedysnake", then, epochs=2, ckpt=str(gs_root / "last.ckpt"),
                   root=gs_root)
        assert got["step"] == ref["step"]
        assert max_abs_diff(got["params"], ref["params"]) <= 1e-5, name
