"""How large a GPT each system trains on this machine, and what it costs on the way (issue 37, items 2,
4 and 6): a ladder of sizes, each size and system in a fresh process built on the meta device (or
DeepSpeed's ``zero.Init``, its way to build a model that never sits whole in RAM), three optimizer steps
at sequence 32, K=2. Per row: did it train and why not (``refused: <message>``, ``OOM-killed``, ``out of
disk``, ``timed out``, ``failed: <error>``), peak RSS of the process tree, the time to the first step
(model creation, setup: writing the initial state, the first step with its probes), the steady step
time, the SSD bytes per step and the disk space it used. The largest size each system trains is the
headline. Kept out of CI: a ``--smoke`` size runs there (``tests/integration/test_scale_smoke.py``).

Systems (``--systems``):

- ``gs_default``: ``GreedySnakeStrategy()`` with its defaults (``auto=True``: the planner places each
  kind in RAM or on SSD under its host budget, half the available memory, or ``--host-budget-gb``: the
  peak RSS a user who needs the machine for other work can ask for), ``offload_dir`` on the disk under
  test;
- ``gs_bf16_state``: the same with the optimizer state kept in bf16 (``offload.optimizer_state_dtype``);
- ``gs_ssd``: the defaults with every kind on SSD (``offload.<kind>=ssd``): ZeRO-Infinity's placement, the
  like-for-like peer of ``deepspeed``;
- ``deepspeed``: DeepSpeed ZeRO-Infinity (ZeRO-3, parameters and optimizer state on NVMe), the model built
  under ``zero.Init(remote_device="nvme")``; its buffers sized as its config docs say (``offload_param``:
  5 buffers, each at least the largest parameter; ``offload_optimizer``: 4 buffers, Adam's four states;
  ``sub_group_size`` 1e8 so the optimizer's swap buffers stay small in host memory; ``max_in_cpu`` 0: the
  parameters are on NVMe, not kept in RAM; ``aio`` at its defaults, not tuned). Needs DeepSpeed
  (``DS_ACCELERATOR=cpu`` on a CPU machine, see ``benchmarks/compare.py``); skipped when not importable.

Both train under ``--precision`` (default bf16-mixed) with AdamW on the package GPT, the same data.
greedysnake runs as a user gets it, with the end-of-fit hand-back (``offload.return_weights=True``,
planned within the host budget: what does not fit stays on SSD, said at the start of the run), unless
``--no-return-weights`` (the result's settings say which). SSD bytes per step are the kernel's block
I/O counters of the process (``/proc/<pid>/io``, alike for both systems) over steps 2 and 3;
greedysnake's own counters are given too.

    python benchmarks/scale.py --offload-dir /mnt/nvme/scale                  # the full ladder, every system
    python benchmarks/scale.py --sizes 0.35b 0.7b --systems gs_default deepspeed
    python benchmarks/scale.py --smoke                                         # seconds: the CI check
    python benchmarks/scale.py --sizes 3072x40                                 # a shape of your own (n_embd x n_layer)

Each run is watched from this process: the process tree's resident memory sampled (``/proc``) and its
``ru_maxrss`` (``wait4``), a wall-clock limit (``--timeout-min``), a memory limit (``--memory-limit-gb``,
default: all of RAM less 1 GiB: the watcher kills the run before the kernel's OOM killer picks something
else on the machine) and the disk its directory takes. A system that fails at one size is not run at the
larger ones (``--keep-going`` runs them). DeepSpeed does not check the free disk before it writes: a size
whose estimated NVMe footprint exceeds the free disk is not started (``not run: ...``, ``--no-disk-guard``
starts it anyway); greedysnake's own preflight refuses such a size before any work, and that refusal is
the row.

Writes ``--out`` (default ``benchmarks/results/scale.json``; with ``--smoke``, the temp dir's): the
command, the machine, the disk's measured speed and free space, the settings, every row and the
headline; and appends each row as it lands to ``<out>.rows.jsonl`` (a ladder stopped midway keeps what
it measured).
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

SIZES: dict[str, tuple[int, int, int, int]] = {
    # name: (n_embd, n_layer, n_head, vocab); parameters ~ 12 * n_layer * n_embd^2 + 2 * vocab * n_embd
    "smoke": (64, 2, 4, 256),
    "0.1b": (768, 12, 6, 8192),
    "0.35b": (1024, 28, 8, 8192),
    "0.7b": (1536, 24, 12, 8192),
    "1.4b": (2048, 28, 16, 8192),
    "2.8b": (2560, 36, 20, 8192),
    "5.5b": (3072, 48, 24, 8192),
    "11b": (4096, 56, 32, 8192),
    "22b": (6144, 48, 48, 8192),
}
LADDER = ["0.35b", "0.7b", "1.4b", "2.8b", "5.5b", "11b", "22b"]
"""The default ladder: doubling from 0.35B while the disk holds it (the sizes past the free disk are
refused, or not run, and say so)."""

SYSTEMS = ["gs_default", "gs_bf16_state", "gs_ssd", "deepspeed"]
GS_SYSTEMS = [s for s in SYSTEMS if s.startswith("gs_")]
KINDS = ("weights", "master_weights", "optimizer_states", "gradients")

RETURN_WEIGHTS_WHY = {
    True: "the default: the end-of-fit hand-back, planned within the host budget (what does not fit stays on "
          "SSD, said at the start); before it was planned it copied ~12 bytes a parameter into RAM at the end "
          "of fit and was left out of the ladder",
    False: "--no-return-weights: without the end-of-fit hand-back",
}
"""What the ladder's hand-back setting means (recorded in the result's settings)."""

DEEPSPEED_BYTES_PER_PARAM = {"bf16-mixed": 19, "32-true": 21}
"""DeepSpeed ZeRO-Infinity's NVMe footprint per parameter, for the disk guard: the 16-bit parameters (2),
the fp32 master weights, two Adam moments and the fp32 gradients its optimizer swapper keeps (16), and
alignment (measured: 18.7 bytes a parameter at 0.1B under bf16-mixed); under 32-true the parameters are
fp32. An estimate: the row records the disk it really used."""


# -- sizes ------------------------------------------------------------------------------------------

def shape(size: str) -> tuple[int, int, int, int]:
    """A named size, or ``<n_embd>x<n_layer>`` (heads of 128, vocab 8192)."""
    if size in SIZES:
        return SIZES[size]
    try:
        n_embd, n_layer = (int(x) for x in size.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"size {size!r}: one of {', '.join(SIZES)} or <n_embd>x<n_layer> (e.g. 3072x40)") from None
    return n_embd, n_layer, max(1, n_embd // 128), 8192


def num_params(size: str) -> int:
    """The package GPT's parameter count at ``size`` (built on the meta device: no memory)."""
    import torch

    from lightning_greedysnake import GPT, GPTConfig

    n_embd, n_layer, n_head, vocab = shape(size)
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab, block_size=32))
    return sum(p.numel() for p in model.parameters())


