"""LoRA at its true cost (issue 70): a LitGPT LoRA model whose frozen base is larger than the host budget,
trained with greedysnake (the base on SSD, read by each unit's forward and backward, never written: twice a
window, whatever K; the warm-step plan keeps the graphs, their saved tensors on SSD, where compute binds, or
recomputes) against DeepSpeed
ZeRO-Infinity (ZeRO-3, parameters and optimizer state on NVMe) and against the step's limit.

    python benchmarks/lora.py --offload-dir /mnt/nvme/lora          # the issue's run: 3 GB bf16 base, 1 GiB host
                                                                    # budget, LoRA r=16, K=8, seq 128, 6 steps
    python benchmarks/lora.py --quick                               # 1-3 minutes at tiny sizes (a smoke run)
    python benchmarks/lora.py --base-gb 1 --k 4 --systems greedysnake limit

The model: ``litgpt.lora.GPT`` from ``Config.from_name("Llama-3.2-1B")``'s width (n_embd 2048, 32 heads in 8
query groups, MLP 8192; ``--quick``: n_embd 512, 8 heads in 2 groups, MLP 2048) with a vocabulary of 8192
(``--quick``: 1024: the embedding and head no larger than an MLP matrix, so DeepSpeed's swap buffers, each the
size of the largest parameter, stay small) and as many layers as make the frozen base ``--base-gb`` GB
(1e9 bytes); LitGPT's LoRA defaults (query and value, ``lora_alpha`` 2r) at ``--lora-r`` 16, dropout 0,
``mark_only_lora_as_trainable``; the base bf16, the LoRA weights fp32; AdamW (lr 1e-4) on the LoRA weights;
random tokens (seed 0, ``_common.token_loader``), micro-batches of one sequence, ``--k`` per step.

Precision, alike on both sides: ``bf16-mixed``. LitGPT's LoRA layers feed their fp32 input straight to the
base's ``nn.Linear`` (PEFT casts it to the base's dtype; LitGPT does not), so a bf16 base under ``32-true``
fails in Lightning too (``mat1 and mat2 must have the same dtype``). Under ``bf16-mixed`` greedysnake runs
forward and backward under ``torch.autocast(bfloat16)`` (as Lightning does), keeps the bf16 base as it is
(read-only, its own dtype) and the LoRA weights as fp32 masters with bf16 compute copies; DeepSpeed with
``bf16.enabled`` keeps every parameter bf16 (the base alike, 2 bytes a parameter on NVMe) and fp32 masters
of the LoRA weights in its optimizer. Both compute the base's matmuls in bf16.

**CPUs without native bf16.** Without AVX-512 BF16 (or AMX) a bf16 matmul is emulated, about 100x slower
than fp32 (``lightning_greedysnake.precision.cpu_bf16_slowdown``): the step would be compute-bound many times
over on both sides, and neither ratio would say anything about I/O. ``--base-dtype auto`` (the default) then
keeps the base in float32 and trains under ``32-true`` on both sides (DeepSpeed without bf16): every matmul
in fp32, the base 4 bytes a parameter, so ``--base-gb`` holds half the parameters. Either way the result
names the dtype, the precision, the CPU's bf16 flags and the measured bf16/fp32 matmul slowdown, and the
limit's compute term is measured in the dtype the run computes in (a bf16 limit on an emulating CPU would be
the emulation's, not the disk's). ``--base-dtype bfloat16`` forces the bf16 base anyway.

Each side runs in its own fresh process (``_common.child_result``: its own peak RSS, the disk settled
between runs):

- ``greedysnake``: ``GreedySnakeStrategy(offload_dir=..., auto_host_budget_bytes=--host-budget-gb GiB,
  offload={"weights": "ssd", "return_weights": False})``: the compute weights (the base) on SSD, everything
  else planned within the host budget (``auto=True``); the model built in ``trainer.init_module(
  empty_init=True)`` (on the meta device, materialized unit by unit into the tiers), never whole in RAM.
- ``deepspeed``: ZeRO-3 with ``offload_param`` and ``offload_optimizer`` on NVMe (``--offload-dir``), the
  model built under ``deepspeed.zero.Init(remote_device="nvme")`` (its way to build a model that never sits
  whole in RAM), ``max_in_cpu`` 0, swap buffers sized as its docs say (``offload_param``: each at least the
  largest parameter, enough for four blocks' matrices and four more; ``offload_optimizer``: 4), the live
  window and reuse distance bounded in blocks, ``aio`` at its defaults (not tuned) — as
  ``benchmarks/scale.py`` configures it — but its prefetch off (``stage3_prefetch_bucket_size`` 0): with it,
  DeepSpeed 0.19.8 fails on this model at the second forward (``AssertionError: param 0 already assigned
  swap buffer id``, its NVMe prefetch; deepspeedai/DeepSpeed#4072, open). ``--ds-prefetch N`` turns it back
  on (N blocks) to try again. Its own training loop (``engine.backward``/``engine.step`` per
  micro-batch). Needs DeepSpeed (not a dependency, kept out of CI; on a CPU machine ``apt-get install -y
  libaio-dev && pip install --no-build-isolation deepspeed==0.19.8``, ``DS_ACCELERATOR=cpu`` is set here; the
  first run compiles its CPU Adam and async I/O ops, a few minutes; a killed build leaves a ``lock`` file in
  ``~/.cache/torch_extensions/<py>_cpu/<op>/``: delete it). Where it is not importable or fails, its row
  says why and the rest still runs.
- ``limit``: the compute term, measured: the same model with the base resident in RAM (no offload at all),
  ``--k`` micro-batches forward and backward under the same autocast and threads, the median of
  ``--compute-windows`` windows after one warm-up (``compute_s``); one more forward per micro-batch, the
  recompute greedysnake's backward does when it keeps only each unit's input, is given apart
  (``recompute_s``), not in the limit; so is the same window with the whole model cast to bf16 and no
  autocast (``compute_pure_bf16_s``: how DeepSpeed's bf16 computes, where autocast's casts of the fp32
  LoRA weights and activations around every op are not paid).

Per system: tokens/s (``--k`` x ``--seq`` over the median step after the first two, ``_common.steady_step_s``),
bytes per step (the process's block I/O, ``/proc/self/io``, alike for both; greedysnake's own counters per
tier and kind beside them), peak RSS (``ru_maxrss``: by the end of the last step, and the whole run) and its
growth over the same process idle with everything imported.

The limit, of physical terms only (never a measured busy time): ``limit_s = max(compute_s, base bytes /
probed read speed)``, the disk probed with O_DIRECT (``planner.measure.disk_bandwidth``, ``--probe-mb`` MiB
each way, the best of three) in the offload directory before the runs. Reported: ``vs_deepspeed``
(greedysnake's tokens/s over DeepSpeed's; the issue's aim: at least 3) and ``step_vs_limit`` (greedysnake's
step over ``limit_s``; the aim: at most 1.2), with the term that binds. Beside them: ``reads_vs_base`` (a
system's block reads per step over the base's bytes: 1 is the base read once a window; greedysnake's vertical
order reads a unit's weights in its forward and again in its recomputing backward, about 2, DeepSpeed's
horizontal order about 2K) and ``step_vs_limit_as_moved`` (the step against max(compute, the bytes
greedysnake's counters say it moved over the probed read and write speeds)): what the step costs beyond the
traffic it makes, where ``step_vs_limit`` also counts traffic it could save; ``step_vs_limit_with_recompute``
counts the recompute's forward in the compute term.

Writes ``--out`` (default ``benchmarks/results/lora.json``, which ``benchmarks/report.py``'s sections must then
list; ``--quick``: ``lora_quick.json`` in the temp directory, not a result): the command,
the machine (CPU model, cores, bf16 flags, RAM, the disk's probed read and write speed), the settings, the
model's sizes and every row. Run it on a quiet machine: a timing taken while anything else runs is worthless.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SYSTEMS = ["limit", "greedysnake", "deepspeed"]

WIDTHS = {
    # Llama-3.2-1B's width (its n_layer replaced to reach --base-gb), a vocabulary of 8192
    "llama-1b": {"n_embd": 2048, "n_head": 32, "n_query_groups": 8, "head_size": 64, "intermediate_size": 8192,
                 "vocab": 8192},
    # small, but its MLP matrices 2 MB in bf16: DeepSpeed swaps no tensor under its aio block size (1 MiB) to
    # NVMe, it keeps it in RAM
    "tiny": {"n_embd": 512, "n_head": 8, "n_query_groups": 2, "head_size": 64, "intermediate_size": 2048,
             "vocab": 1024},
}

QUICK = {"base_gb": 0.1, "host_budget_gb": 0.05, "k": 4, "seq": 32, "steps": 3, "width": "tiny",
         "compute_windows": 2, "probe_mb": 16}
"""``--quick``'s sizes: seconds per system, numbers meaningless beyond showing that every part runs."""

