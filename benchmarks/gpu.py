"""greedysnake on one CUDA GPU against in-memory Lightning, in stages that each keep what they finish.

Run by ``benchmarks/gpu_session.sh`` (which gives each stage its time; read its header for the plan and
the expected seconds), one stage per call:

    python benchmarks/gpu.py disk --out DIR --candidates PATH...   # first: df -T, O_DIRECT probe, machine rates
    python benchmarks/gpu.py headline --out DIR --offload-dir D --budget-s 100
    python benchmarks/gpu.py resident --out DIR --offload-dir D --budget-s 40
    python benchmarks/gpu.py rest --out DIR --offload-dir D --budget-s 70
    python benchmarks/gpu.py summary --out DIR                     # the table, from whatever rows exist

The configurations (each in a fresh process, ``bf16-mixed``, the package GPT, random tokens):

- ``lightning``: Lightning's own ``strategy="auto"`` with everything on the GPU (the in-memory reference);
- ``default``: ``GreedySnakeStrategy()`` as is (``auto=True``), but with ``auto_device_budget_bytes`` an
  eighth of the model's training state (weights, gradients, AdamW moments), so the device plan offloads
  it: the placement keeps what fits of the compute weights on the GPU and the planner places the rest;
- ``horizontal``: the same with ``schedule="horizontal"`` (ZeRO-Infinity's order on the same plan);
- ``resident_weights``: ``auto=False``, every kind on SSD but the 16-bit compute weights, which stay on
  the GPU (no weight traffic on the disk; one H2D copy of each unit's new weights per step);
- ``vertical_ssd`` / ``horizontal_ssd``: ``auto=False``, every kind on SSD (ZeRO-Infinity's placement),
  in each order: greedysnake's comparator for ``benchmarks/gpu_deepspeed.py`` at the same K;
- ``vertical_fp16``: ``vertical_ssd`` in ``16-mixed`` (loss scaling), only where ``--configs`` names it.

Each row is appended to ``DIR/rows.jsonl`` the moment its configuration ends; a configuration that fails
or runs past its share of the stage's ``--budget-s`` is recorded (``error``, the end of its log) and the
stage goes on. The steady state is timed from the end of the second optimizer step (``auto=True``
plans after it) to the end of the last, drained (``torch.cuda.synchronize`` there: the benchmark's
clock, not the strategy's).

Per row: tokens/s, achieved TFLOP/s (model FLOPs: 6 x parameters x tokens plus attention, not counting
recomputation), the roofline's bound where the run had a tensor manager (the largest of: compute = the
FLOPs done, recompute included, over the measured bf16 matmul rate; SSD = the bytes moved, from the
traffic model, over the measured O_DIRECT bandwidth; PCIe = the bytes the device tier copied (counted)
over the measured pinned bandwidth; optimizer = trainable elements over the measured CPU AdamW rate),
the fraction of it achieved, and, in the summary, the GPU's idle share (1 - the in-memory run's time
for the same tokens, recompute included, over the measured time) and the ratio to Lightning in memory.

``--dry-run`` (with ``GREEDYSNAKE_SIMULATE_DEVICE=1`` on a CPU): tiny sizes, every configuration run in
this process (its flags parsed as a child's), the GPU's rates measured on the CPU: the whole path in
seconds, so a typo costs no GPU time.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

WARMUP_STEPS = 2
"""Optimizer steps not timed: warm-up, and ``auto=True``'s plan after the second."""

STAGES: dict[str, list[tuple[str, int]]] = {
    "headline": [("lightning", 4), ("default", 4), ("horizontal", 4),
                 ("lightning", 8), ("default", 8), ("horizontal", 8)],
    "resident": [("resident_weights", 8)],
    "rest": [("vertical_ssd", 8), ("horizontal_ssd", 8)],
}
"""The configurations of each benchmark stage, in order of value (``gpu_session.sh`` runs the stages in
order; a stage out of time skips its last ones)."""

CONFIGS = ("lightning", "default", "horizontal", "resident_weights", "vertical_ssd", "horizontal_ssd",
           "vertical_fp16")

DEVICE_BUDGET_SHARE = 8
"""``default``'s ``auto_device_budget_bytes``: the model's training state over this (the device plan
offloads a state over half its budget; an eighth keeps about half the compute weights on the GPU)."""

NOT_A_DISK = ("tmpfs", "ramfs", "devtmpfs", "squashfs", "proc", "sysfs")
"""Filesystem types that are no offload disk (memory, or read-only)."""