# -- the child: one system at one size ----------------------------------------------------------------

def _proc_io() -> dict[str, int]:
    """This process's block I/O so far (all its threads: the kernel's ``read_bytes``/``write_bytes``)."""
    out = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("read_bytes", "write_bytes"):
                out[key] = int(value)
    except OSError:
        pass
    return out


class Clock:
    """The phases of one run: build, setup, then each optimizer step's seconds and block I/O."""

    def __init__(self) -> None:
        self.t = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.steps: list[float] = []
        self.io: list[dict[str, int]] = []
        self.phase = "build"

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.marks[name] = now - self.t
        self.t = now

    def step(self) -> None:
        now = time.perf_counter()
        self.steps.append(now - self.t)
        self.io.append(_proc_io())
        self.t = now
        self.phase = f"step {len(self.steps) + 1}"

    def start_steps(self) -> None:
        self.io = [_proc_io()]
        self.t = time.perf_counter()
        self.phase = "step 1"

    def row(self, k: int, seq: int) -> dict[str, Any]:
        steady = self.steps[1:] or self.steps
        step_s = statistics.median(steady)
        row: dict[str, Any] = {
            "build_s": round(self.marks.get("build", 0.0), 2),
            "setup_s": round(self.marks.get("setup", 0.0), 2),
            "first_step_s": round(self.steps[0], 2),
            "time_to_first_step_s": round(self.marks.get("build", 0.0) + self.marks.get("setup", 0.0)
                                          + self.steps[0], 2),
            "step_s": round(step_s, 3), "tokens_per_s": round(k * seq / step_s, 2),
            "step_times": [round(t, 3) for t in self.steps],
        }
        if len(self.io) > 2 and self.io[0]:
            n = len(self.io) - 2  # steps 2.. (the first is set-up's: probes and the initial state)
            row["ssd_read_gb_per_step"] = round((self.io[-1]["read_bytes"] - self.io[1]["read_bytes"]) / n / 1e9, 3)
            row["ssd_written_gb_per_step"] = round(
                (self.io[-1]["write_bytes"] - self.io[1]["write_bytes"]) / n / 1e9, 3)
        return row