MiB = 1 << 20


# -- the model ----------------------------------------------------------------------------------------

def lora_config(args: argparse.Namespace, n_layer: int) -> Any:
    from litgpt.lora import Config

    w = WIDTHS[args.width]
    return Config.from_name(
        "Llama-3.2-1B", n_layer=n_layer, n_embd=w["n_embd"], n_head=w["n_head"], n_query_groups=w["n_query_groups"],
        head_size=w["head_size"], intermediate_size=w["intermediate_size"], vocab_size=w["vocab"],
        padded_vocab_size=w["vocab"], block_size=args.seq, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
        lora_dropout=0.0, lora_query=True, lora_key=False, lora_value=True, lora_projection=False,
        lora_mlp=False, lora_head=False)


def base_dtype(args: argparse.Namespace) -> Any:
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.resolved_base_dtype]


def precision(args: argparse.Namespace) -> str:
    return "bf16-mixed" if args.resolved_base_dtype == "bfloat16" else "32-true"


def is_lora(name: str) -> bool:
    """LitGPT's own rule (``mark_only_lora_as_trainable`` with ``bias="none"``)."""
    return "lora_" in name


def build_model(config: Any, dtype: Any, materialize: bool) -> Any:
    """``litgpt.lora.GPT(config)`` with its parameters on the meta device (its rope cache real), the base cast
    to ``dtype`` and frozen (``mark_only_lora_as_trainable``), the LoRA weights fp32. ``materialize``: every
    parameter then made real in CPU memory, at random (normal, std 0.02; norms 1; the values do not matter
    to a timing), one at a time, so the model never exists in fp32 whole."""
    import torch
    from litgpt.lora import GPT, mark_only_lora_as_trainable
    from torch import nn

    from lightning_greedysnake.recipes.meta_init import parameters_on_meta

    with parameters_on_meta():
        model = GPT(config)
    mark_only_lora_as_trainable(model)
    for module_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            full = f"{module_name}.{name}" if module_name else name
            to = torch.float32 if is_lora(full) else dtype
            if materialize:
                real = torch.empty(p.shape, dtype=to)
                real.fill_(1.0) if p.dim() == 1 else real.normal_(0.0, 0.02)
            else:
                real = p.to(to)
            module._parameters[name] = nn.Parameter(real, requires_grad=p.requires_grad)
    return model


