"""Optimizer state kept in bf16: the stochastic narrowing is unbiased, deterministic in its seed, and
keeps a decaying second moment decaying where rounding to nearest would freeze it."""

from __future__ import annotations

import pytest
import torch

from lightning_greedysnake.config import OffloadConfig
from lightning_greedysnake.optim.state_format import StateFormat, stochastic_round_


def _sr(x: torch.Tensor, seed: int) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    stochastic_round_(x.clone(), out, seed)
    return out


def test_values_representable_in_bf16_are_kept_exactly():
    x = torch.randn(10_000).bfloat16().float()
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")])
    assert torch.equal(_sr(x, 3).float(), x)


def test_rounding_is_to_a_neighbour_and_unbiased():
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    hi = torch.tensor(1.0 + 2.0 ** -7, dtype=torch.bfloat16)  # the next bf16 value after 1.0
    for frac in (0.1, 0.5, 0.9):
        value = 1.0 + frac * 2.0 ** -7
        for sign in (1.0, -1.0):
            x = torch.full((200_000,), sign * value)
            got = _sr(x, 11).float()
            assert set(got.abs().unique().tolist()) <= {lo.item(), hi.item()}
            assert got.mean().item() == pytest.approx(sign * value, abs=2.0 ** -7 * 0.01)  # unbiased
            share_up = (got.abs() == hi.item()).float().mean().item()
            assert share_up == pytest.approx(frac, abs=0.01)


def test_deterministic_in_the_seed():
    x = torch.randn(3_000_000)  # (more than one pass over the noise table)
    assert torch.equal(_sr(x, 5), _sr(x, 5))
    assert not torch.equal(_sr(x, 5), _sr(x, 6))
    nearest = x.bfloat16()
    assert not torch.equal(_sr(x, 5), nearest)


def test_a_decaying_second_moment_keeps_decaying():
    """Adam's ``v <- 0.999 v`` changes v by less than half a bf16 ulp: rounded to nearest, it never moves;
    rounded stochastically it follows the fp32 decay (here over 2,000 steps, on many elements)."""
    fmt = StateFormat(torch.bfloat16)
    n, steps = 4096, 2000
    state = torch.ones(n, dtype=torch.bfloat16)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    for step in range(steps):
        wide, base = fmt.widen({"v": state}, 0, n)
        assert base == 0 and wide["v"].dtype == torch.float32
        wide["v"].mul_(0.999)
        fmt.narrow(wide, {"v": state}, 0, n, seed=step)
        nearest = (nearest.float() * 0.999).bfloat16()
    expected = 0.999 ** steps
    assert nearest.float().mean().item() == 1.0  # frozen
    assert state.float().mean().item() == pytest.approx(expected, rel=0.02)


def test_fp32_state_is_stepped_in_place():
    fmt = StateFormat(torch.float32)
    views = {"exp_avg": torch.zeros(8)}
    wide, base = fmt.widen(views, 2, 6)
    assert base == 0 and wide["exp_avg"] is views["exp_avg"]
    fmt.narrow(wide, views, 2, 6, seed=0)  # nothing to do


def test_the_setting_names_its_values():
    assert OffloadConfig(optimizer_state_dtype="bf16").optimizer_state_dtype == "bfloat16"
    assert OffloadConfig(optimizer_state_dtype=torch.bfloat16).optimizer_state_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"optimizer_state_dtype='float16'.*'float32'.*'bfloat16'"):
        OffloadConfig(optimizer_state_dtype="float16")
    with pytest.raises(ValueError, match=r"optimizer_state_dtype='bfloat16' needs the tensor manager"):
        OffloadConfig.everywhere("device", optimizer_state_dtype="bfloat16")


def test_a_range_rounds_as_it_does_inside_the_whole():
    """How a unit is cut (alpha's parts, ranks' chunks) does not change how an element rounds."""
    x = torch.randn(2_500_000)
    whole = _sr(x, 9)
    for lo, hi in ((0, 4096), (4096, 1_300_000), (1_300_000, 2_500_000)):
        part = torch.empty(hi - lo, dtype=torch.bfloat16)
        stochastic_round_(x[lo:hi].clone(), part, 9, start=lo)
        assert torch.equal(part, whole[lo:hi])
