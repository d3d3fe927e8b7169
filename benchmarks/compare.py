"""Side by side in one run: greedysnake vertical, greedysnake horizontal (ZeRO-Infinity's order on our
engine), Lightning's default strategy in memory, DeepSpeed ZeRO-Infinity (ZeRO-3 with parameters
and optimizer on NVMe: ``deepspeed``) and DeepSpeed ZeRO-3 with both in host memory (ZeRO-Offload:
``deepspeed_cpu``, the fair peer of state in RAM), on one model, one data stream and each K; runs interleaved (every system at a
K before the next K, each round starting one system later) in fresh processes, so machine drift and a slot's
bias hit all alike.

DeepSpeed is optional and kept out of CI. To include it on a CPU machine:

    apt-get install -y libaio-dev && pip install --no-build-isolation deepspeed   # after torch
    DS_ACCELERATOR=cpu python benchmarks/compare.py      # first run compiles DeepSpeed's ops (~200 s)

    python benchmarks/compare.py --seq 128 --ks 8                     # the reference configuration
    python benchmarks/compare.py --seq 32 --ks 1 2 4 8 16             # the I/O-bound regime, K sweep
    python benchmarks/compare.py --seq 128 --ks 8 --systems gs_vertical --baseline a952f99 --rounds 3
                                     # this tree against an earlier commit, runs alternating, ratio of medians

Each run's step time is the median of its steps after the second (``--steps``, default 6: steps 3 to 6),
every system alike: the first steps are warm-up (DeepSpeed's, and greedysnake's first steps run at the
fixed settings until ``auto=True``'s plan after step 2, and the step after the plan may still run slow). Results measured before this rule (commits up to 3749a5f) took the median after the first of 3.

Writes a table, ``benchmarks/results/compare.json`` and a plot of tokens/s against K per system with
greedysnake vertical's roofline (``compare.png``, needs ``pip install -e .[bench]``): of physical terms only,
max(the same round's ``gs_default`` step: compute with every kind in RAM; the I/O counters' bytes over the
probed bandwidths (probed again before each round), reads and writes added; the parameters over the
optimizer's kernel rate), in ``roofline_s`` (= ``limit_s``), the step's multiple of it (``vs_limit``), its
fraction (``fraction_of_roofline``) and the term that binds (``binds``), for every row with SSD traffic
when ``gs_default`` ran in the same round.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEEPSPEED = {"deepspeed": "nvme", "deepspeed_cpu": "cpu"}
"""The DeepSpeed systems and where each offloads: ``deepspeed`` is ZeRO-Infinity (ZeRO-3, parameters and
optimizer state on NVMe), the peer of greedysnake with its state on SSD; ``deepspeed_cpu`` is ZeRO-3 with
both in host memory (ZeRO-Offload), the peer of greedysnake with its state in RAM (the defaults where the
host budget holds the model's state)."""

SYSTEMS = ["gs_vertical", "gs_vertical_ram", "gs_vertical_ram_io", "gs_planned", "gs_auto", "gs_auto_ssd",
           "gs_default", "gs_cpu", "gs_bf16_state", "gs_8bit_state", "gs_auto_ssd_bf16_state", "gs_vertical_whole", "gs_horizontal", "lightning_auto", "deepspeed", "deepspeed_cpu"]
"""``gs_vertical``: the vertical schedule with the fixed defaults (``auto=False``: ZeRO-Infinity's
placement, every kind on SSD, alpha 0.25, lag 2); ``gs_vertical_ram``: the same fixed settings with every
kind in RAM (the same schedule, recompute, lag and lane without the disk: the step and the lane's CPU that
``gs_vertical``'s are set against, ``vs_same_in_ram`` and ``lane_cpu_vs_ram``); ``gs_vertical_ram_io``:
``gs_vertical_ram`` while another process keeps the offload disk busy (``_common.io_load``: reads and writes
alternated at greedysnake's request size and depth, as fast as the disk takes them), what the disk's traffic
alone costs the same computation (its ``vs_same_in_ram``; ``gs_vertical``'s step against it,
``vs_ram_beside_disk``, is what the SSD path costs beyond that); ``gs_planned``: it with the
planner's choice, planned from the costs ``gs_vertical`` measured at the same K (so it runs after it); ``gs_auto``: the defaults
(``auto=True``: placement planned at setup, the rest after the second step) with ``--host-budget-gb``;
``gs_auto_ssd``: the defaults with every kind on SSD (ZeRO-Infinity's placement given explicitly; the
unit size, alpha, lag, recompute and the staging budget planned);
``gs_default``: ``GreedySnakeStrategy()`` as is (the host budget: half of the available memory);
``gs_cpu``: the ``greedysnake_cpu`` preset (every kind in RAM; its step time is what ``gs_auto`` and
``gs_default`` are given relative to, ``time_vs_cpu``); ``gs_bf16_state``: ``gs_vertical`` with the
optimizer state kept in bf16 (``offload.optimizer_state_dtype=bfloat16``; its SSD bytes and step time
are given relative to ``gs_vertical``'s in the same round); ``gs_8bit_state``: ``gs_vertical`` with
torchao's ``AdamW8bit`` (quantized state streamed as it is; likewise relative to ``gs_vertical``);
``gs_auto_ssd_bf16_state``: ``gs_auto_ssd`` with bf16 optimizer state (relative to ``gs_auto_ssd``);
``gs_vertical_whole``: ``gs_vertical`` with AdamW stepped on whole parameters (``optimizer_path=
"whole_parameter"``, the path of Adafactor and Muon; relative to ``gs_vertical``, element-wise)."""


def _ssd_bytes(trainer: Any) -> int:
    """Bytes greedysnake's tensor manager moved to and from its SSD so far (0 without one)."""
    from lightning_greedysnake.config import TensorKind

    manager = getattr(trainer.strategy, "tensor_manager", None)
    if manager is None:
        return 0
    return sum(manager.stats.bytes_read(k.value) + manager.stats.bytes_written(k.value) for k in TensorKind)


def run_lightning(args: argparse.Namespace, system: str, k: int) -> dict[str, Any]:
    import lightning as L
    from _common import WARMUP_STEPS, gpt_module, io_load, token_loader

    from lightning_greedysnake import GreedySnakeStrategy
    from lightning_greedysnake.config import TensorKind
    from lightning_greedysnake.planner.measure import unit_times
    from lightning_greedysnake.strategy.planning.placement import unit_costs

    Module, _ = gpt_module(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq,
                           optimizer="AdamW8bit" if system == "gs_8bit_state" else "AdamW")
    times: list[float] = []
    extra: dict[str, Any] = {}

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.t = time.perf_counter()
            self.steady_from = 0.0

        def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
            if (trainer.fit_loop.epoch_loop.batch_idx + 1) % k == 0:
                now = time.perf_counter()
                times.append(now - self.t)
                self.t = now
                if len(times) == 1:
                    self.steady_from = now  # unit times from the steps after the first (and after auto's plan)
                    self.first_bytes = _ssd_bytes(trainer)  # (the first step reads no optimizer state)

        def on_train_end(self, trainer: Any, module: Any) -> None:
            manager = getattr(trainer.strategy, "tensor_manager", None)
            if manager is not None and trainer.global_step > 1:
                manager.drain()
                moved = _ssd_bytes(trainer) - self.first_bytes
                extra["ssd_GB_per_step"] = round(moved / (trainer.global_step - 1) / 1e9, 3)  # steady state
            if manager is None or system == "gs_horizontal":
                return
            steady = trainer.strategy.step_telemetry[WARMUP_STEPS:]  # lane seconds per steady step: which lane binds
            for name in ("ssd_read_busy_s", "ssd_write_busy_s", "optimizer_busy_s", "io_wait_s", "optimizer_unhidden_s",
                         "optimizer_cpu_s", "optimizer_read_wait_s", "disk_busy_fraction", "queue_depth"):
                extra[name] = round(sum(getattr(t, name) for t in steady) / max(1, len(steady)), 3)
            # where the step waits: the disk's busy fraction and what it achieved while busy, against the probe
            n = max(1, len(steady))
            read_b, write_b = (sum(t.request_bytes_read for t in steady) / n, sum(t.request_bytes_written for t in steady) / n)
            read_busy, write_busy = (sum(t.disk_read_busy_s for t in steady) / n, sum(t.disk_write_busy_s for t in steady) / n)
            extra["read_GBps_busy"] = round(read_b / 1e9 / read_busy, 3) if read_busy else 0.0
            extra["write_GBps_busy"] = round(write_b / 1e9 / write_busy, 3) if write_busy else 0.0
            requests = sum(t.read_requests + t.write_requests for t in steady)
            extra["request_MiB"] = round((read_b + write_b) * n / requests / 2**20, 2) if requests else 0.0
            # the forward phase apart (the previous step's deferred parts run in it): its share of the step and
            # the disk's busy fraction in it and in the rest
            forward, wall = sum(t.forward_s for t in steady) / n, sum(t.wall_s for t in steady) / n
            fwd_busy = sum(t.forward_disk_busy_s for t in steady) / n
            busy = sum(t.disk_busy_s for t in steady) / n
            extra["forward_s"] = round(forward, 3)
            extra["forward_disk_busy"] = round(fwd_busy / forward, 3) if forward else 0.0
            extra["backward_disk_busy"] = round((busy - fwd_busy) / (wall - forward), 3) if wall > forward else 0.0
            # the roofline's physical terms: the disk at its probed speeds (reads and writes one after the other)
            # and the optimizer's kernel rate over every element; compute is the gs_default row of the same round
            extra["disk_s"] = round(read_b / args.read_bps + write_b / args.write_bps, 3)
            extra["optimizer_s"] = round(sum(p.numel() for p in module.parameters()) / args.opt_rate, 3)
            if trainer.strategy.plan_choice is not None:
                extra["plan"] = dataclasses.asdict(trainer.strategy.plan_choice)
            if trainer.strategy.placement_plan is not None:  # units of each kind in RAM / all units
                extra["placement"] = {kind: f"{p.host_units}/{p.num_units}"
                                      for kind, p in trainer.strategy.placement_plan.kinds.items()}
            manager.drain()
            fwd, bwd = unit_times(manager.stats.lanes.spans(self.steady_from, float("inf")), manager.num_units)
            costs = unit_costs(manager, fwd, bwd, trainer.strategy.engine.activation_bytes)
            if not trainer.strategy.config.recompute:  # measured without recompute: nothing to take out
                costs = [dataclasses.replace(c, recompute_s=0.0) for c in costs]
            extra["recompute"] = trainer.strategy.config.recompute
            extra["units"] = [dataclasses.asdict(c) for c in costs]

    offload: dict[str, Any] = {"return_weights": False, "buffer_budget_bytes": int(args.budget_gb * 2**30) or None}
    settings: dict[str, Any] = {"auto": False}
    if system == "gs_planned":
        chosen = json.loads(args.plan)
        settings = {"auto": False, "alpha": chosen["alpha"], "lag": chosen["lag"], "layers_per_unit": chosen["layers_per_unit"],
                    "recompute": chosen["recompute"]}
        offload.update(buffer_budget_bytes=chosen["buffer_budget_bytes"])
        if chosen["recompute"]:
            offload.update(activations=chosen["activations"])
        extra["plan"] = chosen
    if system == "gs_auto":
        settings = {"auto_host_budget_bytes": int(args.host_budget_gb * 2**30)}
        offload.pop("buffer_budget_bytes")  # planned
    if system in ("gs_auto_ssd", "gs_auto_ssd_bf16_state"):
        settings = {"offload": {kind: "ssd" for kind in ("weights", "master_weights", "optimizer_states", "gradients")}}
        offload.pop("buffer_budget_bytes")
    if system in ("gs_vertical_ram", "gs_vertical_ram_io"):
        settings = {"auto": False, "offload": {kind.value: "host" for kind in TensorKind}}
    if system == "gs_default":
        settings = {}
        offload.pop("buffer_budget_bytes")
    if system == "gs_cpu":  # Trainer(strategy="greedysnake_cpu")
        settings = {"offload": {kind.value: "host" for kind in TensorKind}}
        offload.pop("buffer_budget_bytes")
    if system in ("gs_bf16_state", "gs_auto_ssd_bf16_state"):
        offload.update(optimizer_state_dtype="bfloat16")
    if system == "gs_vertical_whole":
        settings["optimizer_path"] = "whole_parameter"
    if system == "lightning_auto":
        strategy: Any = "auto"
    else:
        offload.update(settings.pop("offload", {}))
        strategy = GreedySnakeStrategy(schedule="horizontal" if system == "gs_horizontal" else "vertical",
                                       offload_dir=Path(args.offload_dir) / f"{system}_{k}", offload=offload,
                                       **settings)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()],
                        default_root_dir=args.offload_dir)
    with trainer.init_module(empty_init=system != "lightning_auto"):
        module = Module()
    with io_load(args.offload_dir) if system == "gs_vertical_ram_io" else contextlib.nullcontext({}) as load:
        trainer.fit(module, token_loader(args.vocab, args.seq, k * args.steps))
    if load:
        extra["io_load_GBps"] = load["GBps"]
    return {"step_times": times, **extra}