def sizes(config: Any, dtype: Any) -> dict[str, Any]:
    """The model's parameter counts and bytes (built on the meta device: no memory)."""
    model = build_model(config, dtype, materialize=False)
    base = [p for n, p in model.named_parameters() if not is_lora(n)]
    lora = [p for n, p in model.named_parameters() if is_lora(n)]
    return {"n_layer": config.n_layer, "base_params": sum(p.numel() for p in base),
            "base_bytes": sum(p.numel() * p.element_size() for p in base),
            "lora_params": sum(p.numel() for p in lora),
            "largest_param": max(p.numel() for p in model.parameters()),
            "block_params": sum(p.numel() for p in model.transformer.h[0].parameters())}


def layers_for(args: argparse.Namespace) -> int:
    """The number of layers whose base comes closest to ``--base-gb`` GB (two sizes on the meta device: the
    bytes of one layer and of the rest)."""
    dtype = base_dtype(args)
    one, two = (sizes(lora_config(args, n), dtype)["base_bytes"] for n in (1, 2))
    per_layer, rest = two - one, one - (two - one)
    return max(1, round((args.base_gb * 1e9 - rest) / per_layer))


def lora_module(config: Any, dtype: Any, lr: float = 1e-4) -> Any:
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_greedysnake.recipes.meta_init import building_on_meta

    class LoRAModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            # inside trainer.init_module(empty_init=True) (the meta device): greedysnake materializes it unit by
            # unit into its tiers; anywhere else: real at once
            self.model = build_model(config, dtype, materialize=not building_on_meta())

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=lr)

    return LoRAModule


