"""DeepSpeed ZeRO-Infinity beside greedysnake on the GPU machine (an H100 or an H200): ZeRO-3 with the
parameters and the optimizer state offloaded to NVMe in the same offload directory, the same model and
data as ``benchmarks/gpu.py`` (its ``add_run_args``), at the K of greedysnake's SSD rows (``vertical_ssd``),
the steady state timed alike (the mean of the steps after the two warm-up steps). In two phases, which
``gpu_session.sh`` runs apart (the op build beside the CUDA tests, which time nothing; the run last):

    python benchmarks/gpu_deepspeed.py build --out DIR --offload-dir D --budget-s 80 --wheels .gpu_wheels
    python benchmarks/gpu_deepspeed.py run --out DIR --offload-dir D --k 8 --budget-s 60 --wheels .gpu_wheels
    python benchmarks/gpu_deepspeed.py --out DIR --offload-dir D ...   # both in turn (``all``)

The GPU machine has no DeepSpeed and no network. ``--wheels`` names the folder
``benchmarks/build_gpu_wheels.sh`` built here (DeepSpeed, the Python packages the image lacks, Debian's
libaio): installed with ``pip --no-index --find-links`` into ``--site`` (a target directory, by
default ``.gpu_site`` in the repository, git-ignored: the image's torch is not touched), libaio
unpacked beside it (``dpkg -x``) and named to the compiler (``CPATH``, ``LIBRARY_PATH``) and the loader
(``LD_LIBRARY_PATH``). Then, each in a fresh process in its own process group under a timeout:

1. ``build``: the install, then ``build_async_io`` and ``build_cpu_adam`` side by side: DeepSpeed's two
   ops compiled (its JIT, on first use, cached for the run: about :data:`BUILD_EXPECTED_S` on 16 cores);
   one row, ``config: deepspeed_build``;
2. ``run``: the training steps (about :data:`RUN_EXPECTED_S`; the child gets twice that, or what is left
   of ``--budget-s``); one row, ``config: deepspeed``, with the same measurements as ``gpu.py``'s rows
   (peak host RSS, SSD bytes per step from the kernel's counters, model TFLOP/s), ``expected_s`` and
   ``timeout_s``. Where the build failed or did not finish, the run's row says so and nothing runs.

Every outcome is a row appended to ``DIR/rows.jsonl``: the step times, or the honest failure (which
phase, the error, the end of its log: a missing libaio, a compiler error, DeepSpeed against this torch).
A recorded failure of DeepSpeed exits 0; only this script's own errors exit 1.

Dry run on a CPU (``--dry-run``: tiny sizes; ``DS_ACCELERATOR=cpu``; DeepSpeed installed here by hand,
see ``benchmarks/compare.py``, or from the wheels under Python 3.12: ``benchmarks/check_gpu_image.sh``):
the same path; there the first ``run`` also compiles DeepSpeed's shared-memory collective op for its CPU
accelerator (minutes on a small CPU box; not on CUDA, which uses NCCL). Wheels for Python 3.12 are
installed on any Python (the check that the folder is complete) but put on the path only on 3.12.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

WHEEL_PYTHON = (3, 12)
"""The GPU image's Python, the wheels' (``build_gpu_wheels.sh``)."""

OPS = {"async_io": "AsyncIOBuilder", "cpu_adam": "CPUAdamBuilder"}
"""DeepSpeed's ops ZeRO-Infinity needs here (NVMe swapping; the host Adam), each built in its own process."""


def install(wheels: Path, site: Path) -> tuple[dict[str, str], str | None]:
    """The wheels in ``wheels`` into ``site`` (no index, no dependencies: the image's own torch, numpy and
    the rest stay), the ``.deb`` files unpacked under ``site/libaio``: the environment that makes them
    usable (:func:`site_env`), and the error where one step failed."""
    env: dict[str, str] = {}
    whls = sorted(str(p) for p in wheels.glob("*.whl"))
    if not whls:
        return env, f"no wheels in {wheels} (build them here with benchmarks/build_gpu_wheels.sh, carry the folder)"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), "--only-binary=:all:",
           "--python-version", ".".join(map(str, WHEEL_PYTHON)), "--implementation", "cp",
           "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "any", *whls]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        return env, f"pip install failed ({proc.returncode}): {proc.stderr[-2000:]}"
    debs = sorted(wheels.glob("*.deb"))
    aio = site / "libaio"
    for deb in debs:
        proc = subprocess.run(["dpkg", "-x", str(deb), str(aio)], capture_output=True, text=True, timeout=60,
                              check=False)
        if proc.returncode != 0:
            return env, f"dpkg -x {deb.name} failed: {proc.stderr[-1000:]}"
    return site_env(site)