def run_greedysnake(args: argparse.Namespace, system: str, clock: Clock) -> dict[str, Any]:
    import lightning as L
    import torch
    from _common import gpt_module, token_loader

    from lightning_greedysnake import GreedySnakeStrategy

    n_embd, n_layer, n_head, vocab = shape(args.size)
    Module, config = gpt_module(n_embd, n_layer, n_head, vocab, args.seq)
    offload: dict[str, Any] = {"return_weights": args.return_weights}
    if system == "gs_bf16_state":
        offload["optimizer_state_dtype"] = "bfloat16"
    if system == "gs_ssd":
        offload.update({kind: "ssd" for kind in KINDS})
    budget = {} if args.host_budget_gb is None else {"auto_host_budget_bytes": int(args.host_budget_gb * 2**30)}
    strategy = GreedySnakeStrategy(offload_dir=Path(args.offload_dir) / "offload", offload=offload, **budget)
    extra: dict[str, Any] = {}
    clock.t = time.perf_counter()  # (model creation from here: the imports are not counted)

    class Steps(L.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            clock.mark("setup")  # (fit's start to here: preflight, the placement, the initial state on SSD)
            clock.start_steps()

        def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
            if (trainer.fit_loop.epoch_loop.batch_idx + 1) % args.k == 0:
                clock.step()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            s = trainer.strategy
            if s.placement_plan is not None:  # units of each kind in RAM / all units
                extra["placement"] = {kind: f"{p.host_units}/{p.num_units} in RAM"
                                      for kind, p in s.placement_plan.kinds.items()}
            extra["offload"] = {kind: getattr(s.config.offload, kind, None) for kind in KINDS}
            manager = s.tensor_manager
            if manager is not None:
                manager.drain()
                flat = manager.stats.flat()
                steps = max(1, trainer.global_step)
                extra["gs_ssd_read_gb_per_step"] = round(sum(
                    v for key, v in flat.items() if key.startswith("ssd/") and key.endswith("bytes_read")) / steps / 1e9, 3)
                extra["gs_ssd_written_gb_per_step"] = round(sum(
                    v for key, v in flat.items() if key.startswith("ssd/") and key.endswith("bytes_written")) / steps / 1e9, 3)
                extra["disk_files_gb"] = round(sum(
                    f.stat().st_blocks * 512 for f in Path(args.offload_dir).rglob("*") if f.is_file()) / 1e9, 2)

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, accumulate_grad_batches=args.k, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Steps()], default_root_dir=args.offload_dir)
    torch.manual_seed(0)
    with trainer.init_module(empty_init=True):
        module = Module()
    clock.mark("build")
    clock.phase = "setup"
    trainer.fit(module, token_loader(vocab, args.seq, args.k * args.steps))
    extra["params"] = config.num_params
    return extra