SUMMARY_COLUMNS = ["stage", "config", "k", "params_M", "step_s", "tokens_per_s", "TFLOPs", "vs_in_memory",
                   "gpu_idle", "vs_deepspeed", "offloaded", "bound", "roofline_s", "of_roofline", "wall_s", "error"]


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
    ``DIR/machine.json`` (the rates the roofline uses); prints the chosen directory last."""
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
    measure_gpu(args)
    import lightning
    import torch

    rates.update(torch=torch.__version__, lightning=lightning.__version__, cuda=torch.cuda.is_available(),
                 read_bps=args.read_bps, write_bps=args.write_bps, opt_rate=args.opt_rate,
                 peak_flops=args.peak_flops, pcie_bps=args.pcie_bps)
    (out / "machine.json").write_text(json.dumps(rates, indent=2))
    print(chosen)


def measure_gpu(args: argparse.Namespace) -> None:
    """bf16 matmul rate and pinned host<->device bandwidth, onto ``args``; without CUDA (the dry run),
    the same measurements on the CPU at a small size (fp32 matmul, pageable copies)."""
    import torch

    cuda = torch.cuda.is_available()
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
    print(f"  {'gpu' if cuda else 'cpu (dry run)'}: matmul {args.peak_flops / 1e12:.1f} TFLOP/s, "
          f"copies {args.pcie_bps / 1e9:.1f} GB/s", file=sys.stderr)


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


def child(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch
    from _common import gpt_module, token_loader

    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.config import OffloadConfig
    from lightning_greedysnake.planner import roofline
    from lightning_greedysnake.planner.measure import unit_costs

    name, k = args.child.split(":")
    k = int(k)
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
    marks: list[float] = []
    captured: dict[str, Any] = {}

    class Clock(L.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if (batch_idx + 1) % k == 0:  # a window's end
                sync()  # (the benchmark's clock)
                marks.append(time.perf_counter())

        def on_train_end(self, trainer: Any, module: Any) -> None:
            manager = getattr(trainer.strategy, "tensor_manager", None)
            captured["offloaded"] = manager is not None  # (the strategy lets it go after fit)
            if manager is not None:
                manager.drain()
                captured["units"] = unit_costs(manager)
                copies = getattr(manager, "copies", None)
                if copies is not None:
                    captured["pcie_bytes"] = copies.counts.bytes_to_device + copies.counts.bytes_to_host
                captured["placement"] = _placement(trainer.strategy)
            sync()
            marks.append(time.perf_counter())

    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, precision=precision,
                        max_steps=args.steps, accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Clock()],
                        default_root_dir=args.offload_dir)
    with trainer.init_module(empty_init=name not in ("lightning", "default", "horizontal")):
        module = Module()
    trainer.fit(module, token_loader(args.vocab, args.seq, k * args.steps * args.micro_batch, args.micro_batch))
    # the steady state: from the end of the last warm-up step to the end of the last step (drained)
    wall = (marks[-1] - marks[WARMUP_STEPS - 1]) / (args.steps - WARMUP_STEPS)
    tokens = k * args.micro_batch * args.seq
    flops = _model_flops(args, params, tokens)
    row: dict[str, Any] = {
        "config": name, "k": k, "params_M": round(params / 1e6, 1), "step_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1), "TFLOPs": round(flops / wall / 1e12, 3),
        "offloaded": captured["offloaded"],
    }
    if captured.get("placement"):
        row["placement"] = captured["placement"]
    if "units" in captured and all(getattr(args, f) for f in MACHINE_FLAGS):  # (a tensor manager, the machine's rates)
        recompute = 8.0 / 6.0
        # (16-mixed waits for the whole backward before stepping, as norm clipping does)
        traffic = roofline.traffic(captured["units"], schedule, k, clip_norm=name == "vertical_fp16")
        bounds = {
            "compute": flops * recompute / args.peak_flops,
            "ssd": traffic.read_bytes / args.read_bps + traffic.write_bytes / args.write_bps,
            "pcie": captured.get("pcie_bytes", 0) / args.steps / args.pcie_bps,
            "optimizer": params / args.opt_rate,
        }
        bound = max(bounds, key=bounds.get)  # type: ignore[arg-type]
        row.update({"bound": bound, "roofline_s": round(bounds[bound], 3),
                    "of_roofline": round(bounds[bound] / wall, 3),
                    **{f"{key}_s": round(v, 3) for key, v in bounds.items()}})
    return row


# ---- a benchmark stage ----

MACHINE_FLAGS = ["read_bps", "write_bps", "opt_rate", "peak_flops", "pcie_bps"]


def bench_stage(args: argparse.Namespace, parser: argparse.ArgumentParser) -> bool:
    """Each configuration of the stage in turn, its row appended to ``DIR/rows.jsonl`` as it ends;
    whether every one ran."""
    from _common import MODEL_FLAGS, append_row, child_argv, child_result

    deadline = time.monotonic() + args.budget_s
    rows_path = str(Path(args.out) / "rows.jsonl")
    machine_json = Path(args.out) / "machine.json"
    rates = json.loads(machine_json.read_text()) if machine_json.exists() else {}
    for flag in MACHINE_FLAGS:
        setattr(args, flag, float(rates.get(flag, 0.0)))  # (0: no roofline columns)
    flags = [*MODEL_FLAGS, "micro_batch", "steps", *MACHINE_FLAGS]
    configs = [(c, k) for c, k in STAGES.get(args.stage, [])] if not args.configs else [
        (c.split(":")[0], int(c.split(":")[1])) for c in args.configs]
    if args.dry_run:  # every configuration once, at one small K
        configs = list(dict.fromkeys((c, DRY_RUN_K) for c, _ in configs))
    failed = False
    for name, k in configs:
        left = deadline - time.monotonic()
        t0 = time.monotonic()
        extra = ["--offload-dir", args.offload_dir]
        if left < args.min_config_s:
            row: dict[str, Any] = {"error": f"skipped: {left:.0f} s left of the stage's {args.budget_s:.0f} s"}
        elif args.dry_run:  # (in this process: the child's own flags, parsed here)
            try:
                row = child(parser.parse_args(child_argv(f"{name}:{k}", args, flags, extra)))
            except Exception as e:  # noqa: BLE001 (recorded, and the stage goes on)
                row = {"error": f"{type(e).__name__}: {e}", "log_tail": traceback.format_exc()[-3000:]}
        else:
            row = child_result(__file__, f"{name}:{k}", args, flags, extra, timeout_s=left - 1.0)
        row = {"stage": args.stage, "config": name, "k": k, **row, "wall_s": round(time.monotonic() - t0, 1)}
        append_row(rows_path, row)
        print(f"  {name} K={k}: " + (f"{row['tokens_per_s']} tokens/s, {row['step_s']} s/step"
                                     if "error" not in row else f"FAILED ({row['error']})") + f" [{row['wall_s']} s]",
              file=sys.stderr)
        if "log_tail" in row:
            print(row["log_tail"][-1500:], file=sys.stderr)
        failed = failed or "error" in row
    return not failed


# ---- the summary ----

def summary(args: argparse.Namespace) -> None:
    """The table of every row in ``DIR/rows.jsonl`` (this script's and ``gpu_deepspeed.py``'s), with the
    ratios that need two rows where both exist, then the CUDA tests' outcomes and the stages' times."""
    from _common import print_table, read_rows

    rows = read_rows(str(Path(args.out) / "rows.jsonl"))
    ok = [r for r in rows if "error" not in r and "step_s" in r]
    in_memory = {r["k"]: r["step_s"] for r in ok if r["config"] == "lightning"}
    deepspeed = {r["k"]: r["step_s"] for r in ok if r["config"] == "deepspeed"}
    for r in ok:
        if r["config"] != "lightning" and r["k"] in in_memory:
            busy = in_memory[r["k"]] * 8.0 / 6.0  # the same tokens on a busy GPU, recompute included
            r["gpu_idle"] = round(max(0.0, 1.0 - busy / r["step_s"]), 3)
            r["vs_in_memory"] = round(in_memory[r["k"]] / r["step_s"], 3)
        if r["config"] != "deepspeed" and r["k"] in deepspeed:
            r["vs_deepspeed"] = round(deepspeed[r["k"]] / r["step_s"], 3)
    for r in rows:
        if "error" in r:
            r["error"] = str(r["error"])[:60]
    print_table(rows, SUMMARY_COLUMNS)
    for r in ok:
        if r.get("placement"):
            print(f"  {r['config']} K={r['k']}: {r['placement']}")
    print(f"{len(ok)} of {len(rows)} rows measured ({Path(args.out) / 'rows.jsonl'})")
    tests = [e for e in read_rows(str(Path(args.out) / "tests.jsonl")) if e.get("event") == "end"]
    outcomes = [e["outcome"] for e in tests]
    print(f"CUDA tests: {({o: outcomes.count(o) for o in sorted(set(outcomes))}) or 'none ran'}")
    for e in tests:
        if e["outcome"] not in ("passed", "skipped"):
            print(f"  {e['outcome']}: {e['nodeid']}")
    for stage in read_rows(str(Path(args.out) / "stages.jsonl")):
        print(f"stage {stage['stage']}: exit {stage['rc']}, {stage['seconds']} of {stage['budget_s']} s")


DRY_RUN = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab": 256, "seq": 32, "micro_batch": 1,
           "steps": WARMUP_STEPS + 1, "min_config_s": 0.0}
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
    parser.add_argument("--steps", type=int, default=WARMUP_STEPS + 2)
    parser.add_argument("--out", default="gpu_out", help="the folder of rows.jsonl, disk.json, machine.json")
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes, every configuration in this process: the whole path in seconds on a CPU "
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
    parser.add_argument("--min-config-s", type=float, default=15.0,
                        help="a configuration is skipped (and recorded) with less than this left of the stage")
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
        if not bench_stage(args, parser):
            sys.exit(1)
    else:
        parser.error("name a stage: disk, " + ", ".join(STAGES) + " or summary")


if __name__ == "__main__":
    main()
