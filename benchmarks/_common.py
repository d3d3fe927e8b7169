"""Shared pieces of the benchmark scripts: the benchmark GPT module, synthetic data, running one
configuration in a fresh process, and the table and machine record every script prints and writes."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
from typing import Any

WARMUP_STEPS = 2
"""Steps not timed, of every system: warm-up, and greedysnake's ``auto=True`` plan after step 2."""


def steady_step_s(step_times: list[float]) -> float:
    """A run's step time: the median of its steps after :data:`WARMUP_STEPS` (all of them in a shorter
    run). The first step after the plan may still run slow (the new settings' buffers touched for the first
    time): a run of 6 steps or more keeps it from deciding the median."""
    import statistics

    return statistics.median(step_times[WARMUP_STEPS:] or step_times)


def gpt_module(n_embd: int, n_layer: int, n_head: int, vocab: int, seq: int, optimizer: str = "AdamW") -> Any:
    """A LightningModule around the package GPT with fused AdamW, or torchao's ``AdamW8bit`` /
    ``AdamW4bit`` (``optimizer``), built lazily (imports torch)."""
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_greedysnake import GPT, GPTConfig

    config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab, block_size=seq)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.model(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))

        def configure_optimizers(self) -> Any:
            if optimizer != "AdamW":
                import torchao.optim

                return getattr(torchao.optim, optimizer)(self.parameters(), lr=1e-4)
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    return Module, config


def token_loader(vocab: int, seq: int, num_samples: int, batch_size: int = 1) -> Any:
    """Random tokens (no download), the same every run."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = torch.randint(0, vocab, (num_samples, seq + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch_size)


def child_argv(name: str, args: Any, flags: list[str], extra: list[str]) -> list[str]:
    """The arguments of ``script --child name`` carrying ``args``' ``flags`` (one place for both the fresh
    process of :func:`child_result` and a benchmark's in-process dry run)."""
    argv = ["--child", name, *extra]
    for flag in flags:
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv


def settle(max_wait_s: float = 60.0) -> float:
    """Wait until the kernel has written back what the previous process left dirty (``sync``, then
    ``Dirty`` + ``Writeback`` in ``/proc/meminfo`` under 32 MiB) and two seconds more: a run that starts
    while the flusher threads write out DeepSpeed's swap files, or while gigabytes just freed are being
    reclaimed, computes on a core it shares with them. Returns the seconds waited."""
    import time
    from pathlib import Path

    t0 = time.monotonic()
    os.sync()
    meminfo = Path("/proc/meminfo")
    while meminfo.exists() and time.monotonic() - t0 < max_wait_s:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines())
        if sum(int(fields.get(k, "0 kB").split()[0]) for k in ("Dirty", "Writeback")) < 32 << 10:
            break
        time.sleep(0.5)
    time.sleep(2.0)
    return time.monotonic() - t0


