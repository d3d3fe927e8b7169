"""greedysnake on one CUDA GPU against in-memory Lightning, in stages that each keep what they finish.

Run by ``benchmarks/gpu_session.sh`` (which gives each stage its time; read its header for the plan),
one stage per call:

    python benchmarks/gpu.py disk --out DIR --candidates PATH...   # first: df -T, O_DIRECT probe, machine rates
    python benchmarks/gpu.py headline --out DIR --offload-dir D --budget-s 97
    python benchmarks/gpu.py resident --out DIR --offload-dir D --budget-s 27
    python benchmarks/gpu.py rest --out DIR --offload-dir D --budget-s 87
    python benchmarks/gpu.py summary --out DIR                     # the table and DIR/gpu.json, from the rows

The lent machine is an H100 (80 GB) or an H200 (141 GB): nothing here assumes either (the model's state,
2.2 GB, fits both many times over; the datasheet's bf16 peak is looked up by the name the GPU reports).

The configurations (each in a fresh process, ``bf16-mixed``, the package GPT, random tokens):

- ``lightning``: Lightning's own ``strategy="auto"`` with everything on the GPU (the in-memory reference);
- ``default``: ``GreedySnakeStrategy()`` as is (``auto=True``), but with ``auto_device_budget_bytes`` an
  eighth of the model's training state (weights, gradients, AdamW moments), so the device plan offloads
  it: the placement keeps what fits of the compute weights on the GPU and the planner places the rest;
- ``horizontal``: the same with ``schedule="horizontal"`` (ZeRO-Infinity's order on the same plan);
- ``resident_weights``: ``auto=False``, every kind on SSD but the 16-bit compute weights, which stay on
  the GPU (no weight traffic on the disk; one H2D copy of each unit's new weights per step);
- ``vertical_ssd`` / ``horizontal_ssd``: ``auto=False``, every kind on SSD (ZeRO-Infinity's placement),
  in each order: the vertical-against-horizontal pair, and greedysnake's comparator for
  ``benchmarks/gpu_deepspeed.py`` at the same K;
- ``vertical_fp16``: ``vertical_ssd`` in ``16-mixed`` (loss scaling), only where ``--configs`` names it.

Each configuration has its expected seconds beside it in :data:`STAGES` and its child gets
:data:`TIMEOUT_FACTOR` times that (``settle()`` included), less where the stage's later configurations
need their own expected time; one that would start with less than its expected time left is skipped.
Each row is appended to ``DIR/rows.jsonl`` the moment its configuration ends, with ``expected_s`` and
``timeout_s``; a configuration that fails or times out is recorded (``error``, the end of its log: the
child prints each step's end as it happens) and the stage goes on.

The steady state is :data:`TIMED_STEPS` optimizer steps after :data:`WARMUP_STEPS` (``auto=True`` plans
after the second), timed from the end of the last warm-up step to the end of the last, drained
(``torch.cuda.synchronize`` there: the benchmark's clock, not the strategy's). Each row records what
was measured: the steady step (``step_s``, each step's ``step_times``), tokens/s, achieved TFLOP/s
(model FLOPs: 6 x parameters x tokens plus attention, not counting recomputation), the peak host RSS,
the SSD bytes per steady step (the kernel's counters of the process, ``/proc/self/io``) and the bytes
the device tier copied per steady step. ``summary`` adds, from ``DIR/machine.json``'s rates: MFU against
the measured bf16 matmul rate and against the datasheet's dense bf16 peak, and the fraction of a roofline
of physical terms (``of_roofline``: the largest term over the step; as ``benchmarks/compare.py``'s
``vs_limit``, inverted): compute = the in-memory Lightning step at the same K (times 8/6 where the system
recomputes the forward), disk = the SSD bytes at the probed O_DIRECT speeds (reads, then writes), PCIe =
the copied bytes at the measured pinned bandwidth, optimizer = every element at the measured host AdamW
rate (where the optimizer runs on the host); with the GPU's idle share, the ratios to Lightning in memory
and to DeepSpeed, and ``DIR/gpu.json``, the file ``benchmarks/report.py``'s GPU table reads (copy it to
``benchmarks/results/gpu_<card>.json``).

``--dry-run`` (with ``GREEDYSNAKE_SIMULATE_DEVICE=1`` on a CPU): tiny sizes, every configuration once at
one small K, each in a child process as on the GPU, each expecting :data:`DRY_RUN_EXPECTED_S`; the GPU's
rates measured on the CPU: the whole path in a minute or two, so a typo costs no GPU time.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

WARMUP_STEPS = 2
"""Optimizer steps not timed: warm-up, and ``auto=True``'s plan after the second."""
TIMED_STEPS = 3
"""Optimizer steps timed after the warm-step plan."""