# -- measurements common to the children --------------------------------------------------------------

def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def proc_io() -> dict[str, int]:
    """This process's block I/O so far (all its threads; O_DIRECT reads and writes count)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("read_bytes", "write_bytes"):
                out[key] = int(value)
    return out


class Steps:
    """Each optimizer step's seconds, block I/O and peak RSS, taken where the step ends."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.io: list[dict[str, int]] = []
        self.peaks_mb: list[float] = []
        self.t = time.perf_counter()

    def start(self) -> None:
        self.io = [proc_io()]
        self.t = time.perf_counter()

    def step(self) -> None:
        now = time.perf_counter()
        self.times.append(now - self.t)
        self.io.append(proc_io())
        self.peaks_mb.append(round(peak_rss_mb(), 1))
        self.t = now

    def row(self, k: int, seq: int) -> dict[str, Any]:
        from _common import WARMUP_STEPS, steady_step_s

        step_s = steady_step_s(self.times)
        row: dict[str, Any] = {"step_s": round(step_s, 3), "tokens_per_s": round(k * seq / step_s, 2),
                               "step_times": [round(t, 3) for t in self.times]}
        first = min(WARMUP_STEPS, len(self.times) - 1)  # (the steady steps' I/O: after the warm-up's)
        n = len(self.times) - first
        if self.io and self.io[0] and n > 0:
            row["disk_read_gb_per_step"] = round((self.io[-1]["read_bytes"] - self.io[first]["read_bytes"]) / n / 1e9, 4)
            row["disk_written_gb_per_step"] = round(
                (self.io[-1]["write_bytes"] - self.io[first]["write_bytes"]) / n / 1e9, 4)
        row["train_peak_rss_mb"] = self.peaks_mb[-1] if self.peaks_mb else None
        row["peak_rss_by_step_mb"] = self.peaks_mb
        return row


# -- the children -------------------------------------------------------------------------------------

def run_greedysnake(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    import lightning as L
    import torch
    from _common import WARMUP_STEPS, token_loader

    from lightning_greedysnake import GreedySnakeStrategy

    idle_mb = rss_mb()
    clock, extra = Steps(), {}
    counters: list[dict[str, float]] = []

    class Clock(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            clock.start()

        def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
            if (trainer.fit_loop.epoch_loop.batch_idx + 1) % args.k == 0:
                clock.step()
                if len(clock.times) == WARMUP_STEPS:  # (no flush: the clock's steps are not held up)
                    counters.append(trainer.strategy.io_stats())

        def on_train_end(self, trainer: Any, module: Any) -> None:
            s = trainer.strategy
            extra["train_peak_rss_mb"] = round(peak_rss_mb(), 1)
            manager = s.tensor_manager
            if manager is None:
                return
            manager.drain()  # (the last step's writes landed: counted)
            end = s.io_stats()
            start = counters[0] if counters and len(clock.times) > WARMUP_STEPS else {}
            n = len(clock.times) - (WARMUP_STEPS if start else 0)
            per = {key: (v - start.get(key, 0.0)) / max(1, n) for key, v in end.items()}
            extra["gs_ssd_read_gb_per_step"] = round(sum(
                v for key, v in per.items() if key.startswith("ssd/") and key.endswith("bytes_read")) / 1e9, 4)
            extra["gs_ssd_written_gb_per_step"] = round(sum(
                v for key, v in per.items() if key.startswith("ssd/") and key.endswith("bytes_written")) / 1e9, 4)
            extra["gs_bytes_per_step"] = {key: int(v) for key, v in per.items()
                                          if key.endswith(("bytes_read", "bytes_written")) and v}
            steady = s.step_telemetry[WARMUP_STEPS:] or s.step_telemetry
            for name in ("wall_s", "compute_s", "io_wait_s", "ssd_read_busy_s", "ssd_write_busy_s", "optimizer_busy_s",
                         "forward_s"):
                extra[f"gs_{name}"] = round(statistics.median(getattr(t, name) for t in steady), 3) if steady else None
            if s.placement_plan is not None:  # units of each kind in RAM / all units
                extra["placement"] = {kind: f"{p.host_units}/{p.num_units} in RAM"
                                      for kind, p in s.placement_plan.kinds.items()}
            if s.plan_choice is not None:
                extra["plan"] = {k: v for k, v in vars(s.plan_choice).items() if isinstance(v, (int, float, str, bool))}
            extra["recompute"] = s.config.recompute

    strategy = GreedySnakeStrategy(offload_dir=Path(args.offload_dir) / "greedysnake",
                                   auto_host_budget_bytes=int(args.host_budget_gb * 2**30),
                                   offload={"weights": "ssd", "return_weights": False},
                                   layers_per_unit=args.layers_per_unit or None)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision(args),
                        max_steps=args.steps, accumulate_grad_batches=args.k, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Clock()], default_root_dir=args.offload_dir)
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True):
        module = lora_module(config, base_dtype(args))()
    trainer.fit(module, token_loader(config.vocab_size, args.seq, args.k * args.steps))
    row = {**clock.row(args.k, args.seq), **extra}
    row.update(idle_rss_mb=round(idle_mb, 1), peak_rss_mb=round(peak_rss_mb(), 1))
    return row