def child_result(script: str, name: str, args: Any, flags: list[str], extra: list[str],
                 package_root: str | None = None, timeout_s: float | None = None) -> dict[str, Any]:
    """Run ``script --child name`` in a fresh process with ``args``' ``flags``; return its RESULT line, or,
    where it failed or ran past ``timeout_s``, ``{"error": ..., "log_tail": ...}`` (the end of its output).
    ``timeout_s`` counts from this call: :func:`settle` first (at most a quarter of it), then the child.
    The child runs in its own process group; at the timeout, and when this process is interrupted, it is
    killed with every process under it (:func:`kill_tree`: a compiler it started too). ``package_root``:
    import ``lightning_greedysnake`` from that source tree instead (a baseline)."""
    import signal
    import time

    t0 = time.monotonic()
    settle(60.0 if timeout_s is None else min(60.0, timeout_s / 4))
    cmd = [sys.executable, script, *child_argv(name, args, flags, extra)]
    env = dict(os.environ)
    if package_root is not None:
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    left = None if timeout_s is None else max(1.0, timeout_s - (time.monotonic() - t0))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=left)
    except BaseException as e:  # (the timeout, or this process interrupted: the child's processes go too)
        kill_tree(proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # (something outside the tree still holds its pipes: no output)
            proc.wait()
            stdout, stderr = "", "(its output could not be read after the kill)"
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        return {"error": f"timed out after {timeout_s:.0f} s", "log_tail": (stdout[-1000:] + stderr[-3000:])}
    line = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not line:
        return {"error": f"exit status {proc.returncode}" + ("" if line else ", no RESULT line"),
                "log_tail": (stdout[-1000:] + stderr[-3000:])}
    return json.loads(line[0][len("RESULT "):])


IO_LOAD = r"""
import mmap, os, signal, sys, threading, time
path, request, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
size = request * threads * 8
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
fill = mmap.mmap(-1, request)
for offset in range(0, size, request):  # (written once: a read of a hole moves nothing)
    os.pwritev(fd, [fill], offset)
stop, moved = threading.Event(), [0] * threads
signal.signal(signal.SIGTERM, lambda *_: stop.set())
def load(i):
    buf, n = mmap.mmap(-1, request), 0
    while not stop.is_set():
        offset = ((i + n * threads) % (size // request)) * request
        (os.pwritev if n % 2 else os.preadv)(fd, [buf], offset)
        moved[i] += request
        n += 1
workers = [threading.Thread(target=load, args=(i,)) for i in range(threads)]
t0 = time.perf_counter()
for w in workers: w.start()
print("started", flush=True)
for w in workers: w.join()
print(f"GBps {sum(moved) / 1e9 / (time.perf_counter() - t0):.3f}", flush=True)
os.close(fd)
os.unlink(path)
"""
"""A disk load apart from the measured process: ``threads`` threads, each alternating an O_DIRECT read and
write of ``request`` bytes over a scratch file, as fast as the disk takes them, until SIGTERM
(:func:`io_load`)."""


@contextlib.contextmanager
def io_load(directory: str, request_bytes: int = 12 << 20, threads: int = 4) -> Any:
    """Keep the disk of ``directory`` busy (reads and writes alternated, ``threads`` deep, requests of
    ``request_bytes``: the sizes and depth greedysnake's SSD path issues) in a process of its own while the
    body runs, so that what the disk's traffic costs a computation beside it (its DMA through memory, its
    interrupts, the kernel's work) is measured without greedysnake's own threads. Yields a dict whose
    ``GBps`` is the load's bandwidth, read and written together, once the body is done."""
    import time
    from pathlib import Path

    result: dict[str, float] = {}
    path = str(Path(directory) / ".io-load.bin")
    proc = subprocess.Popen([sys.executable, "-c", IO_LOAD, path, str(request_bytes), str(threads)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "started":  # (it failed before the load began: its error is above)
        proc.wait()
        raise RuntimeError(f"the disk load in {directory} did not start (exit status {proc.returncode})")
    time.sleep(1.0)  # (the load at full speed before the body starts)
    try:
        yield result
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
        found = [line.split()[1] for line in out.splitlines() if line.startswith("GBps")]
        result["GBps"] = float(found[0]) if found else 0.0


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it, found through ``/proc`` before any is killed (ninja puts
    each compiler it starts in a process group of its own, which a kill of the child's group misses, and
    which SIGKILL'd ninja cannot stop: orphans that would compile on through the next benchmark)."""
    import signal
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # (gone meanwhile)
            continue
        ppid = int(text[text.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:  # (parents first: none starts another once killed)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


def exit_on_sigterm() -> None:
    """SIGTERM (a stage's ``timeout``) raises ``SystemExit`` here instead of ending the process at once, so
    that :func:`child_result` kills the child and what it started on the way out (a compiler too)."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run_child(script: str, name: str, args: Any, flags: list[str], extra: list[str],
              package_root: str | None = None) -> dict[str, Any]:
    """:func:`child_result`, stopping the benchmark (with the child's output) where it failed."""
    row = child_result(script, name, args, flags, extra, package_root)
    if "error" in row:
        print(row["log_tail"], file=sys.stderr)
        raise SystemExit(f"{name} failed: {row['error']}")
    return row


def append_row(path: str, row: dict[str, Any]) -> None:
    """One JSON line appended to ``path`` and flushed to the disk at once (a run stopped later keeps it)."""
    from pathlib import Path

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_rows(path: str) -> list[dict[str, Any]]:
    """The JSON lines :func:`append_row` wrote (a line cut short by a kill is skipped)."""
    from pathlib import Path

    rows = []
    if Path(path).exists():
        for line in Path(path).read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def deepspeed_step_times(n_embd: int, n_layer: int, n_head: int, vocab: int, seq: int, k: int, steps: int,
                         micro_batch: int, bf16: bool, nvme_dir: str, cuda: bool, offload: str = "nvme",
                         zero_init: bool = False, overrides: dict[str, dict[str, Any]] | None = None,
                         phases: dict[str, Any] | None = None, on_step: Any = None) -> list[float]:
    """DeepSpeed ZeRO-Infinity (ZeRO-3, parameters and optimizer state offloaded to NVMe at ``nvme_dir``;
    ``offload="cpu"``: to host memory instead, ZeRO-Offload, and ``nvme_dir`` unused; AdamW) on the package GPT with :func:`token_loader`'s data, ``k`` micro-batches of ``micro_batch`` per
    step: the seconds of each of ``steps`` optimizer steps (on CUDA, synchronized at each step's end: the
    benchmark's clock). One process, world size 1. ``zero_init``: the model built under
    ``deepspeed.zero.Init`` (each parameter partitioned to the offload device as it is created, never
    whole in RAM: DeepSpeed's way to build a model larger than memory). ``overrides``: merged into the
    config's sections (``{"zero_optimization": {...}, "aio": {...}}``; ``offload_param`` and
    ``offload_optimizer`` inside ``zero_optimization`` merged key by key). ``phases``: filled with the
    seconds of building the model (``build_s``), of ``deepspeed.initialize`` (``initialize_s``) and the
    config used (``config``). ``on_step(step)``: called after each step's clock stops. ``cuda=False``: DeepSpeed's CPU accelerator
    (``DS_ACCELERATOR=cpu`` unless set) over gloo. Imports DeepSpeed (not a dependency: see
    ``benchmarks/compare.py`` and ``benchmarks/build_gpu_wheels.sh``)."""
    import time
    from pathlib import Path

    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29531")):
        os.environ.setdefault(key, value)
    import deepspeed
    import torch
    import torch.nn.functional as F

    from lightning_greedysnake import GPT, GPTConfig

    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    if offload not in ("nvme", "cpu"):
        raise ValueError(f"offload={offload!r}: DeepSpeed offloads to 'nvme' or 'cpu'")
    if offload == "nvme":
        Path(nvme_dir).mkdir(parents=True, exist_ok=True)
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": k,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": offload, "pin_memory": cuda, **({"nvme_path": nvme_dir} if offload == "nvme" else {})},
            "offload_optimizer": {"device": offload, "pin_memory": cuda,
                                  **({"nvme_path": nvme_dir} if offload == "nvme" else {})},
        },
        "steps_per_print": 10**9,
    }
    for section, values in (overrides or {}).items():
        target = config.setdefault(section, {})
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(target.get(key), dict):
                target[key] = {**target[key], **value}
            else:
                target[key] = value
    torch.manual_seed(0)
    t0 = time.perf_counter()
    gpt_config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab, block_size=seq)
    if zero_init:
        with deepspeed.zero.Init(remote_device=offload, config_dict_or_path=config):
            model = GPT(gpt_config)
    else:
        model = GPT(gpt_config)
    t1 = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if phases is not None:
        phases.update(build_s=t1 - t0, initialize_s=time.perf_counter() - t1, config=config)
    batches = list(token_loader(vocab, seq, k * steps * micro_batch, micro_batch))
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for x, y in batches[step * k : (step + 1) * k]:
            x, y = x.to(engine.device), y.to(engine.device)
            logits = engine(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.view(-1))
            engine.backward(loss)
            engine.step()
        if cuda:
            torch.cuda.synchronize()  # (the benchmark's clock)
        times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(step)
    return times


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    width = max(20, *(len(c) for c in cols))
    print(" | ".join(f"{c:>{width}}" for c in cols))
    for row in rows:
        print(" | ".join(f"{str(row.get(c, '-')):>{width}}" for c in cols))


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}


def add_model_args(parser: Any, n_layer: int, seq: int) -> None:
    """The GPT shape every benchmark takes (and the child flags that carry it)."""
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=n_layer)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=seq)