class Config(NamedTuple):
    name: str
    k: int
    expected_s: float
    """Seconds its child should take on the GPU machine, ``settle()`` included."""


STAGES: dict[str, list[Config]] = {
    # Each expected time on the GPU machine (either card: the model's compute is ~35 ms a step at K=4
    # on either, the host and the disk bind), by arithmetic from the dry run's start-up scaled to that
    # machine's rates: settle 2 s; Python, torch, Lightning and the package 4 s (5.4 s on this 2-core
    # box); CUDA and Lightning's setup 2 s; greedysnake's setup 2-3 s (the state written to RAM or SSD,
    # the staging arena registered, auto=True's disk probe); the end of fit 1 s; then 5 steps. Replaced
    # by the first GPU run's wall_s (``summary`` prints them beside these).
    "headline": [
        Config("lightning", 4, 10),    # 8 s start; steps ~0.1 s (GPU AdamW, ~35 ms of compute)
        Config("default", 4, 16),      # 11 s start; steps ~0.4 s (host AdamW over 135 M elements binds) + plan 1 s
        Config("horizontal", 4, 16),   # the same; ~0.2 s a step more PCIe (weights copied 2K times)
        Config("lightning", 8, 11),
        Config("default", 8, 18),
        Config("horizontal", 8, 18),   # ~6.5 GB over PCIe a step (~0.3 s)
    ],
    "resident": [
        Config("resident_weights", 8, 26),  # 12 s start (14P = 1.9 GB written at setup); ~2.6 s a step:
    ],                                      # 16P = 2.2 GB read at ~1.2 GB/s, written at ~2.2 GB/s
    "rest": [
        Config("vertical_ssd", 8, 30),      # 13 s start; ~3.4 s a step (20P read, 18P written)
        Config("horizontal_ssd", 8, 50),    # 13 s start; ~7.5 s a step (the weights read 2K times: +32P)
    ],
}
"""The configurations of each benchmark stage, in order of value (``gpu_session.sh`` runs the stages in
order; a stage out of time skips its last ones), each with its expected seconds on the GPU machine."""

EXPECTED_FROM = "estimate"
"""Where :data:`STAGES`' seconds come from: ``"estimate"`` (the arithmetic above), or, once the first GPU
run's ``wall_s`` replaced them, that run's card and date."""

EXTRA_CONFIGS = {"vertical_fp16": 30.0}
"""Configurations no stage runs (``--configs`` may name them), with their expected seconds."""

CONFIGS = ("lightning", "default", "horizontal", "resident_weights", "vertical_ssd", "horizontal_ssd",
           "vertical_fp16")

TIMEOUT_FACTOR = 2.0
"""A configuration's child gets this many times its expected seconds."""

DRY_RUN_EXPECTED_S = 15.0
"""``--dry-run``'s expected seconds for every configuration (tiny sizes in a child on a CPU: 7-14 s on a
shared 2-core box, most of it imports)."""

HANG_ENV = "GREEDYSNAKE_GPU_BENCH_HANG"
"""A configuration name: that configuration's child sleeps instead of running (a hang, for the test that
the other configurations still write their rows: ``tests/unit/test_gpu_session.py``)."""

RECOMPUTE = 8.0 / 6.0
"""greedysnake's backward recomputes each unit's forward: its FLOPs over the model's."""

DATASHEET_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989.4e12,
                        "H200 NVL": 835e12, "H200": 989.4e12}
"""NVIDIA's datasheet dense bf16 peak (no sparsity) by the name the GPU reports: the longest key found in
``torch.cuda.get_device_name()`` (``NVIDIA H100 80GB HBM3``, ``NVIDIA H200``: the SXM parts)."""

DEVICE_BUDGET_SHARE = 8
"""``default``'s ``auto_device_budget_bytes``: the model's training state over this (the device plan
offloads a state over half its budget; an eighth keeps about half the compute weights on the GPU)."""

NOT_A_DISK = ("tmpfs", "ramfs", "devtmpfs", "squashfs", "proc", "sysfs")
"""Filesystem types that are no offload disk (memory, or read-only)."""