def run_deepspeed(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    import socket

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as sock:  # a free port for its gloo group (other runs may hold the default)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", port)):
        os.environ.setdefault(key, value)
    idle_mb = rss_mb()
    import deepspeed
    import torch
    import torch.nn.functional as F
    from _common import token_loader
    from litgpt.lora import GPT, mark_only_lora_as_trainable

    idle_mb = max(idle_mb, rss_mb())
    deepspeed.init_distributed(dist_backend="gloo")
    nvme = Path(args.offload_dir) / "deepspeed"
    nvme.mkdir(parents=True, exist_ok=True)
    shape = sizes(config, base_dtype(args))
    largest, block = shape["largest_param"], shape["block_params"]
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": args.k,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": precision(args) == "bf16-mixed"},
        "zero_optimization": {
            "stage": 3,
            # every swapped parameter takes one whole buffer while it is live: buffers that hold the largest,
            # enough for four blocks' five base matrices and four more, the live window, the prefetch and the
            # reuse distance bounded in blocks to match (benchmarks/scale.py's sizing)
            "offload_param": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False,
                              "buffer_count": 4 * 5 + 4, "buffer_size": largest, "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": False, "buffer_count": 4},
            "sub_group_size": int(1e8),
            # 0: no prefetch. DeepSpeed 0.19.8's NVMe prefetch fails on this model at its second forward
            # ("param 0 already assigned swap buffer id", deepspeedai/DeepSpeed#4072, open): --ds-prefetch 1
            # tries it again (one block)
            "stage3_prefetch_bucket_size": block * args.ds_prefetch,
            "stage3_max_live_parameters": 2 * block,
            "stage3_max_reuse_distance": block,
        },
        "steps_per_print": 10**9,
    }
    clock = Steps()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with deepspeed.zero.Init(remote_device="nvme", config_dict_or_path=ds_config):
        model = GPT(config)
    mark_only_lora_as_trainable(model)
    t1 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=ds_config)
    t2 = time.perf_counter()
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    batches = list(token_loader(config.vocab_size, args.seq, args.k * args.steps))
    clock.start()
    for step in range(args.steps):
        for x, y in batches[step * args.k : (step + 1) * args.k]:
            logits = engine(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
            engine.backward(loss)
            engine.step()
        clock.step()
    row = clock.row(args.k, args.seq)
    files = [f for f in nvme.rglob("*") if f.is_file()]
    row.update(idle_rss_mb=round(idle_mb, 1), peak_rss_mb=round(peak_rss_mb(), 1), build_s=round(t1 - t0, 2),
               initialize_s=round(t2 - t1, 2), param_dtypes=dtypes, deepspeed_version=deepspeed.__version__,
               nvme_files_gb=round(sum(f.stat().st_blocks * 512 for f in files) / 1e9, 3),
               deepspeed_zero=ds_config["zero_optimization"], aio="defaults")
    return row


def run_limit(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """The compute term: the model resident in RAM, ``--k`` micro-batches forward and backward under the
    run's autocast (as Lightning's precision plugin enters it), every core; the median window after one
    warm-up. And one more forward of the ``--k`` micro-batches (greedysnake's recompute), apart."""
    import torch
    import torch.nn.functional as F
    from _common import token_loader

    model = build_model(config, base_dtype(args), materialize=True)
    batches = list(token_loader(config.vocab_size, args.seq, args.k))
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if precision(args) == "bf16-mixed"
                else contextlib.nullcontext())

    def window() -> float:
        t0 = time.perf_counter()
        for x, y in batches:
            with autocast:
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1)) / args.k
            loss.backward()
        return time.perf_counter() - t0

    def forward() -> float:
        t0 = time.perf_counter()
        with torch.no_grad(), autocast:
            for x, _ in batches:
                model(x)
        return time.perf_counter() - t0

    window()  # (warm-up)
    times = [window() for _ in range(args.compute_windows)]
    forwards = [forward() for _ in range(args.compute_windows)]
    compute_s = statistics.median(times)
    out = {"compute_s": round(compute_s, 3), "compute_times": [round(t, 3) for t in times],
           "recompute_s": round(statistics.median(forwards), 3), "threads": torch.get_num_threads()}
    if precision(args) == "bf16-mixed":  # DeepSpeed's way: every parameter bf16, no autocast (context only)
        model.bfloat16()
        autocast = contextlib.nullcontext()
        window()
        out["compute_pure_bf16_s"] = round(statistics.median(window() for _ in range(args.compute_windows)), 3)
    return {**out, "peak_rss_mb": round(peak_rss_mb(), 1)}