def run_deepspeed(args: argparse.Namespace, k: int, offload: str) -> dict[str, Any]:
    from _common import deepspeed_step_times

    times = deepspeed_step_times(args.n_embd, args.n_layer, args.n_head, args.vocab, args.seq, k, args.steps,
                                 micro_batch=1, bf16=args.precision == "bf16-mixed",
                                 nvme_dir=str(Path(args.offload_dir) / f"deepspeed_{k}"), cuda=False, offload=offload)
    return {"step_times": times}


def child(args: argparse.Namespace) -> dict[str, Any]:
    from _common import steady_step_s

    import lightning_greedysnake

    system, k = args.child.split(":")
    k = int(k)
    if system in DEEPSPEED:
        result = run_deepspeed(args, k, DEEPSPEED[system])
    else:
        result = run_lightning(args, system, k)
    step_s = steady_step_s(result["step_times"])
    return {"system": system, "k": k, "step_s": round(step_s, 3), "package": lightning_greedysnake.__file__,
            "tokens_per_s": round(k * args.seq / step_s, 1), **{k_: v for k_, v in result.items() if k_ != "step_times"}}



def _plan_for(rows: list[dict[str, Any]], args: argparse.Namespace, k: int) -> dict[str, Any]:
    """The planner's choice from the costs gs_vertical measured at ``k`` (pure arithmetic)."""
    from lightning_greedysnake.planner import Machine, UnitCost, plan

    measured = next((r for r in rows if r["system"] == "gs_vertical" and r["k"] == k), None)
    if measured is None:
        raise SystemExit("gs_planned needs gs_vertical at the same K (list it first in --systems)")
    units = [UnitCost(**u) for u in measured["units"]]
    itemsize = 2 if args.precision == "bf16-mixed" else 4
    choice = plan(units, Machine(args.read_bps, args.write_bps, args.opt_rate), k,
                  int(args.host_budget_gb * 2**30), unit_input_bytes=args.seq * args.n_embd * itemsize)
    return dataclasses.asdict(choice)