SUMMARY_COLUMNS = ["stage", "config", "k", "step_s", "tokens_per_s", "TFLOPs", "mfu", "mfu_datasheet", "peak_rss_gb",
                   "ssd_GB_per_step", "binds", "of_roofline", "vs_in_memory", "gpu_idle", "vs_deepspeed",
                   "expected_s", "wall_s", "timeout_s", "error"]


def expected_s(name: str, k: int) -> float:
    """A configuration's expected seconds on the GPU machine: its own in :data:`STAGES`, else the same
    name's at another K, else :data:`EXTRA_CONFIGS`' (30 s for anything else)."""
    configs = [c for stage in STAGES.values() for c in stage]
    same = [c.expected_s for c in configs if c.name == name and c.k == k] or [
        c.expected_s for c in configs if c.name == name]
    return same[0] if same else EXTRA_CONFIGS.get(name, 30.0)


def datasheet_flops(device_name: str) -> float:
    """:data:`DATASHEET_BF16_FLOPS` for this GPU (0.0 for a card not in it)."""
    keys = [k for k in DATASHEET_BF16_FLOPS if k in device_name]
    return DATASHEET_BF16_FLOPS[max(keys, key=len)] if keys else 0.0


# ---- the disk stage: recorded first, before anything imports torch ----

def filesystem(path: Path) -> dict[str, str]:
    """The mount that holds ``path`` (the longest mount point above it in ``/proc/mounts``)."""
    path = path.resolve()
    best = {"mount": "/", "type": "unknown", "source": "unknown"}
    with open("/proc/mounts") as f:
        for line in f:
            source, mount, fstype = line.split()[:3]
            mount = mount.replace("\\040", " ")
            if (path == Path(mount) or Path(mount) in path.parents) and len(mount) >= len(best["mount"]):
                best = {"mount": mount, "type": fstype, "source": source}
    return best