def site_env(site: Path) -> tuple[dict[str, str], str | None]:
    """The environment that makes what :func:`install` put in ``site`` usable (libaio for the compiler and
    the loader, where its ``.deb`` files were unpacked; the site on Python's path on 3.12), and the error
    where libaio is incomplete."""
    env: dict[str, str] = {}
    aio = site / "libaio"
    if aio.exists():
        lib = next((str(p.parent) for p in aio.rglob("libaio.so*")), None)
        include = next((str(p.parent) for p in aio.rglob("libaio.h")), None)
        if lib is None or include is None:
            return env, f"the .deb files unpacked in {aio} hold no libaio.so and libaio.h"
        for key, value in (("CPATH", include), ("LIBRARY_PATH", lib), ("LD_LIBRARY_PATH", lib)):
            env[key] = os.pathsep.join(filter(None, [value, os.environ.get(key)]))
    if sys.version_info[:2] == WHEEL_PYTHON:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return env, None


def child(args: argparse.Namespace) -> dict[str, Any]:
    """``build_<op>``: that op of :data:`OPS` compiled and loaded; ``run``: the steps (its row)."""
    import torch

    from lightning_greedysnake import GPT, GPTConfig

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.child.startswith("build_"):
        from deepspeed.ops import op_builder

        t0 = time.perf_counter()
        op = args.child[len("build_"):]
        builder = getattr(op_builder, OPS[op])()
        if not builder.is_compatible(verbose=True):  # (prints why: libaio missing, say)
            raise RuntimeError(f"DeepSpeed's {op} op is not compatible with this machine (see the log above)")
        builder.load(verbose=True)
        import deepspeed

        return {"build_s": round(time.perf_counter() - t0, 1), "deepspeed": deepspeed.__version__,
                "torch": torch.__version__}
    from _common import deepspeed_step_times
    from gpu import WARMUP_STEPS, io_bytes, measured_row

    ends: list[float] = []
    io: list[tuple[int, int]] = []

    def on_step(step: int) -> None:  # (after each step's clock stops: the end of the warm-up, then each timed step)
        if step >= WARMUP_STEPS - 1:
            ends.append(time.perf_counter())
        if step in (WARMUP_STEPS - 1, args.steps - 1):
            io.append(io_bytes())
        print(f"  [deepspeed K={args.k}] step {step + 1} done", file=sys.stderr, flush=True)

    times = deepspeed_step_times(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq, args.k, args.steps,
                                 micro_batch=args.micro_batch, bf16=True,
                                 nvme_dir=str(Path(args.offload_dir) / f"deepspeed_{args.k}"), cuda=cuda,
                                 on_step=on_step)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                                      vocab_size=args.vocab, block_size=args.seq)).parameters())
    # (the mean of the timed steps, as gpu.py's; DeepSpeed recomputes nothing here and steps on the host)
    row = measured_row(args, params, args.k, ends, io, recompute=False)
    return {**row, "step_times": [round(t, 3) for t in times[WARMUP_STEPS:]],
            "all_step_times": [round(t, 3) for t in times], "host_optimizer": False, "offloaded": True}


BUILD_EXPECTED_S = 70.0
"""The two ops compiled side by side on the GPU machine's 16 cores (~400 CPU-seconds, the longest file
bounding it; ~200 s on a 2-core box)."""
RUN_EXPECTED_S = 45.0
"""The run on the GPU machine: ~10 s of start and ``deepspeed.initialize`` (the swap files written), then
5 steps of ~6.5 s (the parameters read per micro-batch, 32P = 4.3 GB, and the optimizer state, 16P each
way, at ~1.2 GB/s read, ~2.2 GB/s write)."""


def build(args: argparse.Namespace, deadline: float) -> tuple[dict[str, Any], dict[str, str]]:
    """The install (where ``--wheels`` is given), then the ops compiled side by side: the build row, and the
    environment the run needs."""
    from _common import child_result

    t0 = time.monotonic()
    row: dict[str, Any] = {}
    env: dict[str, str] = {}
    if args.wheels is not None:
        env, error = install(Path(args.wheels), Path(args.site))
        row["install_s"] = round(time.monotonic() - t0, 1)
        if error:
            return {**row, "error": f"install: {error}"}, env
    error = importable(args, env)
    if error:
        return {**row, "error": error}, env
    flags = ["n_embd", "n_layer", "n_head", "vocab", "seq", "micro_batch", "steps", "k"]
    extra = ["--offload-dir", args.offload_dir]
    t1 = time.monotonic()
    timeout = max(1.0, deadline - time.monotonic() - 1.0)
    with ThreadPoolExecutor(len(OPS)) as pool:  # (each a process: the two compile side by side)
        builds = dict(zip(OPS, pool.map(lambda op: child_result(__file__, f"build_{op}", args, flags, extra,
                                                                timeout_s=timeout), OPS)))
    row.update(build_wall_s=round(time.monotonic() - t1, 1), expected_s=BUILD_EXPECTED_S, timeout_s=round(timeout, 1))
    failed = {op: b for op, b in builds.items() if "error" in b}
    if failed:
        return {**row, "error": "op build: " + "; ".join(f"{op}: {b['error']}" for op, b in failed.items()),
                "log_tail": "\n".join(f"---- {op}\n{b['log_tail']}" for op, b in failed.items())}, env
    row.update(build_s=max(b["build_s"] for b in builds.values()), deepspeed=builds["async_io"]["deepspeed"],
               torch=builds["async_io"]["torch"])
    return row, env


