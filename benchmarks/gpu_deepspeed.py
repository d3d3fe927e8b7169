"""DeepSpeed ZeRO-Infinity beside greedysnake on the GPU machine: ZeRO-3 with the parameters and the
optimizer state offloaded to NVMe in the same offload directory, the same model and data as
``benchmarks/gpu.py`` (its ``add_run_args``), at the K of greedysnake's SSD rows (``vertical_ssd``), the
steady state timed alike (the mean step after the two warm-up steps). ``gpu_session.sh``'s last stage:

    python benchmarks/gpu_deepspeed.py --out DIR --offload-dir D --k 8 --budget-s 140 --wheels .gpu_wheels

The GPU machine has no DeepSpeed and no network. ``--wheels`` names the folder
``benchmarks/build_gpu_wheels.sh`` built here (DeepSpeed, the Python packages the image lacks, Debian's
libaio): installed with ``pip --no-index --find-links`` into ``--site`` (a target directory, by
default ``.gpu_site`` in the repository, git-ignored: the image's torch is not touched), libaio
unpacked beside it (``dpkg -x``) and named to the compiler (``CPATH``, ``LIBRARY_PATH``) and the loader
(``LD_LIBRARY_PATH``). Then, each in a fresh process under the stage's budget:

1. ``build_async_io`` and ``build_cpu_adam``, side by side: DeepSpeed's two ops compiled (its JIT, on
   first use; a minute or so on 16 cores);
2. ``run``: the training steps.

Every outcome is one row appended to ``DIR/rows.jsonl`` (``config: deepspeed``): the step times, or the
honest failure (which step, the error, the end of its log: a missing libaio, a compiler error, DeepSpeed
against this torch). A recorded failure of DeepSpeed exits 0; only this script's own errors exit 1.

Dry run on a CPU (``--dry-run``: tiny sizes; ``DS_ACCELERATOR=cpu``; DeepSpeed installed here by hand,
see ``benchmarks/compare.py``): the same path; there the first ``run`` also compiles DeepSpeed's
shared-memory collective op for its CPU accelerator (minutes on a small CPU box; not on CUDA, which uses
NCCL). Wheels for Python 3.12 are installed on any Python (the check that the folder is complete) but
put on the path only on 3.12.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
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
    usable, and the error where one step failed."""
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
    if debs:
        lib = next((str(p.parent) for p in aio.rglob("libaio.so*")), None)
        include = next((str(p.parent) for p in aio.rglob("libaio.h")), None)
        if lib is None or include is None:
            return env, f"the .deb files in {wheels} hold no libaio.so and libaio.h"
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
    from gpu import WARMUP_STEPS, _model_flops

    times = deepspeed_step_times(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq, args.k, args.steps,
                                 micro_batch=args.micro_batch, bf16=True,
                                 nvme_dir=str(Path(args.offload_dir) / f"deepspeed_{args.k}"), cuda=cuda)
    step_s = statistics.mean(times[WARMUP_STEPS:])
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                                      vocab_size=args.vocab, block_size=args.seq)).parameters())
    tokens = args.k * args.micro_batch * args.seq
    return {"params_M": round(params / 1e6, 1), "step_s": round(step_s, 3), "tokens_per_s": round(tokens / step_s, 1),
            "TFLOPs": round(_model_flops(args, params, tokens) / step_s / 1e12, 3),
            "step_times": [round(t, 3) for t in times]}