def o_direct_probe(directory: Path, nbytes: int = 8 << 20) -> dict[str, Any]:
    """Write and read back ``nbytes`` with O_DIRECT in ``directory`` (page-aligned memory): whether the
    filesystem takes it, and the seconds of each (one request: a probe, not a bandwidth measurement)."""
    path = directory / ".greedysnake-odirect-probe"
    buf = mmap.mmap(-1, nbytes)  # (page-aligned, as O_DIRECT needs)
    buf.write(os.urandom(4096) * (nbytes // 4096))
    result: dict[str, Any] = {"ok": False, "bytes": nbytes}
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            t0 = time.perf_counter()
            written = os.pwritev(fd, [buf], 0)
            os.fsync(fd)
            result["write_s"] = round(time.perf_counter() - t0, 4)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            back = mmap.mmap(-1, nbytes)
            t0 = time.perf_counter()
            read = os.preadv(fd, [back], 0)
            result["read_s"] = round(time.perf_counter() - t0, 4)
        finally:
            os.close(fd)
        result["ok"] = written == nbytes and read == nbytes and back[:] == buf[:]
        if not result["ok"]:
            result["error"] = f"wrote {written}, read {read} bytes, equal: {back[:] == buf[:]}"
    except OSError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        path.unlink(missing_ok=True)
    return result


def choose_offload_dir(candidates: list[str]) -> tuple[Path, list[dict[str, Any]]]:
    """The first candidate on a real disk (not a memory filesystem) where O_DIRECT works; else the first
    not in memory; else the first. Every candidate's filesystem and probe, for the record."""
    seen = []
    for c in candidates:
        path = Path(c).expanduser()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            seen.append({"path": str(path), "error": f"{type(e).__name__}: {e}"})
            continue
        fs = filesystem(path)
        seen.append({"path": str(path), **fs, "o_direct": o_direct_probe(path) if fs["type"] not in NOT_A_DISK else
                     {"ok": False, "error": f"{fs['type']} is memory, not a disk: not probed"}})
    usable = [s for s in seen if "error" not in s]
    for good in ([s for s in usable if s["type"] not in NOT_A_DISK and s["o_direct"]["ok"]],
                 [s for s in usable if s["type"] not in NOT_A_DISK], usable):
        if good:
            return Path(good[0]["path"]), seen
    raise SystemExit(f"no usable offload directory among {candidates}: {seen}")


def _command(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{cmd[0]}: {e}"


def disk_stage(args: argparse.Namespace) -> None:
    """``DIR/disk.json`` (each candidate's filesystem and O_DIRECT probe, the choice), then
    ``DIR/machine.json`` (the GPU, and the rates the roofline and MFU use); prints the chosen directory last."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen, seen = choose_offload_dir(args.candidates)
    record = {"candidates": seen, "chosen": str(chosen)}
    (out / "disk.json").write_text(json.dumps(record, indent=2))
    for s in seen:
        print(f"  {s['path']}: {s.get('type', '?')} ({s.get('source', '?')}), O_DIRECT "
              f"{'ok' if s.get('o_direct', {}).get('ok') else s.get('o_direct', {}).get('error', s.get('error'))}",
              file=sys.stderr)
    from _common import machine, measure_machine

    query = "--query-gpu=name,memory.total,memory.used,driver_version"
    rates: dict[str, Any] = {**machine(), "nvidia_smi": _command(["nvidia-smi", query, "--format=csv"])}
    measure_machine(args, str(chosen), quick=args.dry_run)
    gpu = measure_gpu(args)
    import lightning
    import torch

    rates.update(torch=torch.__version__, lightning=lightning.__version__, cuda=torch.cuda.is_available(), **gpu,
                 read_bps=args.read_bps, write_bps=args.write_bps, opt_rate=args.opt_rate,
                 opt_threads=args.opt_threads, peak_flops=args.peak_flops, pcie_bps=args.pcie_bps)
    (out / "machine.json").write_text(json.dumps(rates, indent=2))
    print(chosen)


def measure_gpu(args: argparse.Namespace) -> dict[str, Any]:
    """bf16 matmul rate and pinned host<->device bandwidth, onto ``args``; without CUDA (the dry run),
    the same measurements on the CPU at a small size (fp32 matmul, pageable copies). Returns the GPU's
    name, memory, datasheet bf16 peak and CUDA's start-up seconds."""
    import torch

    cuda = torch.cuda.is_available()
    gpu: dict[str, Any] = {}
    if cuda:
        t0 = time.perf_counter()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        name = torch.cuda.get_device_name()
        gpu = {"gpu": name, "gpu_memory_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
               "datasheet_flops": datasheet_flops(name), "cuda_start_s": round(time.perf_counter() - t0, 2)}
    n = 8192 if cuda else 256
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    sync()
    args.peak_flops = 20 * 2 * n**3 / (time.perf_counter() - t0)
    nbytes = 1 << 30 if cuda else 1 << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    sync()
    t0 = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
        host.copy_(dev, non_blocking=True)
    sync()
    args.pcie_bps = 6 * nbytes / (time.perf_counter() - t0)
    print(f"  {gpu.get('gpu', 'cpu (dry run)')}: matmul {args.peak_flops / 1e12:.1f} TFLOP/s"
          + (f" ({args.peak_flops / gpu['datasheet_flops']:.0%} of the datasheet's)" if gpu.get("datasheet_flops")
             else "") + f", copies {args.pcie_bps / 1e9:.1f} GB/s", file=sys.stderr)
    return gpu


# ---- one configuration (a child) ----

def _model_flops(args: argparse.Namespace, params: int, tokens: int) -> float:
    """6 x parameters x tokens (the embedding lookup excluded) plus causal attention's matmuls."""
    dense = params - args.vocab * args.n_embd
    attention = 6 * args.n_layer * args.seq * args.n_embd * tokens  # QK^T and AV, forward+backward, causal half
    return 6.0 * dense * tokens + attention


def _placement(strategy: Any) -> str | None:
    """Where each kind's units went (device/host/ssd counts), from setup's placement plan."""
    plan = getattr(strategy, "placement_plan", None)
    if plan is None:
        return None
    return ", ".join(f"{kind} {p.device_units}/{p.host_units - p.device_units}/{p.num_units - p.host_units}"
                     for kind, p in plan.kinds.items()) + " (device/host/ssd units)"


def io_bytes() -> tuple[int, int]:
    """This process's bytes read from and written to storage so far (the kernel's ``/proc/self/io``: every
    thread's, O_DIRECT included; the page cache's hits not); zeros where the file is missing."""
    try:
        fields = dict(line.split(": ", 1) for line in Path("/proc/self/io").read_text().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return 0, 0


def peak_rss_gb() -> float:
    """This process's peak resident memory so far (``getrusage``), GiB."""
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def measured_row(args: argparse.Namespace, params: int, k: int, ends: list[float], io: list[tuple[int, int]],
                 recompute: bool) -> dict[str, Any]:
    """A row's measurements, common to this script's configurations and ``gpu_deepspeed.py``: ``ends`` the
    clock at the end of the last warm-up step and of each timed step, ``io`` :func:`io_bytes` at the first
    and the last of them. What needs the machine's rates (MFU, the roofline) is the summary's."""
    timed = len(ends) - 1
    wall = (ends[-1] - ends[0]) / timed
    tokens = k * args.micro_batch * args.seq
    flops = _model_flops(args, params, tokens)
    return {
        "params": params, "params_M": round(params / 1e6, 1), "step_s": round(wall, 3),
        "step_times": [round(b - a, 3) for a, b in zip(ends, ends[1:])], "timed_steps": timed,
        "tokens_per_s": round(tokens / wall, 1), "model_flops": flops, "TFLOPs": round(flops / wall / 1e12, 3),
        "recompute": recompute, "peak_rss_gb": peak_rss_gb(),
        "ssd_read_GB_per_step": round((io[1][0] - io[0][0]) / timed / 1e9, 6),
        "ssd_write_GB_per_step": round((io[1][1] - io[0][1]) / timed / 1e9, 6),
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    name, k = args.child.split(":")
    k = int(k)

    def progress(what: str) -> None:  # (stderr: the end of a child that timed out shows how far it got)
        print(f"  [{name} K={k}] {what} at {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)

    if os.environ.get(HANG_ENV) == name:
        progress(f"hanging ({HANG_ENV})")
        time.sleep(10**6)
    import lightning as L
    import torch
    from _common import gpt_module, token_loader

    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.config import OffloadConfig
    from lightning_greedysnake.planner import roofline
    from lightning_greedysnake.strategy.planning.placement import unit_costs

    progress("imports done")
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    precision = "16-mixed" if name == "vertical_fp16" else "bf16-mixed"
    schedule = "horizontal" if name in ("horizontal", "horizontal_ssd") else "vertical"
    Module, _ = gpt_module(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq)
    with torch.device("meta"):
        params = sum(p.numel() for p in Module().parameters())
    offload_dir = Path(args.offload_dir) / args.child.replace(":", "_")
    if name == "lightning":
        strategy: Any = "auto"
    elif name in ("default", "horizontal"):  # GreedySnakeStrategy() as is, its state over the device budget
        state_bytes = params * 16  # fp32 weights, gradient and two AdamW moments (device_plan's count)
        strategy = GreedySnakeStrategy(schedule=schedule, offload_dir=offload_dir,
                                       auto_device_budget_bytes=state_bytes // DEVICE_BUDGET_SHARE)
    else:  # every kind on SSD; resident_weights: but the 16-bit compute weights stay on the GPU
        weights = "device" if name == "resident_weights" else "ssd"
        strategy = GreedySnakeStrategy(auto=False, schedule=schedule, offload_dir=offload_dir,
                                       offload=OffloadConfig.everywhere("ssd", weights=weights, return_weights=False),
                                       alpha=0.25, lag=1)
    ends: list[float] = []  # the clock at the end of the last warm-up step and of each timed step
    io: list[tuple[int, int]] = []
    copied: list[int] = []
    captured: dict[str, Any] = {}

    def copy_bytes(trainer: Any) -> int:
        copies = getattr(getattr(trainer.strategy, "tensor_manager", None), "copies", None)
        return 0 if copies is None else copies.counts.bytes_to_device + copies.counts.bytes_to_host

    class Clock(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            progress("set up")

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % k:
                return
            step = (batch_idx + 1) // k  # a window's end
            sync()  # (the benchmark's clock)
            if WARMUP_STEPS <= step < args.steps:  # (the last step's end is the drained end of fit)
                ends.append(time.perf_counter())
            if step == WARMUP_STEPS:  # the steady state starts: the counters' first reading
                io.append(io_bytes())
                copied.append(copy_bytes(trainer))
            progress(f"step {step} done")

        def on_train_end(self, trainer: Any, module: Any) -> None:
            manager = getattr(trainer.strategy, "tensor_manager", None)
            captured["offloaded"] = manager is not None  # (the strategy lets it go after fit)
            if manager is not None:
                manager.drain()
                captured["units"] = unit_costs(manager)
                captured["placement"] = _placement(trainer.strategy)
            sync()
            ends.append(time.perf_counter())
            io.append(io_bytes())
            copied.append(copy_bytes(trainer))

    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, precision=precision,
                        max_steps=args.steps, accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()],
                        default_root_dir=args.offload_dir)
    with trainer.init_module(empty_init=name not in ("lightning", "default", "horizontal")):
        module = Module()
    trainer.fit(module, token_loader(args.vocab, args.seq, k * args.steps * args.micro_batch, args.micro_batch))
    progress("fit done")
    row: dict[str, Any] = {"config": name, "k": k, **measured_row(args, params, k, ends, io, name != "lightning"),
                           "offloaded": captured["offloaded"], "host_optimizer": captured["offloaded"]}
    row["pcie_GB_per_step"] = round((copied[1] - copied[0]) / row["timed_steps"] / 1e9, 6)
    if captured.get("placement"):
        row["placement"] = captured["placement"]
    if "units" in captured:  # the traffic model's bytes a step, beside the kernel's count
        # (16-mixed waits for the whole backward before stepping, as norm clipping does)
        traffic = roofline.traffic(captured["units"], schedule, k, clip_norm=name == "vertical_fp16")
        row["model_ssd_GB_per_step"] = round((traffic.read_bytes + traffic.write_bytes) / 1e9, 3)
    return row


# ---- a benchmark stage ----

def stage_configs(args: argparse.Namespace) -> list[Config]:
    """The stage's configurations (or ``--configs``'), each with its expected seconds (under ``--dry-run``:
    every configuration once, at one small K, each expecting :data:`DRY_RUN_EXPECTED_S`)."""
    if args.configs:
        pairs = [(c.split(":")[0], int(c.split(":")[1])) for c in args.configs]
        configs = [Config(n, k, expected_s(n, k)) for n, k in pairs]
    else:
        configs = list(STAGES.get(args.stage, []))
    if args.dry_run:
        names = list(dict.fromkeys(c.name for c in configs))
        configs = [Config(n, DRY_RUN_K, DRY_RUN_EXPECTED_S) for n in names]
    return configs


def config_timeout_s(expected: float, left: float, later: float) -> float:
    """A child's seconds: :data:`TIMEOUT_FACTOR` times its ``expected``, but no more than what is ``left`` of
    the stage less the ``later`` configurations' expected seconds, unless that is under its own expected
    (then up to what is left)."""
    return round(max(0.0, min(TIMEOUT_FACTOR * expected, max(expected, left - later), left)), 1)


def bench_stage(args: argparse.Namespace) -> bool:
    """Each configuration of the stage in turn, each in a fresh process under its own timeout, its row
    appended to ``DIR/rows.jsonl`` as it ends; whether every one ran."""
    from _common import MODEL_FLAGS, append_row, child_result

    deadline = time.monotonic() + args.budget_s
    rows_path = str(Path(args.out) / "rows.jsonl")
    flags = [*MODEL_FLAGS, "micro_batch", "steps"]
    configs = stage_configs(args)
    failed = False
    for i, (name, k, expected) in enumerate(configs):
        left = deadline - time.monotonic()
        timeout = config_timeout_s(expected, left, sum(c.expected_s for c in configs[i + 1:]))
        t0 = time.monotonic()
        row: dict[str, Any]
        if left < expected:
            row = {"error": f"skipped: {left:.0f} s left of the stage's {args.budget_s:.0f} s, "
                            f"{expected:.0f} expected"}
        else:
            row = child_result(__file__, f"{name}:{k}", args, flags, ["--offload-dir", args.offload_dir],
                               timeout_s=timeout)
        row = {"stage": args.stage, "config": name, "k": k, **row, "expected_s": expected, "timeout_s": timeout,
               "wall_s": round(time.monotonic() - t0, 1)}
        append_row(rows_path, row)
        print(f"  {name} K={k}: " + (f"{row['tokens_per_s']} tokens/s, {row['step_s']} s/step"
                                     if "error" not in row else f"FAILED ({row['error']})")
              + f" [{row['wall_s']} s of {timeout} s; {expected:.0f} expected]", file=sys.stderr)
        if "log_tail" in row:
            print(row["log_tail"][-1500:], file=sys.stderr)
        failed = failed or "error" in row
    return not failed


# ---- the summary ----

def derive(rows: list[dict[str, Any]], rates: dict[str, Any]) -> list[dict[str, Any]]:
    """``rows`` with what needs the machine's ``rates`` (``machine.json``) or two rows: MFU against the
    measured matmul rate and the datasheet's peak, the physical roofline's terms, the one that binds and
    the fraction of it achieved, the GPU's idle share, the ratios to Lightning in memory and to DeepSpeed."""
    ok = [r for r in rows if "error" not in r and "step_s" in r]
    in_memory = {r["k"]: r["step_s"] for r in ok if r["config"] == "lightning"}
    deepspeed = {r["k"]: r["step_s"] for r in ok if r["config"] == "deepspeed"}
    out = []
    for r in rows:
        r = dict(r)
        if "error" not in r and "step_s" in r:
            achieved = r["model_flops"] / r["step_s"] if "model_flops" in r else r["TFLOPs"] * 1e12
            if rates.get("peak_flops"):
                r["mfu"] = round(achieved / rates["peak_flops"], 3)
            if rates.get("datasheet_flops"):
                r["mfu_datasheet"] = round(achieved / rates["datasheet_flops"], 3)
            if "ssd_read_GB_per_step" in r:
                r["ssd_GB_per_step"] = round(r["ssd_read_GB_per_step"] + r["ssd_write_GB_per_step"], 6)
            terms: dict[str, float] = {}
            if r["k"] in in_memory:  # the same tokens on a busy GPU (recompute included where the system does it)
                terms["compute"] = in_memory[r["k"]] * (RECOMPUTE if r.get("recompute") else 1.0)
            if rates.get("read_bps") and rates.get("write_bps") and "ssd_read_GB_per_step" in r:
                terms["disk"] = (r["ssd_read_GB_per_step"] * 1e9 / rates["read_bps"]
                                 + r["ssd_write_GB_per_step"] * 1e9 / rates["write_bps"])
            if rates.get("pcie_bps") and r.get("pcie_GB_per_step"):
                terms["pcie"] = r["pcie_GB_per_step"] * 1e9 / rates["pcie_bps"]
            if rates.get("opt_rate") and r.get("host_optimizer") and r.get("params"):
                terms["optimizer"] = r["params"] / rates["opt_rate"]
            r.update({f"{t}_s": round(v, 3) for t, v in terms.items()})
            if terms:
                binds = max(terms, key=lambda t: terms[t])
                r.update(binds=binds, roofline_s=round(terms[binds], 3),
                         of_roofline=round(terms[binds] / r["step_s"], 3))
            if r["config"] != "lightning" and r["k"] in in_memory:
                busy = in_memory[r["k"]] * (RECOMPUTE if r.get("recompute") else 1.0)
                r["gpu_idle"] = round(max(0.0, 1.0 - busy / r["step_s"]), 3)
                r["vs_in_memory"] = round(in_memory[r["k"]] / r["step_s"], 3)
            if r["config"] != "deepspeed" and r["k"] in deepspeed:
                r["vs_deepspeed"] = round(deepspeed[r["k"]] / r["step_s"], 3)
        out.append(r)
    return out


def summary(args: argparse.Namespace) -> None:
    """The table of every row in ``DIR/rows.jsonl`` (this script's and ``gpu_deepspeed.py``'s) with
    :func:`derive`'s columns, written to ``DIR/gpu.json`` (``benchmarks/report.py``'s GPU table: the
    command, the machine, the settings, the rows); then each configuration's seconds against its expected
    time, the CUDA tests' outcomes and the stages' times."""
    from _common import print_table, read_rows

    out = Path(args.out)
    rates = json.loads((out / "machine.json").read_text()) if (out / "machine.json").exists() else {}
    everything = read_rows(str(out / "rows.jsonl"))
    builds = [r for r in everything if r.get("config") == "deepspeed_build"]
    rows = derive([r for r in everything if r.get("config") != "deepspeed_build"], rates)
    settings = {key: getattr(args, key) for key in ("n_embd", "n_layer", "n_head", "vocab", "seq", "micro_batch")}
    settings.update(precision="bf16-mixed", warmup_steps=WARMUP_STEPS, timed_steps=args.steps - WARMUP_STEPS,
                    expected_from=EXPECTED_FROM, dry_run=args.dry_run)
    shown = [{**r, "error": str(r["error"])[:60]} if "error" in r else r for r in rows]
    print_table(shown, SUMMARY_COLUMNS)
    result = {"command": "bash benchmarks/gpu_session.sh" + (" --dry-run" if args.dry_run else ""),
              "machine": rates, "settings": settings,
              "rows": [{key: v for key, v in r.items() if key != "log_tail"} for r in rows]}
    (out / "gpu.json").write_text(json.dumps(result, indent=2, default=str))
    ok = [r for r in rows if "error" not in r and "step_s" in r]
    for r in ok:
        if r.get("placement"):
            print(f"  {r['config']} K={r['k']}: {r['placement']}")
    print(f"{len(ok)} of {len(rows)} rows measured ({out / 'rows.jsonl'}; "
          f"with the derived columns: {out / 'gpu.json'})")
    for b in builds:
        print(f"deepspeed build: {b.get('error') or 'ok'} [{b.get('wall_s')} s]")
    print(f"seconds against the expected ({EXPECTED_FROM}; measured, rounded up, for gpu.py's STAGES):")
    for r in rows:
        if "expected_s" in r:
            print(f"  {r['config']} K={r['k']}: {r['wall_s']} s of {r['timeout_s']} s, {r['expected_s']:.0f} expected"
                  + ("" if "error" not in r else " (failed)")
                  + (f"  -> Config({r['config']!r}, {r['k']}, {math.ceil(r['wall_s'])})" if "error" not in r else ""))
    tests = [e for e in read_rows(str(out / "tests.jsonl")) if e.get("event") == "end"]
    outcomes = [e["outcome"] for e in tests]
    print(f"CUDA tests: {({o: outcomes.count(o) for o in sorted(set(outcomes))}) or 'none ran'}"
          + (f", the first {tests[0]['nodeid']}" if tests else ""))
    for e in tests:
        if e["outcome"] not in ("passed", "skipped"):
            print(f"  {e['outcome']}: {e['nodeid']}")
    for stage in read_rows(str(out / "stages.jsonl")):
        print(f"stage {stage['stage']}: exit {stage['rc']}, {stage['seconds']} of {stage['budget_s']} s")


DRY_RUN = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab": 256, "seq": 32, "micro_batch": 1}
"""``--dry-run``'s sizes (seconds on a CPU), in place of the defaults below."""
DRY_RUN_K = 2
"""``--dry-run``'s K, for every configuration of a stage (each configuration runs once)."""


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The model, the run and the output folder: this script's and ``gpu_deepspeed.py``'s (the same
    model at the same K), and ``--dry-run``."""
    from _common import add_model_args

    add_model_args(parser, n_layer=8, seq=1024)
    parser.set_defaults(n_embd=1024, n_head=16, vocab=16384)  # ~134 M parameters (the head is not tied)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=WARMUP_STEPS + TIMED_STEPS)
    parser.add_argument("--out", default="gpu_out", help="the folder of rows.jsonl, disk.json, machine.json")
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes, every configuration once: the whole path in seconds on a CPU "
                             "(with GREEDYSNAKE_SIMULATE_DEVICE=1)")


def parse_run_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser``'s arguments, with :data:`DRY_RUN`'s sizes under ``--dry-run``."""
    args = parser.parse_args(argv)
    if args.dry_run and not getattr(args, "child", None):
        for key, value in DRY_RUN.items():
            if hasattr(args, key):
                setattr(args, key, value)
    return args


def main() -> None:
    from _common import add_machine_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", nargs="?", choices=["disk", *STAGES, "summary"])
    add_run_args(parser)
    parser.add_argument("--candidates", nargs="+", default=[], help="disk: offload directories to choose from")
    parser.add_argument("--budget-s", type=float, default=300.0, help="a stage's seconds, all configurations")
    parser.add_argument("--configs", nargs="*", default=[], help="NAME:K pairs instead of the stage's own "
                        f"(names: {', '.join(CONFIGS)})")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peak-flops", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--pcie-bps", type=float, default=0.0, help=argparse.SUPPRESS)
    add_machine_args(parser)
    args = parse_run_args(parser)
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    from _common import exit_on_sigterm

    exit_on_sigterm()
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"--steps must be more than {WARMUP_STEPS} (the warm-up steps are not timed)")
    for c in args.configs:
        if c.split(":")[0] not in CONFIGS or not c.partition(":")[2].isdigit():
            raise SystemExit(f"--configs {c!r}: expected NAME:K with NAME one of {', '.join(CONFIGS)}")
    if args.stage == "disk":
        disk_stage(args)
    elif args.stage == "summary":
        summary(args)
    elif args.stage in STAGES:
        if args.offload_dir is None:
            raise SystemExit(f"{args.stage}: --offload-dir is needed (the disk stage prints its choice)")
        if not bench_stage(args):
            sys.exit(1)
    else:
        parser.error("name a stage: disk, " + ", ".join(STAGES) + " or summary")


if __name__ == "__main__":
    main()
