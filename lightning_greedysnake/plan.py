"""``python -m lightning_greedysnake.plan``: measure this machine briefly and print the configuration the
planner picks for a GPT, with its predicted step time.

    python -m lightning_greedysnake.plan --n-embd 1024 --n-layer 12 --n-head 16 --vocab 8192 --seq 128 \\
        --k 8 --offload-dir /mnt/nvme/gs --host-budget-gb 8

Measures: the offload directory's O_DIRECT read and write bandwidth, the fused AdamW element rate, and
one block's forward and backward time at the given micro-batch shape (on this CPU). Prints the
measurements, the choice as a table, and the settings to pass to ``GreedySnakeStrategy``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.engine import SavedBytes
from lightning_greedysnake.models import GPT, GPTConfig, make_units
from lightning_greedysnake.models.adapters import chain_of
from lightning_greedysnake.planner import Machine, UnitCost, plan
from lightning_greedysnake.planner.measure import available_cores, disk_bandwidth, optimizer_rate
from lightning_greedysnake.planner.plan import merge
from lightning_greedysnake.planner.threads import optimizer_threads
from lightning_greedysnake.planner.unit_size import CANDIDATES, choose_unit_size, plans_by_size
from lightning_greedysnake.strategy.planning.placement import planned_costs
from lightning_greedysnake.tensor_manager import state_layout


def block_times(config: GPTConfig, micro_batch: int, seq: int, dtype: torch.dtype, repeats: int = 3
                ) -> tuple[float, float, int]:
    """Seconds of one block's forward and of its recomputing backward (forward again + backward), and
    the bytes its autograd graph holds for one micro-batch."""
    block = GPT(GPTConfig(**{**config.__dict__, "n_layer": 1})).blocks[0].to(dtype)
    x = torch.randn(micro_batch, seq, config.n_embd, dtype=dtype)
    counter = SavedBytes(list(block.parameters()))
    with counter.hooks():
        block(x.detach().requires_grad_())
    fwd = bwd = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        with torch.no_grad():
            block(x)
        fwd = min(fwd, time.perf_counter() - t0)
        leaf = x.detach().requires_grad_()
        t0 = time.perf_counter()
        block(leaf).sum().backward()
        bwd = min(bwd, time.perf_counter() - t0)
    return fwd, bwd, counter.nbytes


def gpt_costs(config: GPTConfig, dtype: torch.dtype, forward_s: float, backward_s: float,
              activation_bytes: int) -> list[UnitCost]:
    """The cost model's units (one block each, every kind on SSD) of the GPT as the tensor manager lays it
    out (the strategy's own :func:`~lightning_greedysnake.tensor_manager.state_layout` of the model built on
    the meta device, AdamW's state: the embedding in the first unit, the head in the last), with each
    block's measured times."""
    with torch.device("meta"):
        model = GPT(config)
    chain = chain_of(model)
    assert chain is not None
    optimizer = torch.optim.AdamW(model.parameters())
    on_ssd = OffloadConfig().placed()  # (every kind on SSD: auto=False's placement)
    state = state_layout(make_units(chain, 1), {}, optimizer, on_ssd, dtype)
    costs = planned_costs(state, on_ssd, alpha=0.0, device_tier=False)
    last = len(costs) - 1
    return [dataclasses.replace(cost, forward_s=forward_s, backward_s=backward_s, activation_bytes=activation_bytes,
                                recompute_s=forward_s if u < last else 0.0) for u, cost in enumerate(costs)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--k", type=int, default=8, help="micro-batches per step (accumulate_grad_batches)")
    parser.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="bf16-mixed")
    parser.add_argument("--offload-dir", default=".", help="where the offload files will live")
    parser.add_argument("--host-budget-gb", type=float, default=8.0, help="host memory for staging and saved activations")
    parser.add_argument("--probe-mb", type=int, default=256, help="size of the bandwidth probe file")
    args = parser.parse_args(argv)

    config = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, vocab_size=args.vocab,
                       block_size=args.seq)
    bf16 = args.precision == "bf16-mixed"
    read_bps, write_bps = disk_bandwidth(Path(args.offload_dir), nbytes=args.probe_mb << 20)
    rate = optimizer_rate(threads=optimizer_threads(available_cores(), device_tier=torch.cuda.is_available()))
    fwd, bwd, act = block_times(config, args.micro_batch, args.seq, torch.bfloat16 if bf16 else torch.float32)
    units = gpt_costs(config, torch.bfloat16 if bf16 else torch.float32, fwd, bwd, act)
    unit_input_bytes = args.micro_batch * args.seq * args.n_embd * (2 if bf16 else 4)
    machine = Machine(read_bps, write_bps, rate)
    budget = int(args.host_budget_gb * 2**30)
    plans = plans_by_size({n: (merge(units, n), machine) for n in CANDIDATES if n <= args.n_layer}, args.k, budget,
                          unit_input_bytes)  # (the unit size by setup's rule; the rest as the warm-step plan)
    # (where no size fits, plan says why)
    choice = plans[choose_unit_size(plans)] if plans else plan(units, machine, args.k, budget, unit_input_bytes)
    print(f"measured: SSD {machine.disk}; optimizer "
          f"{rate / 1e6:.0f} M elements/s; block forward {fwd * 1e3:.1f} ms, recompute+backward {bwd * 1e3:.1f} ms")
    print(choice.table())
    print(
        f"\nGreedySnakeStrategy(alpha={choice.alpha}, lag={choice.lag}, layers_per_unit={choice.layers_per_unit}, "
        f"recompute={choice.recompute}, offload={{"
        + (f"'activations': '{choice.activations}', " if choice.activations != "none" else "")
        + f"'buffer_budget_bytes': {choice.buffer_budget_bytes}}})"
    )


if __name__ == "__main__":
    main()