def run_deepspeed(args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    from _common import deepspeed_step_times

    n_embd, n_layer, n_head, vocab = shape(args.size)
    largest = max(vocab * n_embd, 4 * n_embd * n_embd)  # the embedding / head, or an MLP matrix
    block = 12 * n_embd * n_embd  # one block's parameters: 4 matrices big enough to swap, the rest persist
    overrides = {
        "zero_optimization": {
            # every swapped parameter takes one whole buffer while it is live: buffers that hold the largest,
            # enough of them for the live window (4 blocks' matrices, the embedding and the head), and the
            # live window, the prefetch and the reuse distance bounded in blocks to match
            "offload_param": {"buffer_count": 4 * 4 + 4, "buffer_size": largest, "max_in_cpu": args.ds_max_in_cpu},
            "offload_optimizer": {"buffer_count": 4},  # at least Adam's 4 states (its docs)
            "sub_group_size": int(args.ds_sub_group_size),
            "stage3_prefetch_bucket_size": block,
            "stage3_max_live_parameters": 2 * block,
            "stage3_max_reuse_distance": block,
        },
    }

    class Phases(dict):  # filled once deepspeed.initialize returns: the steps' clock starts there
        def update(self, *a: Any, **kw: Any) -> None:
            super().update(*a, **kw)
            clock.marks.update(build=self["build_s"], setup=self["initialize_s"])
            clock.start_steps()

    with socket.socket() as sock:  # a free port for its gloo group (other runs may hold the default)
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    clock.phase = "build and initialize"
    phases = Phases()
    deepspeed_step_times(n_embd, n_layer, n_head, vocab, args.seq, args.k, args.steps, micro_batch=1,
                         bf16=args.precision == "bf16-mixed", nvme_dir=str(Path(args.offload_dir) / "nvme"),
                         cuda=False, offload="nvme", zero_init=True, overrides=overrides, phases=phases,
                         on_step=lambda step: clock.step())
    config = phases.get("config", {})
    files = [f for f in Path(args.offload_dir).rglob("*") if f.is_file()]
    return {"deepspeed_zero": config.get("zero_optimization"), "aio": config.get("aio", "defaults"),
            "disk_files_gb": round(sum(f.stat().st_blocks * 512 for f in files) / 1e9, 2)}


def classify(error: BaseException, system: str, phase: str) -> str:
    """The row's status for a run that raised ``error`` in ``phase``."""
    text = f"{type(error).__name__}: {error}"
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in text:
        return f"out of disk: {first}"
    if isinstance(error, MemoryError) or "can't allocate memory" in text or "Cannot allocate memory" in text:
        return f"OOM: {first}"
    if system.startswith("gs_") and isinstance(error, ValueError) and "Fix:" in str(error) and not phase.startswith("step"):
        return f"refused: {' '.join(str(error).split())}"  # greedysnake's refusals name the setting and the fix
    return f"failed: {type(error).__name__}: {first}"


def child(args: argparse.Namespace) -> int:
    system = args.child
    clock = Clock()
    t_start = time.perf_counter()
    try:
        extra = run_deepspeed(args, clock) if system == "deepspeed" else run_greedysnake(args, system, clock)
    except BaseException as e:  # noqa: BLE001 (every failure is a row)
        traceback.print_exc()
        row = {"status": classify(e, system, clock.phase), "phase": clock.phase,
               "failed_after_s": round(time.perf_counter() - t_start, 2),
               "peak_rss_gb_self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
        print("RESULT " + json.dumps(row, default=str), flush=True)
        return 3
    if len(clock.steps) < args.steps:
        row = {"status": f"failed: {len(clock.steps)} of {args.steps} optimizer steps ran"}
        print("RESULT " + json.dumps(row, default=str), flush=True)
        return 3
    row = {"status": "trained", **clock.row(args.k, args.seq), **extra,
           "peak_rss_gb_self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    print("RESULT " + json.dumps(row, default=str), flush=True)
    return 0


# -- the parent: the watcher ------------------------------------------------------------------------

def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from ``/proc/*/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _tree_rss(pid: int) -> int:
    total = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for p in _tree(pid):
        try:
            total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return total


def _disk_used(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def watch(cmd: list[str], directory: Path, log: Path, timeout_s: float, memory_limit: int) -> dict[str, Any]:
    """Run ``cmd`` in its own session, sampling its tree's RSS and ``directory``'s disk use until it ends;
    kill it at ``timeout_s`` or over ``memory_limit`` bytes. Its RESULT line, or why there is none."""
    t0 = time.monotonic()
    peak_rss = peak_disk = 0
    killed: str | None = None
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        last_disk = 0.0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                break
            rss = _tree_rss(proc.pid)
            peak_rss = max(peak_rss, rss)
            if time.monotonic() - last_disk > 1.0:
                peak_disk, last_disk = max(peak_disk, _disk_used(directory)), time.monotonic()
            if killed is None and memory_limit and rss > memory_limit:
                killed = f"OOM-killed: its processes held {rss / 2**30:.1f} GiB, over the limit of " \
                         f"{memory_limit / 2**30:.1f} GiB (--memory-limit-gb; killed by this script's watcher)"
            elif killed is None and time.monotonic() - t0 > timeout_s:
                killed = f"timed out after {timeout_s / 60:.0f} min (--timeout-min)"
            if killed is not None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.25)
    wall = time.monotonic() - t0
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    row: dict[str, Any] = json.loads(lines[-1][len("RESULT "):]) if lines else {}
    row.update(wall_s=round(wall, 1), peak_rss_gb=round(max(peak_rss, usage.ru_maxrss * 1024) / 2**30, 2),
               peak_rss_gb_sampled=round(peak_rss / 2**30, 2), ru_maxrss_gb=round(usage.ru_maxrss / 2**20, 2),
               disk_used_gb=round(peak_disk / 1e9, 2), returncode=proc.returncode)
    if killed is not None:
        row["status"] = killed
    elif not lines:
        if proc.returncode == -signal.SIGKILL:
            row["status"] = "OOM-killed: SIGKILL from outside this script (the kernel's OOM killer?)"
        elif proc.returncode < 0:
            row["status"] = f"failed: killed by signal {signal.Signals(-proc.returncode).name}"
        else:
            row["status"] = f"failed: exit status {proc.returncode}, no RESULT line"
    if row.get("status") != "trained":
        row["log_tail"] = text[-2500:]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=None, type=lambda s: (shape(s), s)[1],
                        help=f"named ({', '.join(SIZES)}) or <n_embd>x<n_layer>; default: {' '.join(LADDER)}")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--smoke", action="store_true", help="the tiny size only, a quick disk probe (CI)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--k", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--no-return-weights", dest="return_weights", action="store_false",
                        help="greedysnake without its end-of-fit hand-back (offload.return_weights=False)")
    parser.add_argument("--offload-dir", default=None, help="the disk under test (default: the temp dir)")
    parser.add_argument("--timeout-min", type=float, default=90.0, help="each run's wall-clock limit")
    parser.add_argument("--memory-limit-gb", type=float, default=None,
                        help="kill a run whose processes hold more (default: all of RAM less 1 GiB)")
    parser.add_argument("--host-budget-gb", type=float, default=None,
                        help="greedysnake's host budget (auto_host_budget_bytes); default: its own (half the "
                             "available memory)")
    parser.add_argument("--keep-going", action="store_true", help="run a system's larger sizes after it failed")
    parser.add_argument("--no-disk-guard", action="store_true",
                        help="start DeepSpeed even where its estimated footprint exceeds the free disk")
    parser.add_argument("--ds-sub-group-size", type=float, default=1e8)
    parser.add_argument("--ds-max-in-cpu", type=int, default=0)
    parser.add_argument("--out", default=None,
                        help="default: benchmarks/results/scale.json (--smoke: the temp dir's greedysnake_scale_smoke.json)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.exit(child(args))
    from _common import append_row, child_argv, measure_machine, print_table, write_result

    sizes = args.sizes or (["smoke"] if args.smoke else LADDER)
    if args.out is None:
        args.out = str(Path(tempfile.gettempdir()) / "greedysnake_scale_smoke.json" if args.smoke
                       else Path(__file__).parent / "results" / "scale.json")
    systems = list(args.systems)
    if "deepspeed" in systems and importlib.util.find_spec("deepspeed") is None:
        print("  deepspeed is not importable: skipping it (see benchmarks/compare.py's docstring)", file=sys.stderr)
        systems.remove("deepspeed")
    memory_limit = int((args.memory_limit_gb * 2**30) if args.memory_limit_gb is not None
                       else max(0, _mem_total() - 2**30))
    rows_path = Path(args.out).with_suffix(".rows.jsonl")
    rows_path.unlink(missing_ok=True)
    rows: list[dict[str, Any]] = []
    stopped: dict[str, str] = {}
    flags = ["seq", "k", "steps", "precision", "ds_sub_group_size", "ds_max_in_cpu"]
    with tempfile.TemporaryDirectory(prefix="greedysnake_scale_", dir=args.offload_dir) as tmp:
        scratch = Path(tmp)
        measure_machine(args, tmp, quick=args.smoke, device_tier=False)
        disk = shutil.disk_usage(scratch)
        machine_extra = {"read_GBps": round(args.read_bps / 1e9, 3), "write_GBps": round(args.write_bps / 1e9, 3),
                         "disk_free_gb": round(disk.free / 1e9, 1), "disk_total_gb": round(disk.total / 1e9, 1),
                         "mem_total_gb": round(_mem_total() / 2**30, 1), "scratch": str(scratch),
                         "optimizer_Melem_per_s": round(args.opt_rate / 1e6), "optimizer_threads": args.opt_threads}
        print(f"  free disk {machine_extra['disk_free_gb']} GB at {scratch}; memory limit "
              f"{memory_limit / 2**30:.1f} GiB", file=sys.stderr)
        for size in sizes:
            n_embd, n_layer, n_head, vocab = shape(size)
            params = num_params(size)
            for system in systems:
                base = {"system": system, "size": size, "params": params, "n_embd": n_embd, "n_layer": n_layer,
                        "n_head": n_head, "vocab": vocab, "disk_free_gb_before": round(shutil.disk_usage(scratch).free / 1e9, 1)}
                if system in stopped and not args.keep_going:
                    row = {**base, "status": f"not run: {system} did not train a smaller size ({stopped[system]})"}
                elif (system == "deepspeed" and not args.no_disk_guard
                      and params * DEEPSPEED_BYTES_PER_PARAM.get(args.precision, 20) > shutil.disk_usage(scratch).free):
                    need = params * DEEPSPEED_BYTES_PER_PARAM.get(args.precision, 20)
                    row = {**base, "status": f"not run: DeepSpeed would need ~{need / 1e9:.0f} GB on NVMe "
                           f"({DEEPSPEED_BYTES_PER_PARAM.get(args.precision, 20)} B/parameter), "
                           f"{shutil.disk_usage(scratch).free / 1e9:.0f} GB are free, and it does not check before "
                           "writing (--no-disk-guard starts it anyway)"}
                else:
                    directory = scratch / f"{system}_{size}"
                    directory.mkdir()
                    args.size = size
                    cmd = [sys.executable, __file__, *child_argv(system, args, flags, ["--size", size,
                                                                                      "--offload-dir", str(directory)]),
                           *([] if args.return_weights else ["--no-return-weights"]),
                           *(["--host-budget-gb", str(args.host_budget_gb)] if args.host_budget_gb is not None else [])]
                    print(f"  {system} {size} ({params / 1e9:.2f}B) ...", file=sys.stderr, flush=True)
                    row = {**base, **watch(cmd, directory, scratch / f"{system}_{size}.log", args.timeout_min * 60,
                                           memory_limit)}
                    shutil.rmtree(directory, ignore_errors=True)
                if row["status"] != "trained" and system not in stopped:
                    stopped[system] = f"{size}: {row['status'][:80]}"
                rows.append(row)
                append_row(str(rows_path), row)
                print(f"  {system} {size}: {row['status'][:200]}"
                      + (f" (peak RSS {row['peak_rss_gb']} GB, first step after {row['time_to_first_step_s']} s, "
                         f"{row['step_s']} s/step)" if row["status"] == "trained" else ""), file=sys.stderr, flush=True)
    headline = {}
    for system in systems:
        trained = [r for r in rows if r["system"] == system and r["status"] == "trained"]
        best = max(trained, key=lambda r: r["params"], default=None)
        headline[system] = ({"largest_trained": best["size"], "params": best["params"],
                             "time_to_first_step_s": best["time_to_first_step_s"], "peak_rss_gb": best["peak_rss_gb"],
                             "step_s": best["step_s"]} if best else {"largest_trained": None})
    trained = {(r["system"], r["size"]): r for r in rows if r["status"] == "trained"}
    if "deepspeed" in systems:  # item 6: the time to the first step at the largest size DeepSpeed also trained
        common = [size for size in sizes if ("deepspeed", size) in trained
                  and any((s, size) in trained for s in systems if s != "deepspeed")]
        if common:
            size = max(common, key=num_params)
            headline["time_to_first_step_at_deepspeeds_largest"] = {
                "size": size, **{s: {k: trained[(s, size)][k] for k in ("build_s", "setup_s", "first_step_s",
                                                                        "time_to_first_step_s")}
                                 for s in systems if (s, size) in trained}}
    print_table(rows, ["system", "size", "status", "peak_rss_gb", "build_s", "setup_s", "first_step_s",
                       "time_to_first_step_s", "step_s", "ssd_read_gb_per_step", "ssd_written_gb_per_step",
                       "disk_used_gb"])
    print("largest size trained: " + ", ".join(f"{s} {headline[s]['largest_trained']}" for s in systems))
    args.memory_limit_gb = round(memory_limit / 2**30, 1)
    args.sizes = sizes
    args.systems = systems
    args.greedysnake_offload = {"return_weights": args.return_weights,
                                "why": RETURN_WEIGHTS_WHY[args.return_weights]}
    args.comparison = ("gs_ssd and deepspeed: every kind on the disk under test (like with like); gs_default and "
                       "gs_bf16_state: greedysnake's planner chooses RAM or SSD per kind under its host budget")
    args.ssd_bytes = "the kernel's block I/O counters of the run's process (/proc/<pid>/io), steps 2..3, per step"
    write_result(args.out, args, ["sizes", "systems", "seq", "k", "steps", "precision", "host_budget_gb", "timeout_min",
                                  "memory_limit_gb", "ds_sub_group_size", "ds_max_in_cpu", "greedysnake_offload",
                                  "comparison", "ssd_bytes", "keep_going", "no_disk_guard"],
                 rows, machine_extra)
    result = json.loads(Path(args.out).read_text())
    result["headline"] = headline
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