MODEL_FLAGS = ["n_embd", "n_layer", "n_head", "vocab", "seq"]


def add_machine_args(parser: Any) -> None:
    """Hidden flags that carry the parent's machine measurement to each child."""
    for name in ("read-bps", "write-bps", "opt-rate"):
        parser.add_argument(f"--{name}", type=float, default=0.0, help="==SUPPRESS==")  # argparse.SUPPRESS


def probe_disk(args: Any, directory: str, quick: bool = False) -> None:
    """O_DIRECT (read, write) bandwidth of ``directory`` onto ``args.read_bps``/``args.write_bps``: 256 MiB each
    way, the best of three (``quick``: 8 MiB once). :func:`measure_machine`'s probe, and ``compare.py``'s
    again before each round."""
    from pathlib import Path

    from lightning_greedysnake.planner.measure import disk_bandwidth

    args.read_bps, args.write_bps = disk_bandwidth(Path(directory), nbytes=(8 if quick else 256) << 20,
                                                   repeats=1 if quick else 3)


def measure_machine(args: Any, directory: str, quick: bool = False, device_tier: bool | None = None) -> None:
    """O_DIRECT bandwidth of ``directory`` (256 MiB each way, the best of three) and the optimizer's rate,
    onto ``args`` (once, in the parent). The rate is measured at the intra-op threads greedysnake's optimizer
    lane gets on this machine (``args.opt_threads``: 1 where the model computes on the CPU; with a GPU,
    ``device_tier`` (None: whether CUDA is available), the cores the training and I/O threads leave), so
    the roofline's optimizer bound is the lane's, not all cores'. ``quick``: 8 MiB once and a small
    optimizer (a dry run's numbers, seconds sooner and meaningless)."""

    from lightning_greedysnake.planner.measure import available_cores, optimizer_rate
    from lightning_greedysnake.planner.threads import optimizer_threads

    if device_tier is None:
        import torch

        device_tier = torch.cuda.is_available()
    probe_disk(args, directory, quick)
    args.opt_threads = optimizer_threads(available_cores(), device_tier=device_tier)
    args.opt_rate = (optimizer_rate(numel=1 << 16, threads=args.opt_threads) if quick
                     else optimizer_rate(threads=args.opt_threads))
    print(f"  disk: read {args.read_bps / 1e9:.2f} GB/s, write {args.write_bps / 1e9:.2f} GB/s; "
          f"optimizer {args.opt_rate / 1e6:.0f} M elements/s at the lane's {args.opt_threads} thread(s)",
          file=sys.stderr)


def write_result(out: str, args: Any, settings: list[str], rows: list[dict[str, Any]],
                 machine_extra: dict[str, Any] | None = None) -> None:
    """The JSON every benchmark writes: the exact command, the machine, the settings and the rows."""
    from pathlib import Path

    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {**machine(), **(machine_extra or {})},
        "settings": {k: getattr(args, k) for k in settings},
        "rows": rows,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def baseline_tree(ref: str, directory: str) -> str:
    """A checkout of git ``ref`` of this repository under ``directory`` (a detached worktree, removed
    with the directory), for running a baseline version side by side with the working tree."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    tree = Path(directory) / f"baseline-{ref.replace('/', '_')}"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), ref], check=True,
                   capture_output=True)
    return str(tree)


def remove_baseline_tree(tree: str) -> None:
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", tree], check=False, capture_output=True)