def main() -> None:
    from gpu import add_run_args, parse_run_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    parser.add_argument("--k", type=int, default=8, help="micro-batches per step (greedysnake's SSD rows' K)")
    parser.add_argument("--budget-s", type=float, default=140.0, help="this stage's seconds: install, build, run")
    parser.add_argument("--wheels", default=None, help="the folder build_gpu_wheels.sh built (where DeepSpeed is missing)")
    parser.add_argument("--site", default=str(Path(__file__).resolve().parents[1] / ".gpu_site"),
                        help="where the wheels are installed (a pip --target directory)")
    parser.add_argument("--child", choices=[*(f"build_{op}" for op in OPS), "run"], default=None,
                        help=argparse.SUPPRESS)
    args = parse_run_args(parser)
    if args.child:
        print("RESULT " + json.dumps(child(args)))
        return
    from _common import append_row, child_result

    deadline = time.monotonic() + args.budget_s
    t0 = time.monotonic()
    k = 2 if args.dry_run else args.k  # (gpu.py's dry-run K)
    base = {"stage": "deepspeed", "config": "deepspeed", "k": k}

    def record(row: dict[str, Any]) -> None:
        row = {**base, **row, "wall_s": round(time.monotonic() - t0, 1)}
        append_row(str(Path(args.out) / "rows.jsonl"), row)
        print(f"  deepspeed K={k}: " + (f"{row['tokens_per_s']} tokens/s, {row['step_s']} s/step" if "error" not in row
                                        else f"FAILED ({row['error']})") + f" [{row['wall_s']} s]", file=sys.stderr)
        if "log_tail" in row:
            print(row["log_tail"][-3000:], file=sys.stderr)

    env: dict[str, str] = {}
    phases: dict[str, float] = {}  # (each phase's seconds, for the next run's budget)
    if args.wheels is not None:
        env, error = install(Path(args.wheels), Path(args.site))
        phases["install_s"] = round(time.monotonic() - t0, 1)
        if error:
            record({"error": f"install: {error}"})
            return
        if "PYTHONPATH" in env:  # (Python 3.12: the wheels' own)
            sys.path.insert(0, args.site)
    if importlib.util.find_spec("deepspeed") is None:
        record({"error": "DeepSpeed is not importable: " + (
            "no --wheels folder was given (benchmarks/build_gpu_wheels.sh builds it)" if args.wheels is None else
            f"the wheels, for Python {'.'.join(map(str, WHEEL_PYTHON))}, were installed in {args.site}, "
            f"this is Python {sys.version.split()[0]}")})
        return
    os.environ.update(env)  # (the children's environment: the site, libaio for the compiler and the loader)
    if args.dry_run:
        args.k = k
    flags = ["n_embd", "n_layer", "n_head", "vocab", "seq", "micro_batch", "steps", "k"]
    extra = ["--offload-dir", args.offload_dir]
    t1 = time.monotonic()
    with ThreadPoolExecutor(len(OPS)) as pool:  # (each a process: the two compile side by side)
        builds = dict(zip(OPS, pool.map(lambda op: child_result(__file__, f"build_{op}", args, flags, extra,
                                                                timeout_s=deadline - time.monotonic() - 1.0), OPS)))
    phases["build_wall_s"] = round(time.monotonic() - t1, 1)
    failed = {op: b for op, b in builds.items() if "error" in b}
    if failed:
        record({**phases, "error": "op build: " + "; ".join(f"{op}: {b['error']}" for op, b in failed.items()),
                "log_tail": "\n".join(f"---- {op}\n{b['log_tail']}" for op, b in failed.items())})
        return
    build = {"build_s": max(b["build_s"] for b in builds.values()), "deepspeed": builds["async_io"]["deepspeed"]}
    print(f"  deepspeed {build['deepspeed']} ops built in {build['build_s']} s "
          f"(torch {builds['async_io']['torch']})", file=sys.stderr)
    left = deadline - time.monotonic() - 1.0
    t1 = time.monotonic()
    run = child_result(__file__, "run", args, flags, extra, timeout_s=left) if left > 5 else {
        "error": f"skipped: {left:.0f} s left after the op build"}
    phases["run_wall_s"] = round(time.monotonic() - t1, 1)
    record({**{key: build[key] for key in ("build_s", "deepspeed")}, **phases, **run})


if __name__ == "__main__":
    main()