def importable(args: argparse.Namespace, env: dict[str, str]) -> str | None:
    """Puts the site on this process's path and the children's environment; why DeepSpeed cannot be
    imported, if it cannot."""
    if "PYTHONPATH" in env:  # (Python 3.12: the wheels' own)
        sys.path.insert(0, args.site)
    os.environ.update(env)  # (the children's environment: the site, libaio for the compiler and the loader)
    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not importable: " + (
            "no --wheels folder was given (benchmarks/build_gpu_wheels.sh builds it)" if args.wheels is None else
            f"the wheels, for Python {'.'.join(map(str, WHEEL_PYTHON))}, were installed in {args.site}, "
            f"this is Python {sys.version.split()[0]}")
    return None


def last_build(out: Path) -> dict[str, Any] | None:
    """The last ``deepspeed_build`` row in ``out/rows.jsonl`` (the build phase's), if any."""
    from _common import read_rows

    builds = [r for r in read_rows(str(out / "rows.jsonl")) if r.get("config") == "deepspeed_build"]
    return builds[-1] if builds else None


def main() -> None:
    from gpu import DRY_RUN_K, TIMEOUT_FACTOR, add_run_args, parse_run_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", nargs="?", choices=["all", "build", "run"], default="all",
                        help="build: install and compile the ops; run: the steps (after a build); all: both")
    add_run_args(parser)
    parser.add_argument("--k", type=int, default=8, help="micro-batches per step (greedysnake's SSD rows' K)")
    parser.add_argument("--budget-s", type=float, default=140.0, help="this phase's seconds (all: both phases')")
    parser.add_argument("--wheels", default=None, help="the folder build_gpu_wheels.sh built (where DeepSpeed is missing)")
    parser.add_argument("--site", default=str(Path(__file__).resolve().parents[1] / ".gpu_site"),
                        help="where the wheels are installed (a pip --target directory)")
    parser.add_argument("--child", choices=[*(f"build_{op}" for op in OPS), "run"], default=None,
                        help=argparse.SUPPRESS)
    args = parse_run_args(parser)
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    from _common import append_row, child_result, exit_on_sigterm

    exit_on_sigterm()
    deadline = time.monotonic() + args.budget_s
    t0 = time.monotonic()
    if args.dry_run:
        args.k = DRY_RUN_K
    out = Path(args.out)

    def record(config: str, row: dict[str, Any]) -> None:
        row = {"stage": "deepspeed", "config": config, "k": args.k, **row, "wall_s": round(time.monotonic() - t0, 1)}
        append_row(str(out / "rows.jsonl"), row)
        said = (f"{row['tokens_per_s']} tokens/s, {row['step_s']} s/step" if "step_s" in row
                else "ok" if "error" not in row else f"FAILED ({row['error']})")
        print(f"  {config} K={args.k}: {said} [{row['wall_s']} s]", file=sys.stderr)
        if "log_tail" in row:
            print(row["log_tail"][-3000:], file=sys.stderr)

    env: dict[str, str] = {}
    built: dict[str, Any] | None
    if args.phase in ("all", "build"):
        built, env = build(args, deadline if args.phase == "build" else deadline - RUN_EXPECTED_S)
        record("deepspeed_build", built)
        if "error" not in built:
            print(f"  deepspeed {built['deepspeed']} ops built in {built['build_s']} s (torch {built['torch']})",
                  file=sys.stderr)
        if args.phase == "build":
            return
    else:  # the build ran before (beside the CUDA tests): its row, and the site it installed
        built = last_build(out)
        if built is not None and "error" not in built and args.wheels is not None:
            env, error = site_env(Path(args.site))
            error = error or importable(args, env)
            if error:
                built = {"error": error}
    if built is None or "error" in built:
        why = "did not finish (no deepspeed_build row: its time ran out?)" if built is None else (
            f"failed: {str(built['error'])[:200]}")
        record("deepspeed", {"error": f"skipped: the build {why}"})
        return
    flags = ["n_embd", "n_layer", "n_head", "vocab", "seq", "micro_batch", "steps", "k"]
    left = deadline - time.monotonic() - 1.0
    expected = RUN_EXPECTED_S
    timeout = round(min(TIMEOUT_FACTOR * expected, left), 1)
    t1 = time.monotonic()
    run = child_result(__file__, "run", args, flags, ["--offload-dir", args.offload_dir], timeout_s=timeout) \
        if left > 5 else {"error": f"skipped: {left:.0f} s left after the op build"}
    record("deepspeed", {**{key: built[key] for key in ("build_s", "deepspeed") if key in built},
                         "run_wall_s": round(time.monotonic() - t1, 1), **run, "expected_s": expected,
                         "timeout_s": timeout})


if __name__ == "__main__":
    main()