def _medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per system and K with the median step time over the rounds (``round``: "median")."""
    out = []
    for key in dict.fromkeys((r["system"], r["k"]) for r in rows):
        runs = [r for r in rows if (r["system"], r["k"]) == key]
        step_s = statistics.median(r["step_s"] for r in runs)
        out.append({"system": key[0], "k": key[1], "round": "median", "step_s": round(step_s, 3),
                    "tokens_per_s": round(key[1] * runs[0]["seq"] / step_s, 1), "seq": runs[0]["seq"],
                    "runs": len(runs)})
        for name in ("ssd_GB_per_step", "disk_s", "optimizer_s", "disk_busy_fraction", "read_GBps_busy",
                     "write_GBps_busy", "queue_depth", "optimizer_cpu_s", "optimizer_read_wait_s", "forward_s",
                     "forward_disk_busy", "backward_disk_busy"):
            if all(r.get(name) is not None for r in runs):
                out[-1][name] = statistics.median(r[name] for r in runs)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if any(r.get("round") == "median" for r in rows):
        rows = [r for r in rows if r.get("round") == "median" or r.get("roofline_s")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in SYSTEMS:
        pts = sorted((r["k"], r["tokens_per_s"]) for r in rows if r["system"] == system)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=system)
    roof = sorted((r["k"], r["k"] * r["seq"] / r["roofline_s"]) for r in rows if r.get("roofline_s"))
    if roof:
        ax.plot(*zip(*roof), linestyle="--", marker="x", color="gray", label="gs_vertical roofline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("K (micro-batches per step)")
    ax.set_ylabel("tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def add_ratios(rows: list[dict[str, Any]], baseline: str | None = None) -> None:
    """Each row's ratios against the rows of its K and round (the medians against the medians): tokens/s
    against each DeepSpeed peer (``vs_deepspeed``, ``vs_deepspeed_cpu``) and, for greedysnake's rows,
    against Lightning in memory (``vs_lightning_auto``) and the baseline tree (``vs_baseline``); step time
    against the vertical and RAM presets; the roofline's fraction of the step; for ``gs_vertical``'s kin,
    step and lane CPU against the same settings in RAM (``gs_vertical_ram``)."""
    for row in rows:
        same_k = {r["system"]: r for r in rows if r["k"] == row["k"] and r.get("round") == row.get("round")}
        for peer in DEEPSPEED:
            if peer in same_k:
                row[f"vs_{peer}"] = round(row["tokens_per_s"] / same_k[peer]["tokens_per_s"], 2)
        if row["system"].startswith("gs_") and "lightning_auto" in same_k:
            row["vs_lightning_auto"] = round(row["tokens_per_s"] / same_k["lightning_auto"]["tokens_per_s"], 3)
        base = same_k.get(f"{row['system']}@{baseline}") if baseline else None
        if base is not None:
            row["vs_baseline"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
        vertical = same_k.get("gs_auto_ssd" if row["system"] == "gs_auto_ssd_bf16_state" else "gs_vertical")
        if (row["system"] in ("gs_bf16_state", "gs_8bit_state", "gs_auto_ssd_bf16_state", "gs_vertical_whole")
                and vertical is not None
                and vertical.get("ssd_GB_per_step")):
            row["bytes_vs_vertical"] = round(row["ssd_GB_per_step"] / vertical["ssd_GB_per_step"], 3)
            row["time_vs_vertical"] = round(row["step_s"] / vertical["step_s"], 3)
        cpu = same_k.get("gs_cpu")
        if row["system"] in ("gs_auto", "gs_default") and cpu is not None:
            row["time_vs_cpu"] = round(row["step_s"] / cpu["step_s"], 3)
        in_ram = same_k.get("gs_default")
        if row.get("disk_s") and in_ram is not None and row is not in_ram:
            # the roofline, of physical terms only: max(compute measured with every kind in RAM (this round's
            # gs_default step), the disk at its probed speeds (the I/O counters' bytes, reads and writes one
            # after the other), the optimizer's kernel rate); the step's multiple of it and the term that binds.
            # (Never from the SSD run's own unit times: those include what the disk and the lane cost it.)
            terms = {"compute": in_ram["step_s"], "disk": row["disk_s"], "optimizer": row.get("optimizer_s", 0.0)}
            binds = max(terms, key=lambda t: terms[t])
            row["limit_s"] = row["roofline_s"] = round(terms[binds], 3)
            row["vs_limit"] = round(row["step_s"] / terms[binds], 3)
            row["fraction_of_roofline"] = round(terms[binds] / row["step_s"], 3)
            row["binds"] = binds
        same = same_k.get("gs_vertical_ram")
        if row["system"] in AUTO_FALSE_ON_SSD and same is not None:
            # against the same fixed settings in RAM: the same compute (recompute included), lane and lag, so
            # what remains is the disk's cost; the lane's CPU seconds against the same jobs without reads
            row["vs_same_in_ram"] = round(row["step_s"] / same["step_s"], 3)
            if row.get("disk_s"):
                row["vs_limit_same_schedule"] = round(row["step_s"] / max(same["step_s"], row["disk_s"],
                                                                           row.get("optimizer_s", 0.0)), 3)
            if same.get("optimizer_cpu_s"):
                row["lane_cpu_vs_ram"] = round(row["optimizer_cpu_s"] / same["optimizer_cpu_s"], 3)
            beside = same_k.get("gs_vertical_ram_io")
            if beside is not None:  # beyond what the disk's traffic alone costs the same computation
                row["vs_ram_beside_disk"] = round(row["step_s"] / beside["step_s"], 3)
        if row["system"] == "gs_vertical_ram_io" and same is not None:
            row["vs_same_in_ram"] = round(row["step_s"] / same["step_s"], 3)


AUTO_FALSE_ON_SSD = ("gs_vertical", "gs_bf16_state", "gs_8bit_state", "gs_vertical_whole")
"""The systems with ``gs_vertical``'s fixed settings and every kind on SSD: ``gs_vertical_ram`` is their
same-schedule reference in RAM."""


def main() -> None:
    from _common import WARMUP_STEPS, add_machine_args, add_model_args

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, n_layer=12, seq=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[8])
    parser.add_argument("--steps", type=int, default=WARMUP_STEPS + 4)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--budget-gb", type=float, default=0.0,
                        help="greedysnake's offload.buffer_budget_bytes in GiB (0: its default)")
    parser.add_argument("--host-budget-gb", type=float, default=4.0,
                        help="host memory the planner may use for gs_planned (staging and saved activations) and "
                             "gs_auto (per process: the kinds it keeps in RAM, staging, saved activations)")
    parser.add_argument("--plan", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--offload-dir", default=None)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "compare.json"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--baseline", default=None,
                        help="a git ref: also run each greedysnake system from that version, alternating with this one")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every system at every K (alternating)")
    add_machine_args(parser)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args), default=lambda o: sorted(o) if isinstance(o, (set, frozenset)) else str(o)))
        return
    from _common import (
        MODEL_FLAGS,
        baseline_tree,
        measure_machine,
        print_table,
        probe_disk,
        remove_baseline_tree,
        run_child,
        write_result,
    )

    systems = list(args.systems)
    if set(systems) & set(DEEPSPEED) and importlib.util.find_spec("deepspeed") is None:
        print("  deepspeed is not installed: skipping it (see this script's docstring)", file=sys.stderr)
        systems = [s for s in systems if s not in DEEPSPEED]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.offload_dir) as tmp:
        measure_machine(args, tmp)
        baseline = baseline_tree(args.baseline, tmp) if args.baseline else None
        flags = [*MODEL_FLAGS, "steps", "precision", "read_bps", "write_bps", "opt_rate", "budget_gb", "host_budget_gb"]
        try:
            for k in args.ks:
                for round_ in range(args.rounds):
                    if round_:  # a shared disk drifts 2-3x between minutes: each round's disk term at the
                        # speed probed right before it (the children compute disk_s from these flags)
                        probe_disk(args, tmp)
                        print(f"  disk before round {round_}: read {args.read_bps / 1e9:.2f} GB/s, write "
                              f"{args.write_bps / 1e9:.2f} GB/s", file=sys.stderr)
                    # each round starts one system later: no system always runs first in a round (after the
                    # disk probe) or right after the same neighbour (a process that freed gigabytes, or
                    # DeepSpeed's): a slot's bias lands on every system alike
                    shift = round_ % len(systems)
                    for system in systems[shift:] + systems[:shift]:
                        variants = [(system, None)]
                        if baseline is not None and system.startswith("gs_"):
                            variants.append((f"{system}@{args.baseline}", baseline))
                        if round_ % 2:
                            variants.reverse()  # neither version always runs first
                        for label, root in variants:
                            extra_flags = ["--offload-dir", tmp]
                            if system == "gs_planned":
                                extra_flags += ["--plan", json.dumps(_plan_for(rows, args, k))]
                            row = run_child(__file__, f"{system}:{k}", args, flags, extra_flags, package_root=root)
                            probe = [round(args.read_bps / 1e9, 3), round(args.write_bps / 1e9, 3)]
                            row.update(system=label, seq=args.seq, round=round_, probe_GBps=probe)
                            rows.append(row)
                            print(f"  done {label} K={k} round {round_}: {row['tokens_per_s']} tokens/s",
                                  file=sys.stderr)
        finally:
            if baseline is not None:
                remove_baseline_tree(baseline)
    if args.rounds > 1 or baseline is not None:
        rows = _medians(rows) + rows
    add_ratios(rows, args.baseline)
    print_table(rows, ["system", "k", "round", "step_s", "tokens_per_s", "vs_deepspeed", "vs_deepspeed_cpu",
                       "vs_lightning_auto", "vs_baseline", "vs_limit", "binds", "vs_same_in_ram", "vs_ram_beside_disk",
                       "io_load_GBps",
                       "vs_limit_same_schedule", "lane_cpu_vs_ram", "disk_busy_fraction", "read_GBps_busy",
                       "write_GBps_busy", "queue_depth", "optimizer_cpu_s", "optimizer_read_wait_s",
                       "forward_s", "forward_disk_busy", "backward_disk_busy", "fraction_of_roofline",
                       "ssd_GB_per_step", "bytes_vs_vertical", "time_vs_vertical", "time_vs_cpu"])
    out = Path(args.out)
    plotted = plot(rows, out.with_suffix(".png"))
    write_result(str(out), args, [*MODEL_FLAGS, "ks", "steps", "precision", "budget_gb", "baseline", "rounds"], rows,
                 {"read_GBps": args.read_bps / 1e9, "write_GBps": args.write_bps / 1e9,
                  "optimizer_Melem_per_s": args.opt_rate / 1e6, "optimizer_threads": args.opt_threads})
    if plotted:
        print(f"and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