def child(args: argparse.Namespace) -> dict[str, Any]:
    config = lora_config(args, args.n_layer)
    run = {"greedysnake": run_greedysnake, "deepspeed": run_deepspeed, "limit": run_limit}[args.child]
    return {"system": args.child, **run(args, config)}


# -- the parent ---------------------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def machine_record(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_greedysnake.precision import cpu_bf16_slowdown

    info: dict[str, Any] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(("MemTotal", "MemAvailable")):
                key, value = line.split(":", 1)
                info[f"{key}_gb"] = round(int(value.split()[0]) * 1024 / 1e9, 1)
    flags = cpu_flags()
    info.update(cores=os.cpu_count(), avx512_bf16="avx512_bf16" in flags, amx_bf16="amx_bf16" in flags,
                bf16_matmul_slowdown_vs_fp32=round(cpu_bf16_slowdown(), 2),
                disk_read_GBps=round(args.read_bps / 1e9, 3), disk_write_GBps=round(args.write_bps / 1e9, 3),
                disk_probe_mb=args.probe_mb, offload_dir=args.offload_dir or tempfile.gettempdir())
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-gb", type=float, default=3.0, help="the frozen base's size, GB (1e9 bytes)")
    parser.add_argument("--host-budget-gb", type=float, default=1.0,
                        help="greedysnake's host budget (auto_host_budget_bytes), GiB")
    parser.add_argument("--k", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6,
                        help="optimizer steps, the first two warm-up (6 or more: the step after greedysnake's plan, "
                             "which may run slow, does not decide the median)")
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--width", default="llama-1b", choices=sorted(WIDTHS))
    parser.add_argument("--base-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: bfloat16 where the CPU has native bf16 (avx512_bf16 or amx_bf16), else float32")
    parser.add_argument("--compute-windows", type=int, default=2, help="timed windows of the limit's compute")
    parser.add_argument("--probe-mb", type=int, default=1024, help="the disk probe's bytes each way, MiB")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--ds-prefetch", type=int, default=0,
                        help="DeepSpeed's stage3_prefetch_bucket_size in blocks (0: off; see run_deepspeed)")
    parser.add_argument("--layers-per-unit", type=int, default=0,
                        help="greedysnake's layers_per_unit (0: unset, setup chooses)")
    parser.add_argument("--timeout-min", type=float, default=60.0, help="per system")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, about a minute: a smoke run")
    parser.add_argument("--offload-dir", default=None, help="the SSD directory (default: a temp dir)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n-layer", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--resolved-base-dtype", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(Path(__file__).parent))
        print("RESULT " + json.dumps(child(args), default=str))
        return
    if args.quick:
        defaults = {a.dest: a.default for a in parser._actions}
        for key, value in QUICK.items():  # (a flag given beside --quick wins)
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    if args.out is None:
        # (--quick's smoke numbers stay out of benchmarks/results/: every file there is on the benchmark page)
        args.out = (str(Path(tempfile.gettempdir()) / "lora_quick.json") if args.quick
                    else str(Path(__file__).parent / "results" / "lora.json"))
    run(args)


def run(args: argparse.Namespace) -> None:
    import importlib.util

    from _common import child_result, print_table, write_result

    from lightning_greedysnake.planner.measure import disk_bandwidth

    flags = cpu_flags()
    native_bf16 = bool({"avx512_bf16", "amx_bf16"} & flags)
    args.resolved_base_dtype = args.base_dtype if args.base_dtype != "auto" else (
        "bfloat16" if native_bf16 else "float32")
    if args.resolved_base_dtype == "bfloat16" and not native_bf16:
        print("  WARNING: this CPU has no native bf16 (avx512_bf16/amx_bf16): bf16 matmuls are emulated, ~100x "
              "slower than fp32; every system and the limit are compute-bound by the emulation", file=sys.stderr)
    args.n_layer = layers_for(args)
    config = lora_config(args, args.n_layer)
    shape = sizes(config, base_dtype(args))
    print(f"  model: {shape['n_layer']} layers, base {shape['base_params'] / 1e9:.3f}B parameters = "
          f"{shape['base_bytes'] / 1e9:.3f} GB {args.resolved_base_dtype}, LoRA {shape['lora_params'] / 1e6:.2f}M "
          f"fp32; precision {precision(args)}; host budget {args.host_budget_gb} GiB", file=sys.stderr)
    systems = list(args.systems)
    skipped: dict[str, str] = {}
    if "deepspeed" in systems and importlib.util.find_spec("deepspeed") is None:
        skipped["deepspeed"] = ("not run: deepspeed is not installed (apt-get install -y libaio-dev && pip install "
                                "--no-build-isolation deepspeed==0.19.8)")
        systems.remove("deepspeed")
    rows: list[dict[str, Any]] = []
    offload_root = args.offload_dir
    if offload_root is not None:
        Path(offload_root).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=offload_root, prefix="lora_") as tmp:
        args.offload_dir = tmp  # (the children's)
        # the disk's O_DIRECT speed in the offload directory, the best of three (--quick: once, a small probe)
        args.read_bps, args.write_bps = disk_bandwidth(Path(tmp), nbytes=args.probe_mb * MiB,
                                                       repeats=1 if args.quick else 3)
        print(f"  disk: read {args.read_bps / 1e9:.2f} GB/s, write {args.write_bps / 1e9:.2f} GB/s (O_DIRECT, "
              f"{args.probe_mb} MiB)", file=sys.stderr)
        args.offload_dir = offload_root
        machine = machine_record(args)
        args.offload_dir = tmp
        child_flags = ["k", "seq", "steps", "lora_r", "width", "compute_windows", "host_budget_gb", "n_layer", "ds_prefetch", "layers_per_unit",
                       "resolved_base_dtype", "offload_dir"]
        for system in systems:
            t0 = time.monotonic()
            row = child_result(__file__, system, args, child_flags, [], timeout_s=args.timeout_min * 60)
            if "error" in row:
                print(row["log_tail"], file=sys.stderr)
                row = {"system": system, "status": f"failed: {row['error']}", "log_tail": row["log_tail"][-2000:]}
            else:
                row["status"] = "ok"
            row["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            print(f"  done {system}: {row['status']} ({row['wall_s']} s)", file=sys.stderr)
    args.offload_dir = offload_root
    rows += [{"system": s, "status": why} for s, why in skipped.items()]
    summary = add_ratios(rows, args, shape)
    print_table(rows, ["system", "status", "step_s", "tokens_per_s", "disk_read_gb_per_step",
                       "disk_written_gb_per_step", "train_peak_rss_mb", "peak_rss_mb", "compute_s"])
    print("  " + ", ".join(f"{k} {v}" for k, v in summary.items()), file=sys.stderr)
    write_result(args.out, args, ["base_gb", "host_budget_gb", "k", "seq", "steps", "lora_r", "width",
                                  "resolved_base_dtype", "compute_windows", "quick"],
                 rows, {**machine, "model": {**shape, "precision": precision(args), "base_dtype":
                                             args.resolved_base_dtype, "summary": summary}})


def add_ratios(rows: list[dict[str, Any]], args: argparse.Namespace, shape: dict[str, Any]) -> dict[str, Any]:
    """The limit's row (``limit_s`` and its terms) and greedysnake's ratios against DeepSpeed and the limit."""
    by = {r["system"]: r for r in rows if r.get("status") == "ok"}
    summary: dict[str, Any] = {}
    limit, gs, ds = by.get("limit"), by.get("greedysnake"), by.get("deepspeed")
    if limit is not None:
        terms = {"compute": limit["compute_s"], "disk": shape["base_bytes"] / args.read_bps}
        binds = max(terms, key=lambda t: terms[t])
        limit.update(disk_s=round(terms["disk"], 3), limit_s=round(terms[binds], 3), binds=binds,
                     step_s=round(terms[binds], 3), tokens_per_s=round(args.k * args.seq / terms[binds], 2))
        summary.update(limit_s=limit["limit_s"], binds=binds, compute_s=limit["compute_s"], disk_s=limit["disk_s"],
                       recompute_s=limit["recompute_s"], compute_pure_bf16_s=limit.get("compute_pure_bf16_s"))
    if gs is not None and limit is not None:
        gs["step_vs_limit"] = round(gs["step_s"] / limit["limit_s"], 3)
        if gs.get("recompute"):  # (the plan kept the recomputing backward)
            gs["step_vs_limit_with_recompute"] = round(
                gs["step_s"] / max(limit["compute_s"] + limit["recompute_s"], limit["disk_s"]), 3)
        summary.update(step_vs_limit=gs["step_vs_limit"], limit_aim_met=gs["step_vs_limit"] <= 1.2)
    if gs is not None and ds is not None:
        gs["vs_deepspeed"] = round(gs["tokens_per_s"] / ds["tokens_per_s"], 2)
        summary.update(vs_deepspeed=gs["vs_deepspeed"], deepspeed_aim_met=gs["vs_deepspeed"] >= 3.0)
    for r in (gs, ds):
        if r is None:
            continue
        if r.get("disk_read_gb_per_step") is not None:
            r["reads_vs_base"] = round(r["disk_read_gb_per_step"] * 1e9 / shape["base_bytes"], 2)
        if r.get("idle_rss_mb") is not None:
            r["growth_mb"] = round(r["peak_rss_mb"] - r["idle_rss_mb"], 1)
            summary[f"{r['system']}_peak_rss_mb"] = r["peak_rss_mb"]
        summary[f"{r['system']}_tokens_per_s"] = r["tokens_per_s"]
    if gs is not None and limit is not None and gs.get("gs_ssd_read_gb_per_step") is not None:
        # beside the limit (the base read once a window): the same with the bytes greedysnake's own
        # counters say it moved (the vertical order reads a unit's weights in its forward and again in its
        # recomputing backward), over the probed speeds
        moved_s = gs["gs_ssd_read_gb_per_step"] * 1e9 / args.read_bps + gs["gs_ssd_written_gb_per_step"] * 1e9 / args.write_bps
        gs["limit_as_moved_s"] = round(max(limit["compute_s"], moved_s), 3)
        gs["step_vs_limit_as_moved"] = round(gs["step_s"] / gs["limit_as_moved_s"], 3)
    return summary


if __name__ == "__main__":
    main()
